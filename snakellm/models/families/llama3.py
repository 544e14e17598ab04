"""Llama 3.x: Llama's layout with ``rope_scaling`` of type ``llama3``; tied (3.2 1B/3B) or untied embeddings.

Hugging Face class: ``LlamaForCausalLM`` (``model_type`` ``llama``, shared with Llama 2: this family
claims the configs whose rope type is ``llama3``). The four scaling values (factor, low and high
frequency factors, original max positions) are architecture keys; the RoPE inverse frequencies are
computed op for op as transformers' ``_compute_llama3_parameters`` does (bit for bit, tests/test_rope.py)
and used by training (the build installs them in megatron-core's ``RotaryEmbedding``: its own
``rope_scaling`` takes the factor only, fixing the other three at Llama 3.1's), by the KV-cached decoder
and by export. NeMo 1.x applies the same formula from ``scale_positional_embedding`` and its four keys
(``mcore_model_customize``). Any other rope type or rope parameter is refused with its key and value.
"""

from __future__ import annotations

import math
from typing import Any

from snakellm.models.families import llama
from snakellm.models.families.base import Arch, Family, FamilyError

# our architecture key -> transformers' rope parameter -> NeMo 1.x's key
SCALING = {
    "rope_scaling_factor": ("factor", "scale_factor"),
    "rope_low_freq_factor": ("low_freq_factor", "low_freq_factor"),
    "rope_high_freq_factor": ("high_freq_factor", "high_freq_factor"),
    "rope_original_max_positions": ("original_max_position_embeddings", "old_context_len"),
}


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` (transformers 4) and ``rope_parameters`` (5) merged; ``rope_type`` from either name."""
    params = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    params["rope_type"] = params.pop("rope_type", params.pop("type", "default"))
    return params


def _claims(config: dict[str, Any]) -> bool:
    return rope_parameters(config)["rope_type"] == "llama3"


def _check_scaling(arch: Arch) -> str | None:
    if not arch["rope_high_freq_factor"] > arch["rope_low_freq_factor"]:
        return (
            f"rope_high_freq_factor {arch['rope_high_freq_factor']} must exceed rope_low_freq_factor "
            f"{arch['rope_low_freq_factor']} (the smoothing divides by their difference)"
        )
    bad = [k for k in SCALING if not arch[k] > 0]
    return f"{bad[0]} must be > 0, got {arch[bad[0]]!r}" if bad else None


def _import_extra(config: dict[str, Any], where: str) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise FamilyError(f"{where}: hidden_act {config['hidden_act']!r}: only silu (SwiGLU) is supported")
    h, n = config.get("hidden_size"), config.get("num_attention_heads")
    if h and n and config.get("head_dim") not in (None, h // n):
        raise FamilyError(f"{where}: head_dim {config['head_dim']} != hidden_size / heads ({h // n})")
    if bool(config.get("attention_bias", False)) != bool(config.get("mlp_bias", False)):
        raise FamilyError(f"{where}: attention_bias and mlp_bias differ; megatron-core biases all linears or none")
    params = rope_parameters(config)
    params.pop("rope_type")
    theta = params.pop("rope_theta", None)
    if float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise FamilyError(f"{where}: partial_rotary_factor {config.get('partial_rotary_factor')}: full rotary only")
    hf_names = {hf: ours for ours, (hf, _) in SCALING.items()}
    unknown = sorted(set(params) - set(hf_names))
    if unknown:
        raise FamilyError(f"{where}: rope parameter {unknown[0]}={params[unknown[0]]!r} is not supported (llama3)")
    missing = sorted(set(hf_names) - set(params))
    if missing:
        raise FamilyError(f"{where}: rope_type llama3 needs {missing[0]}")
    out: dict[str, Any] = {hf_names[k]: v for k, v in params.items()}
    if theta is not None and config.get("rope_theta") is None:
        out["rotary_base"] = int(theta) if float(theta).is_integer() else theta
    return out


def _export_extra(arch: Arch) -> dict[str, Any]:
    scaling = {"rope_type": "llama3", **{hf: arch[k] for k, (hf, _) in SCALING.items()}}
    return {**llama.FAMILY.hf_export_extra(arch), "rope_scaling": scaling}


def inv_freq(arch: Arch, dim: int, device: Any = None) -> Any:
    """fp32 inverse frequencies [dim / 2]: transformers' ``_compute_llama3_parameters``, op for op."""
    import torch

    # the arange is made on `device` (not moved there), so this also runs under a meta-device build
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
    freqs = 1.0 / (arch["rotary_base"] ** (steps / dim))
    factor = arch["rope_scaling_factor"]
    low, high = arch["rope_low_freq_factor"], arch["rope_high_freq_factor"]
    old_context_len = arch["rope_original_max_positions"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / freqs
    out = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, out)


def _megatron_config(arch: Arch) -> dict[str, Any]:
    why = _check_scaling(arch)
    if why:
        raise FamilyError(why)
    return {}


def _nemo_import_extra(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    return {ours: cfg.get(nemo, llama3_1[ours]) for ours, (_, nemo) in SCALING.items()}


# Llama 3.1's values: NeMo's defaults for absent keys, and this family's defaults
llama3_1 = {
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_positions": 8192,
}

FAMILY = Family(
    name="llama3",
    summary="Llama 3.x: Llama with llama3 RoPE scaling (factor, low/high frequency factors, original positions)",
    defaults={**llama.FAMILY.defaults, "rotary_base": 500000},
    presets={
        # Llama 3.2 1B's shape: 16 layers, d=2048, 32 heads in 8 KV groups, SwiGLU 8192, tied embeddings,
        # RoPE base 500000 with its scaling (factor 32, low/high 1/4, original 8192); trains at 2048 tokens
        "llama3-1b": dict(
            num_layers=16,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=8192,
            seq_length=2048,
            tie_embeddings=True,
            rope_scaling_factor=32.0,
        ),
        # Llama 3.1 8B's shape: 32 layers, d=4096, 32 heads in 8 KV groups, SwiGLU 14336, vocabulary 128,256,
        # untied embeddings, RoPE base 500000 with Llama 3.1's scaling (factor 8); NeMo's pretraining runs 8192
        "llama3-8b": dict(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            seq_length=8192,
            tie_embeddings=False,
        ),
    },
    features=llama.FAMILY.features,
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    hf_keys=llama.HF_KEYS,
    weights=llama.WEIGHTS,
    arch_keys=llama3_1,
    hf_refuses=_check_scaling,
    hf_export_extra=_export_extra,
    hf_import_extra=_import_extra,
    hf_claims=_claims,
    megatron_config=_megatron_config,
    rope_inv_freq=inv_freq,
    nemo_extra=lambda arch: {"scale_positional_embedding": True, **{n: arch[k] for k, (_, n) in SCALING.items()}},
    nemo_import_extra=_nemo_import_extra,
    nemo_claims=lambda cfg: bool(cfg.get("scale_positional_embedding")),
)
