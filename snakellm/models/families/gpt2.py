"""GPT-2 (and Megatron-LM's GPT): learned absolute positions, LayerNorm, GeLU MLP, biases, tied embeddings.

Hugging Face class: ``GPT2LMHeadModel``. Its ``Conv1D`` modules store ``[in, out]``, so every
linear weight is transposed, and its fused ``c_attn`` holds ``[q; k; v]`` over all heads where
megatron-core interleaves them per query group. It always has biases: a bias-free model is
exported with zero biases (which compute the same). It has no grouped-query attention.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families.base import Arch, Family, FamilyError, HFKey, Weight, biased, untied

L = "decoder.layers.{i}."
H = "transformer.h.{i}."

WEIGHTS = (
    Weight("embedding.word_embeddings.weight", ("transformer.wte.weight",), rows="vocab"),
    Weight("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    Weight(L + "self_attention.linear_qkv.weight", (H + "attn.c_attn.weight",), rows="qkv_cat", conv1d=True),
    Weight(L + "self_attention.linear_proj.weight", (H + "attn.c_proj.weight",), conv1d=True),
    Weight(L + "mlp.linear_fc1.weight", (H + "mlp.c_fc.weight",), conv1d=True),
    Weight(L + "mlp.linear_fc2.weight", (H + "mlp.c_proj.weight",), conv1d=True),
    Weight(L + "self_attention.linear_qkv.bias", (H + "attn.c_attn.bias",), "qkv_cat", True, biased, True),
    Weight(L + "self_attention.linear_proj.bias", (H + "attn.c_proj.bias",), "same", True, biased, True),
    Weight(L + "mlp.linear_fc1.bias", (H + "mlp.c_fc.bias",), "same", True, biased, True),
    Weight(L + "mlp.linear_fc2.bias", (H + "mlp.c_proj.bias",), "same", True, biased, True),
    Weight(L + "input_layernorm.weight", (H + "ln_1.weight",)),
    Weight(L + "input_layernorm.bias", (H + "ln_1.bias",)),
    Weight(L + "pre_mlp_layernorm.weight", (H + "ln_2.weight",)),
    Weight(L + "pre_mlp_layernorm.bias", (H + "ln_2.bias",)),
    Weight("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
    Weight("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
    Weight("output_layer.weight", ("lm_head.weight",), "vocab", when=untied, import_fallback="transformer.wte.weight"),
)

HF_KEYS = (
    HFKey("n_layer", "num_layers"),
    HFKey("n_embd", "hidden_size"),
    HFKey("n_head", "num_attention_heads"),
    HFKey("n_inner", "ffn_hidden_size", default=None),  # None: 4 x n_embd (resolve's default too)
    HFKey("n_positions", "seq_length"),
    HFKey("n_ctx", "seq_length", export_only=True),
    HFKey("layer_norm_epsilon", "layernorm_epsilon", default=1e-5),
    HFKey("initializer_range", "init_method_std", default=0.02),
    HFKey("tie_word_embeddings", "tie_embeddings", default=True, to_hf=bool),
)


def _refuses(arch: Arch) -> str | None:
    if arch["num_query_groups"] != arch["num_attention_heads"]:
        return (
            f"GPT-2 style with {arch['num_query_groups']} query groups for {arch['num_attention_heads']} heads: "
            "GPT2LMHeadModel has no grouped-query attention"
        )
    return None


def _export_extra(arch: Arch) -> dict[str, Any]:
    return {
        "activation_function": "gelu",  # exact erf GeLU, as megatron-core's F.gelu (not GPT-2's gelu_new)
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    act = config.get("activation_function", "gelu_new")
    if act != "gelu":
        raise FamilyError(
            f"{where}: activation_function {act!r}: snakellm's GPT-2 style computes the exact GeLU ('gelu') only"
        )
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise FamilyError(f"{where}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    return {}


FAMILY = Family(
    name="gpt2",
    summary="learned positions, LayerNorm, GeLU, biases, tied embeddings",
    defaults=dict(
        position_embedding="learned",
        normalization="LayerNorm",
        activation="gelu",
        tie_embeddings=True,
        bias=True,
        rotary_base=10000,
        layernorm_epsilon=1e-5,
    ),
    presets={
        # the CPU default: trains in minutes on 2 cores
        "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128),
        "gpt2-124m": dict(
            num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, seq_length=1024
        ),
        "gpt2-350m": dict(
            num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=1024
        ),
        "gpt2-774m": dict(
            num_layers=36, hidden_size=1280, num_attention_heads=20, ffn_hidden_size=5120, seq_length=1024
        ),
    },
    features=dict(position_embedding="learned", normalization="LayerNorm", activation="gelu"),
    hf_model_type="gpt2",
    hf_architecture="GPT2LMHeadModel",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    hf_refuses=_refuses,
    hf_export_extra=_export_extra,
    hf_import_extra=_import_extra,
)
