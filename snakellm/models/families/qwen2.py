"""Qwen2 / Qwen2.5: Llama's layout with biases on the q, k, v projections only; tied or untied embeddings.

Hugging Face class: ``Qwen2ForCausalLM`` (its q/k/v projections always carry biases, ``o_proj`` and
the MLP never). megatron-core computes this with ``add_qkv_bias`` and no other bias: the architecture
key ``qkv_bias`` (set by the import and the preset). The RoPE base (1e6 for Qwen2.5) is the usual
``rotary_base``. Qwen2's per-layer sliding windows (``use_sliding_window: true``) are refused.
NeMo 1.x has the same switch (``qkv_bias`` with ``bias: false``).
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families import llama
from snakellm.models.families.base import Arch, Family, FamilyError, Weight

L, P = llama.L, llama.P

WEIGHTS = (
    *(w for w in llama.WEIGHTS if not w.ours.endswith(".bias")),
    Weight(
        L + "self_attention.linear_qkv.bias",
        (P + "self_attn.q_proj.bias", P + "self_attn.k_proj.bias", P + "self_attn.v_proj.bias"),
        rows="qkv",
        when=lambda a: bool(a["qkv_bias"]),
    ),
)

# Llama's table without the bias rows (Qwen2Config has no attention_bias / mlp_bias)
HF_KEYS = tuple(k for k in llama.HF_KEYS if k.hf not in ("attention_bias", "mlp_bias"))


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise FamilyError(f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported")
    if config.get("use_sliding_window"):
        raise FamilyError(f"{where}: use_sliding_window true is not supported (per-layer windows)")
    h, n = config.get("hidden_size"), config.get("num_attention_heads")
    if h and n and config.get("head_dim") not in (None, h // n):
        raise FamilyError(f"{where}: head_dim {config['head_dim']} != hidden_size / heads ({h // n})")
    from snakellm.models.families import llama3

    rope = llama3.rope_parameters(config)
    if rope["rope_type"] != "default" or set(rope) - {"rope_type", "rope_theta"}:
        raise FamilyError(f"{where}: rope parameters {rope} are not supported (plain RoPE only)")
    out: dict[str, Any] = {"qkv_bias": True, "bias": False}
    if "rope_theta" in rope and config.get("rope_theta") is None:
        out["rotary_base"] = llama._theta(rope["rope_theta"])
    return out


def _refuses(arch: Arch) -> str | None:
    if arch["bias"]:
        return "bias: true: Qwen2ForCausalLM has no o_proj or MLP biases (q, k, v only: qkv_bias)"
    if not arch["qkv_bias"]:
        return "qkv_bias: false: Qwen2ForCausalLM always has q, k, v biases"
    return None


FAMILY = Family(
    name="qwen2",
    summary="Qwen2/2.5: Llama's layout with q/k/v-only biases",
    defaults={**llama.FAMILY.defaults, "layernorm_epsilon": 1e-6, "rotary_base": 1000000},
    presets={
        # Qwen2.5 0.5B's shape: 24 layers, d=896, 14 heads in 2 KV groups, SwiGLU 4864, q/k/v biases,
        # tied embeddings, RoPE base 1e6, RMSNorm eps 1e-6; trains at 2048 tokens
        "qwen2.5-0.5b": dict(
            num_layers=24,
            hidden_size=896,
            num_attention_heads=14,
            num_query_groups=2,
            ffn_hidden_size=4864,
            seq_length=2048,
            tie_embeddings=True,
        ),
    },
    features=llama.FAMILY.features,
    hf_model_type="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    hf_keys=HF_KEYS,
    weights=WEIGHTS,
    arch_keys={"qkv_bias": True},
    hf_refuses=_refuses,
    hf_export_extra=lambda arch: {
        "head_dim": arch["hidden_size"] // arch["num_attention_heads"],
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch["num_layers"],
    },
    hf_import_extra=_import_extra,
    megatron_config=lambda arch: {"add_qkv_bias": bool(arch["qkv_bias"] or arch["bias"])},
    nemo_extra=lambda arch: {"qkv_bias": bool(arch["qkv_bias"] or arch["bias"])},
    nemo_import_extra=lambda cfg, where: {"qkv_bias": bool(cfg.get("qkv_bias"))},
    nemo_claims=lambda cfg: bool(cfg.get("qkv_bias")) and not cfg.get("bias", True),
)
