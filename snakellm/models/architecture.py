"""Model architecture settings: one dataclass, presets + family defaults, checks (torch-free).

Every architecture is a megatron-core ``GPTModel``; a model family
(``snakellm/models/families/<style>.py``) fixes the keys a config leaves out and names its
presets. Today: ``gpt2`` (learned absolute positions, LayerNorm, GeLU MLP, biases, tied
input/output embeddings: GPT-2 / Megatron-LM's GPT) and ``llama`` (RoPE, RMSNorm, SwiGLU MLP,
grouped-query attention, no biases, untied embeddings).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from snakellm.errors import ConfigError
from snakellm.models import families

STYLES: tuple[str, ...] = tuple(families.FAMILIES)
# Each preset names every architectural key it fixes; config overrides replace single keys.
PRESETS: dict[str, dict[str, Any]] = families.presets()


def _key(help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=None, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelSettings:
    """Every architectural key; ``None`` means "the preset's, else the style's default"."""

    style: str | None = _key("; ".join(f"{f.name}: {f.summary}" for f in families.FAMILIES.values()), STYLES)
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
    rotary_base: int | None = _key("RoPE base (theta)")
    layernorm_epsilon: float | None = _key("epsilon of the norms")
    init_method_std: float | None = _key("std of the normal weight init")
    hidden_dropout: float | None = _key("dropout after attention and MLP")
    attention_dropout: float | None = _key("dropout on attention probabilities")
    make_vocab_size_divisible_by: int | None = _key("vocabulary padding (Megatron-LM's; x TP)")
    # mixture of experts (megatron-core's MoE layer in every layer); unset: a dense MLP
    num_experts: int | None = _key("routed experts per layer (mixture of experts); unset: a dense MLP")
    moe_ffn_hidden_size: int | None = _key("MoE: each expert's MLP width; default ffn_hidden_size")
    moe_router_topk: int | None = _key("MoE: experts each token is routed to")
    moe_score_function: str | None = _key(
        "MoE: router scores (sigmoid: top-k always normalised)", ("softmax", "sigmoid")
    )
    moe_norm_topk_prob: bool | None = _key("MoE: the top-k scores renormalised to sum to 1 (softmax over the top k)")
    moe_aux_loss_coeff: float | None = _key("MoE: load-balancing auxiliary loss coefficient (0: none)")
    moe_z_loss_coeff: float | None = _key("MoE: router z-loss coefficient (0: none)")


MODEL_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelSettings))
# kept in a resolved architecture only when num_experts is set: a dense model's dict (and fingerprint) has none
MOE_KEYS: tuple[str, ...] = tuple(k for k in MODEL_KEYS if k == "num_experts" or k.startswith("moe_"))
MOE_DEFAULTS: dict[str, Any] = dict(
    moe_ffn_hidden_size=None,
    moe_router_topk=2,
    moe_score_function="softmax",
    moe_norm_topk_prob=True,
    moe_aux_loss_coeff=0.0,
    moe_z_loss_coeff=0.0,
)

_COMMON_DEFAULTS: dict[str, Any] = dict(
    num_query_groups=None,  # None: one KV head per query head (plain multi-head attention)
    init_method_std=0.02,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    make_vocab_size_divisible_by=128,
)


class ModelConfigError(ConfigError):
    """An impossible model or parallelism configuration, phrased with the numbers."""


def resolve(preset: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Preset + style defaults + overrides -> a complete, checked architecture dict."""
    overrides = dict(overrides or {})
    if preset is not None and preset not in PRESETS:
        raise ModelConfigError(f"unknown model preset {preset!r} (presets: {', '.join(PRESETS)})")
    base = copy.deepcopy(PRESETS[preset]) if preset else {}
    style = overrides.get("style", base.get("style", STYLES[0]))
    if style not in STYLES:
        raise ModelConfigError(f"unknown model style {style!r} (styles: {', '.join(STYLES)})")
    family = families.get(style)
    allowed = (*MODEL_KEYS, *family.arch_keys)
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ModelConfigError(f"unknown model key(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")
    cfg = {**_COMMON_DEFAULTS, **family.arch_keys, **family.defaults, **base, **overrides, "style": style}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if cfg.get(k) is None]
    if missing:
        raise ModelConfigError(f"model needs {', '.join(missing)} (or a preset: {', '.join(PRESETS)})")
    if cfg.get("ffn_hidden_size") is None:
        cfg["ffn_hidden_size"] = 4 * cfg["hidden_size"]
    if cfg["num_query_groups"] is None:
        cfg["num_query_groups"] = cfg["num_attention_heads"]
    h, n, g = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_query_groups"]
    own_heads = "kv_channels" in cfg and cfg["kv_channels"] is not None  # a head size of its own (Qwen3)
    if h % n and not own_heads:
        raise ModelConfigError(f"hidden_size {h} is not divisible by num_attention_heads {n}")
    if "kv_channels" in cfg:
        if cfg["kv_channels"] is None:
            cfg["kv_channels"] = h // n
        if not isinstance(cfg["kv_channels"], int) or cfg["kv_channels"] < 1:
            raise ModelConfigError(f"model kv_channels must be a positive integer, got {cfg['kv_channels']!r}")
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
    if not cfg.get("num_experts"):
        given = [k for k in MOE_KEYS if overrides.get(k) is not None and k != "num_experts"]
        if given:
            raise ModelConfigError(f"model {', '.join(given)}: mixture-of-experts keys need num_experts")
        return {k: cfg[k] for k in allowed if k not in MOE_KEYS}
    _check_moe(cfg)
    return {k: cfg[k] for k in allowed}


