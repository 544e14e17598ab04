"""GPT models on megatron-core: named presets, config resolution, and the build.

Two architectures, both megatron-core ``GPTModel``:

* ``gpt2``: learned absolute positions, LayerNorm, GeLU MLP, biases, tied
  input/output embeddings (GPT-2 / Megatron-LM's GPT).
* ``llama``: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases,
  untied embeddings.

Everything up to :func:`build_model` is plain Python (no torch import), so a
config mistake is reported in milliseconds, before ``import megatron.core``
(~3.5 s) and long before a GPU is touched.

Layer spec: Transformer Engine's when ``transformer_engine`` imports and we run
on CUDA (cluster containers); otherwise megatron-core's local spec with its
core attention replaced by :class:`SDPAttention`, which calls
``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN kernels on a
GPU, no [b, h, s, s] score tensor anywhere).
"""

from __future__ import annotations

import copy
import math
from typing import Any

STYLES = ("gpt2", "llama")

# Each preset names every architectural key; config overrides replace single keys.
PRESETS: dict[str, dict[str, Any]] = {
    # the CPU default: trains in minutes on 2 cores
    "tiny": dict(style="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128),
    "tiny-llama": dict(
        style="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=176, seq_length=128,
    ),
    "gpt2-124m": dict(style="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, seq_length=1024),
    "gpt2-350m": dict(style="gpt2", num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=1024),
    "gpt2-774m": dict(style="gpt2", num_layers=36, hidden_size=1280, num_attention_heads=20, ffn_hidden_size=5120, seq_length=1024),
    # TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads in 4 KV groups, SwiGLU 5632
    "llama-1b": dict(
        style="llama", num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
        ffn_hidden_size=5632, seq_length=2048,
    ),
}

# Defaults per style for the keys a preset does not name.
_STYLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        position_embedding="learned", normalization="LayerNorm", activation="gelu", tie_embeddings=True,
        bias=True, rotary_base=10000, layernorm_epsilon=1e-5,
    ),
    "llama": dict(
        position_embedding="rope", normalization="RMSNorm", activation="swiglu", tie_embeddings=False,
        bias=False, rotary_base=10000, layernorm_epsilon=1e-5,
    ),
}

_COMMON_DEFAULTS: dict[str, Any] = dict(
    num_query_groups=None,  # None: one KV head per query head (plain multi-head attention)
    init_method_std=0.02,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    make_vocab_size_divisible_by=128,
)

MODEL_KEYS = (
    "style", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "seq_length", "position_embedding", "normalization", "activation", "tie_embeddings", "bias",
    "rotary_base", "layernorm_epsilon", "init_method_std", "hidden_dropout", "attention_dropout",
    "make_vocab_size_divisible_by",
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
    return {k: cfg[k] for k in MODEL_KEYS}


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


def param_count(cfg: dict[str, Any], vocab: int) -> int:
    """Number of distinct parameters (tied embeddings counted once), from the shapes alone."""
    h, L, f = cfg["hidden_size"], cfg["num_layers"], cfg["ffn_hidden_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_query_groups"]
    b = cfg["bias"]
    norm = 2 * h if cfg["normalization"] == "LayerNorm" else h
    attn = h * (h + 2 * kv) + (h + 2 * kv if b else 0) + h * h + (h if b else 0)
    mlp_in = 2 * f if cfg["activation"] == "swiglu" else f
    mlp = h * mlp_in + (mlp_in if b else 0) + f * h + (h if b else 0)
    layer = attn + mlp + 2 * norm
    emb = vocab * h + (cfg["seq_length"] * h if cfg["position_embedding"] == "learned" else 0)
    head = 0 if cfg["tie_embeddings"] else vocab * h
    return L * layer + emb + norm + head


def flops_per_token(cfg: dict[str, Any], vocab: int) -> float:
    """Training FLOPs per token: 6 N + 12 L h s (the formula llm.c and PaLM's MFU use).

    N is the parameter count with tied embeddings counted once; the second term
    is attention's score and value products at full (non-causal) cost.
    """
    return 6.0 * param_count(cfg, vocab) + 12.0 * cfg["num_layers"] * cfg["hidden_size"] * cfg["seq_length"]


def describe(cfg: dict[str, Any], vocab: int) -> str:
    n = param_count(cfg, vocab)
    return (
        f"{cfg['style']} {n / 1e6:.1f}M params: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads ({cfg['num_query_groups']} KV groups), ffn {cfg['ffn_hidden_size']}, "
        f"seq {cfg['seq_length']}, vocab {vocab}"
    )


# ----------------------------------------------------------------- the build (torch from here on)


ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def _sdpa_attention_class(backend: str = "auto"):
    import contextlib

    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if backend == "auto":
        kernel = contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

        def kernel():
            return sdpa_kernel([chosen])

    class SDPAttention(DotProductAttention):
        """megatron-core's core attention, computed by ``scaled_dot_product_attention``.

        Takes and returns megatron's layouts: q/k/v ``[s, b, heads, d]`` in,
        context ``[s, b, heads * d]`` out. Causal masking is implicit (GPT
        pretraining never passes another mask); grouped-query attention uses
        SDPA's ``enable_gqa`` instead of materialising repeated keys/values.
        """

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_bias is None, "SDPAttention: packed sequences/bias unsupported"
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            p = self.attention_dropout.p if self.training else 0.0
            if p > 0 and not self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                rng = tensor_parallel.get_cuda_rng_tracker().fork()
            else:
                rng = contextlib.nullcontext()
            # a mask is only ever passed for packed fine-tuning sequences (megatron's convention:
            # True = masked out; causal and block-diagonal); pretraining passes None
            mask = None if attention_mask is None else ~attention_mask
            with rng, kernel():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                     scale=self.softmax_scale, enable_gqa=groups > 1)
            s, b = out.size(2), out.size(0)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SDPAttention


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _cross_entropy(logits, labels):
    """Per-token loss [b, s] from logits [s, b, V] (any float dtype) and labels [b, s].

    One fused pass when compiled: the logits are read once in their own dtype
    and upcast in registers, never materialised in fp32 the way megatron-core's
    unfused ``vocab_parallel_cross_entropy`` does (several full fp32 copies of
    a [tokens, vocab] tensor: the biggest single cost at GPT-2 scale).
    """
    import torch.nn.functional as F

    s, b, v = logits.shape
    loss = F.cross_entropy(logits.reshape(s * b, v).float(), labels.t().reshape(s * b), reduction="none")
    return loss.view(s, b).t()


