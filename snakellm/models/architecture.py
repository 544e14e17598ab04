"""Model architecture settings: one dataclass, presets + style defaults, checks (torch-free).

Two architectures, both megatron-core ``GPTModel``:

* ``gpt2``: learned absolute positions, LayerNorm, GeLU MLP, biases, tied
  input/output embeddings (GPT-2 / Megatron-LM's GPT).
* ``llama``: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases,
  untied embeddings.

:class:`ModelSettings` is the one source of the architecture keys: the config
schema (``runs.*.model``), the ``snakellm train`` flags, the pretrain rule's
flags and the fingerprint stored with checkpoints all derive from its fields.
Nothing here imports torch, so a config mistake is reported in milliseconds,
before ``import megatron.core`` (~3.5 s) and long before a GPU is touched.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from snakellm.models.presets import PRESETS

STYLES = ("gpt2", "llama")


def _key(help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=None, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelSettings:
    """Every architectural key; ``None`` means "the preset's, else the style's default"."""

    style: str | None = _key(
        "gpt2: learned positions, LayerNorm, GeLU, biases, tied embeddings; "
        "llama: RoPE, RMSNorm, SwiGLU, GQA, no biases, untied",
        STYLES,
    )
    num_layers: int | None = _key("transformer layers")
    hidden_size: int | None = _key("model width")
    num_attention_heads: int | None = _key("query heads")
    num_query_groups: int | None = _key("KV heads (grouped-query attention); default: num_attention_heads")
    ffn_hidden_size: int | None = _key("MLP width; default 4 x hidden_size")
    seq_length: int | None = _key("tokens per training sequence")
    position_embedding: str | None = _key("learned absolute positions or rotary", ("learned", "rope"))
    normalization: str | None = _key("LayerNorm or RMSNorm", ("LayerNorm", "RMSNorm"))
    activation: str | None = _key("MLP activation (swiglu: gated)", ("gelu", "swiglu"))
    tie_embeddings: bool | None = _key("share input and output embeddings")
    bias: bool | None = _key("biases in the linear layers")
    qkv_bias: bool | None = _key("biases on the q, k, v projections (Qwen2: these only); default: bias")
    rotary_base: int | None = _key("RoPE base (theta)")
    rope_scaling_factor: float | None = _key("Llama 3.x RoPE scaling: factor (unset: plain RoPE)")
    rope_low_freq_factor: float | None = _key("Llama 3.x RoPE scaling: low frequency factor")
    rope_high_freq_factor: float | None = _key("Llama 3.x RoPE scaling: high frequency factor")
    rope_original_max_positions: int | None = _key("Llama 3.x RoPE scaling: original max position embeddings")
    sliding_window: int | None = _key(
        "Mistral's attention window (unset: none); exact only when seq_length <= sliding_window"
    )
    layernorm_epsilon: float | None = _key("epsilon of the norms")
    init_method_std: float | None = _key("std of the normal weight init")
    hidden_dropout: float | None = _key("dropout after attention and MLP")
    attention_dropout: float | None = _key("dropout on attention probabilities")
    make_vocab_size_divisible_by: int | None = _key("vocabulary padding (Megatron-LM's; x TP)")


MODEL_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelSettings))

# Defaults per style for the keys a preset does not name.
_STYLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        position_embedding="learned",
        normalization="LayerNorm",
        activation="gelu",
        tie_embeddings=True,
        bias=True,
        rotary_base=10000,
        layernorm_epsilon=1e-5,
    ),
    "llama": dict(
        position_embedding="rope",
        normalization="RMSNorm",
        activation="swiglu",
        tie_embeddings=False,
        bias=False,
        rotary_base=10000,
        layernorm_epsilon=1e-5,
    ),
}

_COMMON_DEFAULTS: dict[str, Any] = dict(
    num_query_groups=None,  # None: one KV head per query head (plain multi-head attention)
    init_method_std=0.02,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    make_vocab_size_divisible_by=128,
    qkv_bias=None,  # None: the same as bias
    rope_scaling_factor=None,
    rope_low_freq_factor=None,
    rope_high_freq_factor=None,
    rope_original_max_positions=None,
    sliding_window=None,
)


class ModelConfigError(ValueError):
    """An impossible model or parallelism configuration, phrased with the numbers."""


def resolve(preset: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Preset + style defaults + overrides -> a complete, checked architecture dict."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(MODEL_KEYS))
    if unknown:
        raise ModelConfigError(f"unknown model key(s) {', '.join(unknown)} (allowed: {', '.join(MODEL_KEYS)})")
    if preset is not None and preset not in PRESETS:
        raise ModelConfigError(f"unknown model preset {preset!r} (presets: {', '.join(PRESETS)})")
    base = copy.deepcopy(PRESETS[preset]) if preset else {}
    style = overrides.get("style", base.get("style", "gpt2"))
    if style not in STYLES:
        raise ModelConfigError(f"unknown model style {style!r} (styles: {', '.join(STYLES)})")
    cfg = {**_COMMON_DEFAULTS, **_STYLE_DEFAULTS[style], **base, **overrides, "style": style}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"model needs {', '.join(missing)} (or a preset: {', '.join(PRESETS)})")
    if cfg.get("ffn_hidden_size") is None:
        cfg["ffn_hidden_size"] = 4 * cfg["hidden_size"]
    if cfg["num_query_groups"] is None:
        cfg["num_query_groups"] = cfg["num_attention_heads"]
    h, n, g = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"]
    if h % n:
        raise ModelConfigError(f"hidden_size {h} is not divisible by num_attention_heads {n}")
    if n % g:
        raise ModelConfigError(f"num_attention_heads {n} is not divisible by num_query_groups {g}")
    for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length"):
        if not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ModelConfigError(f"model {k} must be a positive integer, got {cfg[k]!r}")
    if cfg["position_embedding"] not in ("learned", "rope"):
        raise ModelConfigError(f"position_embedding must be learned or rope, got {cfg['position_embedding']!r}")
    if cfg["normalization"] not in ("LayerNorm", "RMSNorm"):
        raise ModelConfigError(f"normalization must be LayerNorm or RMSNorm, got {cfg['normalization']!r}")
    if cfg["activation"] not in ("gelu", "swiglu"):
        raise ModelConfigError(f"activation must be gelu or swiglu, got {cfg['activation']!r}")
    _check_attention_variants(cfg)
    return {k: cfg[k] for k in MODEL_KEYS}


def _check_attention_variants(cfg: dict[str, Any]) -> None:
    """q/k/v-only biases, Llama 3.x RoPE scaling and a sliding window: only where computed exactly."""
    from snakellm.models import rope

    if cfg["qkv_bias"] is None:
        cfg["qkv_bias"] = cfg["bias"]
    if cfg["bias"] and not cfg["qkv_bias"]:
        raise ModelConfigError("bias: true with qkv_bias: false: megatron-core biases q, k, v whenever it biases all")
    try:
        rope.check_llama3(cfg)
    except ValueError as e:
        raise ModelConfigError(str(e)) from None
    if rope.scaled(cfg) and cfg["position_embedding"] != "rope":
        raise ModelConfigError("rope_scaling_factor needs position_embedding: rope")
    window = cfg["sliding_window"]
    if window is not None and window < cfg["seq_length"]:
        raise ModelConfigError(
            f"sliding_window {window} < seq_length {cfg['seq_length']}: snakellm attends to the whole sequence, "
            "which equals the windowed attention only when seq_length <= sliding_window; use seq_length <= "
            f"{window}"
        )


def padded_vocab_size(vocab_size: int, cfg: dict[str, Any], tp: int = 1) -> int:
    """Megatron-LM's padding: a multiple of make_vocab_size_divisible_by x TP."""
    m = cfg["make_vocab_size_divisible_by"] * tp
    return int(math.ceil(vocab_size / m) * m)


def check_parallel(cfg: dict[str, Any], tp: int, pp: int) -> None:
    """The model must split evenly over tensor and pipeline ranks."""
    if tp < 1 or pp < 1:
        raise ModelConfigError(f"tensor ({tp}) and pipeline ({pp}) parallel sizes must be >= 1")
    if pp != 1:
        raise ModelConfigError(
            f"pipeline parallel size {pp}: pipeline parallelism is not supported by snakellm train yet; use pp: 1 "
            "(tensor and data parallelism are)"
        )
    for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if cfg[key] % tp:
            raise ModelConfigError(f"model {key} {cfg[key]} is not divisible by tensor parallel size {tp}")


def describe(cfg: dict[str, Any], vocab: int) -> str:
    """One line for logs: style, size and shape."""
    from snakellm.models.counts import param_count

    n = param_count(cfg, vocab)
    return (
        f"{cfg['style']} {n / 1e6:.1f}M params: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads ({cfg['num_query_groups']} KV groups), ffn {cfg['ffn_hidden_size']}, "
        f"seq {cfg['seq_length']}, vocab {vocab}"
    )