def _check_moe(cfg: dict[str, Any]) -> None:
    """Fill the MoE defaults in ``cfg`` and check them against megatron-core's router (torch-free)."""
    for k, v in MOE_DEFAULTS.items():
        if cfg.get(k) is None:
            cfg[k] = v
    if cfg["moe_ffn_hidden_size"] is None:
        cfg["moe_ffn_hidden_size"] = cfg["ffn_hidden_size"]
    e, k = cfg["num_experts"], cfg["moe_router_topk"]
    for key in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ModelConfigError(f"model {key} must be a positive integer, got {cfg[key]!r}")
    if k > e:
        raise ModelConfigError(f"model moe_router_topk {k} is more than num_experts {e}")
    if cfg["moe_score_function"] not in ("softmax", "sigmoid"):
        raise ModelConfigError(f"moe_score_function must be softmax or sigmoid, got {cfg['moe_score_function']!r}")
    if cfg["moe_score_function"] == "sigmoid" and k > 1 and not cfg["moe_norm_topk_prob"]:
        raise ModelConfigError(
            "moe_norm_topk_prob false with moe_score_function sigmoid: megatron-core's sigmoid router always "
            "renormalises the top-k scores"
        )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] < 0:
            raise ModelConfigError(f"model {key} must be a number >= 0, got {cfg[key]!r}")


def padded_vocab_size(vocab_size: int, cfg: dict[str, Any], tp: int = 1) -> int:
    """Megatron-LM's padding: a multiple of make_vocab_size_divisible_by x TP."""
    m = cfg["make_vocab_size_divisible_by"] * tp
    return int(math.ceil(vocab_size / m) * m)


def check_parallel(cfg: dict[str, Any], tp: int, pp: int, virtual_pp: int = 1) -> None:
    """The model must split evenly over tensor and pipeline ranks (and virtual pipeline stages)."""
    if tp < 1:
        raise ModelConfigError(f"tensor parallel size must be >= 1, got {tp}")
    check_pipeline(cfg, pp, virtual_pp)
    keys = ("num_attention_heads", "num_query_groups", "ffn_hidden_size")
    # a mixture of experts splits each expert over the tp ranks too (megatron-core's expert tensor parallelism)
    for key in (*keys, "moe_ffn_hidden_size") if cfg.get("num_experts") else keys:
        if cfg[key] % tp:
            raise ModelConfigError(f"model {key} {cfg[key]} is not divisible by tensor parallel size {tp}")


def check_pipeline(cfg: dict[str, Any], pp: int, virtual_pp: int = 1) -> None:
    """The layers split evenly over ``pp x virtual_pp`` pipeline chunks."""
    if pp < 1 or virtual_pp < 1:
        raise ModelConfigError(f"pp ({pp}) and virtual_pp ({virtual_pp}) must be >= 1")
    if virtual_pp > 1 and pp == 1:
        raise ModelConfigError(f"virtual_pp {virtual_pp}: virtual pipeline stages need pp > 1 (got pp 1)")
    if cfg["num_layers"] % (pp * virtual_pp):
        raise ModelConfigError(
            f"num_layers {cfg['num_layers']} is not divisible by pp {pp} x virtual_pp {virtual_pp} "
            f"(= {pp * virtual_pp} pipeline chunks of equal size)"
        )


def check_recompute(
    cfg: dict[str, Any], pp: int, virtual_pp: int, recompute: str, method: str, num_layers: int
) -> None:
    """megatron-core's rule for full recomputation: 1 <= recompute_num_layers <= the layers of one chunk."""
    per_chunk = cfg["num_layers"] // (pp * virtual_pp)
    if recompute == "full" and not 1 <= num_layers <= per_chunk:
        raise ModelConfigError(
            f"recompute_num_layers {num_layers} (recompute full, {method}) must be between 1 and the layers of one "
            f"pipeline stage or chunk ({cfg['num_layers']} / (pp {pp} x virtual_pp {virtual_pp}) = {per_chunk})"
        )