def build_model(cfg: dict[str, Any], vocab: int, *, tp: int = 1, device: str = "cpu", bf16: bool = False,
                fused_loss: str = "auto", compile_layers: bool = False, use_te: bool | None = None,
                attention_backend: str = "auto"):
    """Build a megatron-core GPTModel (model-parallel state must be initialised).

    ``vocab`` is the padded vocabulary size. ``fused_loss``: "auto" (compiled
    loss on CUDA with TP=1), "compiled", "eager" (the same math uncompiled) or
    "megatron" (megatron-core's own vocab-parallel cross-entropy; the only one
    that supports TP > 1).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig

    cuda = device.startswith("cuda")
    if use_te is None:
        use_te = cuda and have_transformer_engine()
    swiglu = cfg["activation"] == "swiglu"
    tcfg = TransformerConfig(
        num_layers=cfg["num_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_query_groups"],
        ffn_hidden_size=cfg["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        normalization=cfg["normalization"],
        layernorm_epsilon=cfg["layernorm_epsilon"],
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=cfg["bias"],
        add_qkv_bias=cfg["bias"],
        hidden_dropout=cfg["hidden_dropout"],
        attention_dropout=cfg["attention_dropout"],
        init_method_std=cfg["init_method_std"],
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not cuda,
        # megatron-core's fusions are torch.compile'd: worth it on a GPU, a
        # minute of compile time for nothing on the CPU
        bias_activation_fusion=cuda and cfg["bias"] and not swiglu,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(normalization=cfg["normalization"])
    else:
        spec = get_gpt_layer_local_spec(normalization=cfg["normalization"])
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class(attention_backend)

    if fused_loss == "auto":
        fused_loss = "compiled" if (cuda and tp == 1) else ("eager" if tp == 1 else "megatron")
    if fused_loss != "megatron" and tp != 1:
        raise ModelConfigError(f"loss {fused_loss!r} needs tensor parallel size 1 (got {tp}); use 'megatron'")
    loss_fn = None
    if fused_loss == "compiled":
        loss_fn = torch.compile(_cross_entropy, dynamic=False)
    elif fused_loss == "eager":
        loss_fn = _cross_entropy
    elif fused_loss != "megatron":
        raise ModelConfigError(f"unknown loss implementation {fused_loss!r}")

    class SnakeGPTModel(GPTModel):
        def compute_language_model_loss(self, labels, logits):
            if loss_fn is None:
                return super().compute_language_model_loss(labels, logits)
            return loss_fn(logits, labels)

    model = SnakeGPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=cfg["seq_length"],
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg["tie_embeddings"],
        position_embedding_type="learned_absolute" if cfg["position_embedding"] == "learned" else "rope",
        rotary_base=cfg["rotary_base"],
    )
    if bf16:
        # what Megatron-LM's Float16Module does: every parameter in bf16, norms included
        # (torch's LayerNorm/RMSNorm are created in fp32 whatever params_dtype says)
        model.bfloat16()
    if cuda:
        model.cuda(torch.cuda.current_device())
    if compile_layers:
        for layer in model.decoder.layers:
            layer.compile(dynamic=False)
    return model, tcfg
