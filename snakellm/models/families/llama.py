"""Llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases, untied embeddings.

Hugging Face class: ``LlamaForCausalLM``. megatron-core's fused ``linear_qkv`` becomes
``q_proj``, ``k_proj``, ``v_proj`` (rows taken out of the per-query-group interleaving) and
the SwiGLU ``linear_fc1 = [gate; up]`` becomes ``gate_proj`` and ``up_proj``. Plain RoPE only:
a config with rope scaling, another head_dim, a non-SiLU activation, or biases on attention
and not on the MLP (or the reverse) is refused with the key and value.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families.base import Arch, Family, FamilyError, HFKey, Weight, biased, untied

L = "decoder.layers.{i}."
P = "model.layers.{i}."

WEIGHTS = (
    Weight("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), rows="vocab"),
    Weight(
        L + "self_attention.linear_qkv.weight",
        (P + "self_attn.q_proj.weight", P + "self_attn.k_proj.weight", P + "self_attn.v_proj.weight"),
        rows="qkv",
    ),
    Weight(L + "self_attention.linear_proj.weight", (P + "self_attn.o_proj.weight",)),
    Weight(L + "mlp.linear_fc1.weight", (P + "mlp.gate_proj.weight", P + "mlp.up_proj.weight"), rows="gate_up"),
    Weight(L + "mlp.linear_fc2.weight", (P + "mlp.down_proj.weight",)),
    Weight(
        L + "self_attention.linear_qkv.bias",
        (P + "self_attn.q_proj.bias", P + "self_attn.k_proj.bias", P + "self_attn.v_proj.bias"),
        rows="qkv",
        when=biased,
    ),
    Weight(L + "self_attention.linear_proj.bias", (P + "self_attn.o_proj.bias",), when=biased),
    Weight(L + "mlp.linear_fc1.bias", (P + "mlp.gate_proj.bias", P + "mlp.up_proj.bias"), "gate_up", when=biased),
    Weight(L + "mlp.linear_fc2.bias", (P + "mlp.down_proj.bias",), when=biased),
    Weight(L + "input_layernorm.weight", (P + "input_layernorm.weight",)),
    Weight(L + "pre_mlp_layernorm.weight", (P + "post_attention_layernorm.weight",)),
    Weight("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Weight(
        "output_layer.weight", ("lm_head.weight",), "vocab", when=untied, import_fallback="model.embed_tokens.weight"
    ),
)


def _theta(v: Any) -> Any:
    """RoPE base as our config writes it: an int when it is one (10000, not 10000.0)."""
    return int(v) if float(v).is_integer() else v


HF_KEYS = (
    HFKey("num_hidden_layers", "num_layers"),
    HFKey("hidden_size", "hidden_size"),
    HFKey("num_attention_heads", "num_attention_heads"),
    HFKey("num_key_value_heads", "num_query_groups", default=None),  # None: one per head
    HFKey("intermediate_size", "ffn_hidden_size"),
    HFKey("max_position_embeddings", "seq_length"),
    HFKey("rms_norm_eps", "layernorm_epsilon", default=1e-6),
    HFKey("rope_theta", "rotary_base", default=None, to_hf=float, from_hf=_theta),
    HFKey("attention_bias", "bias", default=False, to_hf=bool, from_hf=bool),
    HFKey("mlp_bias", "bias", to_hf=bool, export_only=True),
    HFKey("initializer_range", "init_method_std", default=0.02),
    HFKey("tie_word_embeddings", "tie_embeddings", default=False, to_hf=bool),
)


def _export_extra(arch: Arch) -> dict[str, Any]:
    return {
        "head_dim": arch["hidden_size"] // arch["num_attention_heads"],
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
    }


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise FamilyError(f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported")
    rs = config.get("rope_scaling")
    rp = config.get("rope_parameters") or {}
    scaled = rs and rs.get("rope_type", rs.get("type")) not in (None, "default")
    if scaled or rp.get("rope_type", "default") != "default":
        raise FamilyError(f"{where}: rope scaling {rs or rp} is not supported (plain RoPE only)")
    h, n = config.get("hidden_size"), config.get("num_attention_heads")
    if h and n and config.get("head_dim") not in (None, h // n):
        raise FamilyError(f"{where}: head_dim {config['head_dim']} != hidden_size / heads ({h // n})")
    if bool(config.get("attention_bias", False)) != bool(config.get("mlp_bias", False)):
        raise FamilyError(f"{where}: attention_bias and mlp_bias differ; megatron-core biases all linears or none")
    # newer transformers keep the base in rope_parameters; a top-level rope_theta (the table's row) wins
    return {"rotary_base": _theta(rp["rope_theta"])} if "rope_theta" in rp else {}


FAMILY = Family(
    name="llama",
    summary="RoPE, RMSNorm, SwiGLU, GQA, no biases, untied",
    defaults=dict(
        position_embedding="rope",
        normalization="RMSNorm",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        rotary_base=10000,
        layernorm_epsilon=1e-5,
    ),
    presets={
        "tiny-llama": dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176, seq_length=128
        ),
        # TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads in 4 KV groups, SwiGLU 5632
        "llama-1b": dict(
            num_layers=22,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=4,
            ffn_hidden_size=5632,
            seq_length=2048,
        ),
        # Llama-2 7B's shape (NeMo Launcher's PEFT example): 32 layers, d=4096, 32 heads (no GQA), SwiGLU 11008,
        # vocabulary 32,000, untied embeddings, sequence 4096
        "llama2-7b": dict(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=32,
            ffn_hidden_size=11008,
            seq_length=4096,
            tie_embeddings=False,
        ),
    },
    features=dict(position_embedding="rope", normalization="RMSNorm", activation="swiglu"),
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    hf_export_extra=_export_extra,
    hf_import_extra=_import_extra,
)