def check_pipeline_batches(pp: int, virtual_pp: int, num_micro: int) -> str | None:
    """Why the interleaved schedule cannot run ``num_micro`` micro batches per step and rank (None: it can).

    megatron-core's interleaved 1F1B schedule runs the micro batches in groups of pp per chunk.
    """
    if virtual_pp > 1 and num_micro % pp:
        return (
            f"virtual_pp {virtual_pp} (interleaved schedule) needs the micro batches per step and data-parallel rank "
            f"({num_micro} = global_batch_size / (micro_batch_size x data-parallel size)) to be a multiple of pp {pp}"
        )
    return None


def grad_reduce_conflict(grad_reduce_dtype: str, precision: str) -> str | None:
    """Why ``parallel.grad_reduce_dtype`` cannot run with this precision (None: it can; ``auto`` is checked
    again once the job knows its device)."""
    if grad_reduce_dtype == "bf16" and precision == "fp32":
        return "reduces the gradients of bf16 weights in bf16: it needs precision bf16 or fp8 (got fp32)"
    return None


def parallel_conflict(par: dict[str, Any], name: Callable[[str], str] = str) -> tuple[str, str] | None:
    """The first parallelism settings of ``par`` that cannot go together: (the setting at fault, why), the
    other settings in the reason named by ``name`` (a config key, or the step's flag); None: none.
    A fine-tune's ``par`` carries its ``method`` too."""
    tp, pp, vpp = par.get("tp", 1), par.get("pp", 1), par.get("virtual_pp", 1)
    distopt = par.get("distributed_optimizer")
    if par.get("sequence_parallel") and tp == 1:
        return (
            "sequence_parallel",
            f"splits the sequence over the tensor-parallel ranks: it needs {name('tp')} > 1 (got 1)",
        )
    if par.get("overlap_param_gather") and not distopt:
        return (
            "overlap_param_gather",
            f"overlaps the distributed optimizer's all-gather of the updated weights: it needs {name('distributed_optimizer')}",
        )
    if par.get("fsdp") and distopt:
        return (
            "fsdp",
            "already shards the optimizer states (and the parameters and gradients): "
            f"drop {name('distributed_optimizer')}",
        )
    method = par.get("method", "full")  # a fine-tune's (pretraining trains every weight)
    if par.get("fsdp") and method != "full":
        return (
            "fsdp",
            f"shards every weight of a full fine-tune: it needs {name('method')} full (got {method}, which trains "
            f"a small module over a frozen base: one GPU holds it at 8B; drop {name('fsdp')})",
        )
    if par.get("fp8_all_gather") and not par.get("fsdp"):
        return (
            "fp8_all_gather",
            f"casts each FSDP shard to float8 before FSDP's all-gather: it needs {name('fsdp')}",
        )
    ep = par.get("ep", 1)
    if ep > 1 and par.get("fsdp"):
        return (
            "ep",
            f"expert parallelism is not composed with {name('fsdp')} yet (the experts' gradients and Adam states "
            f"live on their expert-parallel ranks): use {name('ep')} 1, or {name('distributed_optimizer')} "
            f"instead of {name('fsdp')}",
        )
    if par.get("fsdp") and pp > 1:
        return "fsdp", f"shards over the data-parallel ranks of one pipeline stage: it needs {name('pp')} 1 (got {pp})"
    if distopt and vpp > 1:
        return (
            "distributed_optimizer",
            f"shards one model chunk's gradient buffers: it needs {name('virtual_pp')} 1 (got {vpp})",
        )
    return None


def describe(cfg: dict[str, Any], vocab: int) -> str:
    """One line for logs: style, size and shape."""
    from snakellm.models.counts import param_count

    n = param_count(cfg, vocab)
    experts = ""
    if cfg.get("num_experts"):  # MFU counts the active parameters (flops_per_token)
        active = param_count(cfg, vocab, active=True)
        experts = (
            f" ({active / 1e6:.1f}M active: {cfg['moe_router_topk']} of {cfg['num_experts']} experts of "
            f"ffn {cfg['moe_ffn_hidden_size']} per token)"
        )
    return (
        f"{cfg['style']} {n / 1e6:.1f}M params{experts}: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads ({cfg['num_query_groups']} KV groups), ffn {cfg['ffn_hidden_size']}, "
        f"seq {cfg['seq_length']}, vocab {vocab}"
    )
