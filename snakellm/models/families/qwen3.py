"""Qwen3 (dense): Llama's layout with an RMSNorm on each query and key head (QK-norm) and a head size of its own.

Hugging Face class: ``Qwen3ForCausalLM``. Its attention normalises every query and key head over the
head dimension (``q_norm``, ``k_norm``: RMSNorm with the model's epsilon) before RoPE, which is
megatron-core's ``qk_layernorm`` (``TransformerConfig.qk_layernorm`` and the layer spec's
``q_layernorm`` / ``k_layernorm``, applied to ``[s, b, heads, head_dim]`` before the rotary
embedding: the same computation). ``head_dim`` is independent of the width (Qwen3 0.6B: d=1024,
16 heads of 128, so the attention is 2048 wide): the architecture key ``kv_channels``, megatron-core's
name. No biases (``attention_bias`` true would put one on ``o_proj`` as well, which megatron-core's
``add_qkv_bias`` does not), SwiGLU, RoPE base 1e6, tied or untied embeddings. Qwen3's per-layer
sliding windows (``use_sliding_window: true``) and rope scaling are refused with the key.

NeMo 1.x: refused. Its ``MegatronGPTModel`` picks the mcore layer spec from the spec name, the
experts and grouped GEMM only, never passing ``qk_layernorm``, so a ``.nemo`` of this model would
load without its q/k norms (other logits); the export says so rather than writing it.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families import llama
from snakellm.models.families.base import Arch, Family, FamilyError, HFKey, Weight

L, P = llama.L, llama.P

WEIGHTS = (
    *(
        w
        for w in llama.WEIGHTS
        if not w.ours.endswith(".bias") and "output_layer" not in w.ours and "final" not in w.ours
    ),
    Weight(L + "self_attention.q_layernorm.weight", (P + "self_attn.q_norm.weight",)),
    Weight(L + "self_attention.k_layernorm.weight", (P + "self_attn.k_norm.weight",)),
    *(w for w in llama.WEIGHTS if "output_layer" in w.ours or "final" in w.ours),
)

# Llama's table without the bias rows, with the head size (Qwen3Config's default head_dim is 128)
HF_KEYS = (
    *(k for k in llama.HF_KEYS if k.hf not in ("attention_bias", "mlp_bias")),
    HFKey("head_dim", "kv_channels", default=128),
)


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise FamilyError(f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported")
    if config.get("use_sliding_window"):
        raise FamilyError(f"{where}: use_sliding_window true is not supported (per-layer windows)")
    if config.get("attention_bias"):
        raise FamilyError(
            f"{where}: attention_bias true is not supported (a bias on o_proj too; megatron-core biases q, k, v only)"
        )
    from snakellm.models.families import llama3

    rope = llama3.rope_parameters(config)
    if rope["rope_type"] != "default" or set(rope) - {"rope_type", "rope_theta"}:
        raise FamilyError(f"{where}: rope parameters {rope} are not supported (plain RoPE only)")
    out: dict[str, Any] = {"qk_norm": True, "bias": False}
    if "rope_theta" in rope and config.get("rope_theta") is None:
        out["rotary_base"] = llama._theta(rope["rope_theta"])
    return out


def _refuses(arch: Arch) -> str | None:
    if arch["bias"]:
        return "bias: true: Qwen3ForCausalLM has no biases (attention_bias would put one on o_proj as well)"
    if not arch["qk_norm"]:
        return "qk_norm: false: Qwen3ForCausalLM always normalises the query and key heads"
    return None


def _check(arch: Arch) -> None:
    d = arch["kv_channels"]
    if arch["position_embedding"] == "rope" and d % 2:
        raise FamilyError(f"kv_channels {d} is odd: RoPE rotates pairs of a head's channels")


def _megatron_config(arch: Arch) -> dict[str, Any]:
    _check(arch)
    return {"qk_layernorm": bool(arch["qk_norm"]), "kv_channels": int(arch["kv_channels"])}


FAMILY = Family(
    name="qwen3",
    summary="Qwen3: Llama's layout with QK-norm and its own head size (kv_channels)",
    defaults={**llama.FAMILY.defaults, "layernorm_epsilon": 1e-6, "rotary_base": 1000000},
    presets={
        "tiny-qwen3": dict(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=32,
            ffn_hidden_size=176,
            seq_length=128,
            tie_embeddings=True,
        ),
        # Qwen3 0.6B's shape: 28 layers, d=1024, 16 heads of 128 in 8 KV groups, SwiGLU 3072, QK-norm,
        # tied embeddings, RoPE base 1e6, RMSNorm eps 1e-6; trains at 4096 tokens (40,960 positions in HF)
        "qwen3-0.6b": dict(
            num_layers=28,
            hidden_size=1024,
            num_attention_heads=16,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=3072,
            seq_length=4096,
            tie_embeddings=True,
        ),
        # Qwen3 8B's shape: 36 layers, d=4096, 32 heads of 128 in 8 KV groups, SwiGLU 12288, QK-norm, untied
        "qwen3-8b": dict(
            num_layers=36,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=12288,
            seq_length=4096,
            tie_embeddings=False,
        ),
    },
    features=llama.FAMILY.features,
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    # kv_channels None: hidden_size / num_attention_heads (resolve fills it in)
    arch_keys={"kv_channels": None, "qk_norm": True},
    hf_refuses=_refuses,
    hf_export_extra=lambda arch: {
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch["num_layers"],
    },
    hf_import_extra=_import_extra,
    megatron_config=_megatron_config,
    nemo_refuses=lambda arch: (
        "QK-norm (Qwen3's q_norm/k_norm): NeMo 1.x's MegatronGPTModel builds its mcore layer spec without "
        "qk_layernorm, so it would load the model without them"
        if arch["qk_norm"]
        else None
    ),
)
