"""RoPE inverse frequencies: plain, and Llama 3.x's ``rope_scaling`` (``rope_type: llama3``).

One function computes the frequencies that training (megatron-core's ``RotaryEmbedding``),
generation (:class:`snakellm.serve.generate.Decoder`) and the exported model use, op for op as
transformers' ``_compute_default_rope_parameters`` / ``_compute_llama3_parameters`` do, so the
three agree bit for bit (tests/test_rope.py compares with transformers itself).

Why not megatron-core's own ``rope_scaling=True``: in megatron-core 0.16.1 it takes only the
factor; low/high frequency factors and the original context length are fixed at Llama 3.1's
(1, 4, 8192). A checkpoint with other values would train with other frequencies than its
config says, so the model's ``inv_freq`` is replaced after construction instead
(:func:`install`), for every value the config may hold.
"""

from __future__ import annotations

import math
from typing import Any

# the architecture keys of Llama 3.x's scaling (None: plain RoPE); HF's names beside them
LLAMA3_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_positions": "original_max_position_embeddings",
}


def scaled(arch: dict[str, Any]) -> bool:
    """Whether the architecture uses Llama 3.x frequency scaling."""
    return arch.get("rope_scaling_factor") is not None


def check_llama3(arch: dict[str, Any]) -> None:
    """All four scaling keys together, with values the formula can use (else a message naming the key)."""
    if not scaled(arch):
        extra = [k for k in LLAMA3_KEYS if arch.get(k) is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} set without rope_scaling_factor (Llama 3.x scaling needs all four)")
        return
    missing = [k for k in LLAMA3_KEYS if arch.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling_factor needs {', '.join(missing)} too (Llama 3.x scaling)")
    if arch["rope_high_freq_factor"] <= arch["rope_low_freq_factor"]:
        raise ValueError(
            f"rope_high_freq_factor {arch['rope_high_freq_factor']} must be larger than rope_low_freq_factor "
            f"{arch['rope_low_freq_factor']} (the smoothing divides by their difference)"
        )
    for k in LLAMA3_KEYS:
        if not arch[k] > 0:
            raise ValueError(f"{k} must be > 0, got {arch[k]!r}")


def inv_freq(arch: dict[str, Any], device: Any = None):
    """fp32 inverse frequencies [head_dim / 2] for the architecture (transformers' computation)."""
    import torch

    dim = arch["hidden_size"] // arch["num_attention_heads"]
    base = arch["rotary_base"]
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()  # device given: also under meta
    freqs = 1.0 / (base ** (steps / dim))
    if not scaled(arch):
        return freqs
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


def install(model: Any, arch: dict[str, Any]) -> None:
    """Give a megatron-core GPTModel the architecture's frequencies (before its first forward).

    ``RotaryEmbedding.inv_freq`` is a plain attribute (not a buffer: never in a checkpoint) and its
    ``forward`` caches embeddings per length, so this must run before any forward pass.
    """
    rot = getattr(model, "rotary_pos_emb", None)
    if rot is None:
        return
    rot.inv_freq = inv_freq(arch, device=rot.inv_freq.device)
