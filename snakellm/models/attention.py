"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local spec computes attention unfused (a [b, h, s, s] score
tensor); without Transformer Engine this is the fast path on a GPU (flash /
cuDNN kernels) and a memory-lean one on the CPU.

Packed fine-tuning rows come with a mask in one of two forms
(``examples.packed_attention``): megatron's dense boolean ``[b, 1, s, s]``
mask (True = masked out), which SDPA runs with its memory-efficient kernel
over every block; or the rows' segment ids (int32 ``[b, 1, 1, s]``,
:func:`snakellm.finetune.dataset.packed_segments`), from which either
FlexAttention's block mask is built once per micro-batch (causal within a
segment, the fully masked blocks skipped) or, with ``varlen``, the segments'
cumulative lengths for torch's flash variable-length attention
(``torch.nn.attention.varlen``; CUDA only), which computes each segment as a
sequence of its own. :func:`set_packed_kernel` picks flex or varlen per model.
"""

from __future__ import annotations

import functools
from typing import Any

ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def sdpa_attention_class(backend: str = "auto") -> Any:
    import contextlib

    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }.get(backend)

    def kernel() -> contextlib.AbstractContextManager[Any]:
        """torch's own kernel choice ("auto"), or the one backend asked for."""
        return contextlib.nullcontext() if chosen is None else sdpa_kernel([chosen])

    class SDPAttention(DotProductAttention):
        """megatron-core's core attention, computed by ``scaled_dot_product_attention``.

        Packed rows' segment ids (an int32 ``attention_mask``) go to ``packed_kernel``: ``flex`` or
        ``varlen`` (:func:`set_packed_kernel`).

        Takes and returns megatron's layouts: q/k/v ``[s, b, heads, d]`` in,
        context ``[s, b, heads * d]`` out. Causal masking is implicit (GPT
        pretraining never passes another mask); grouped-query attention uses
        SDPA's ``enable_gqa`` instead of materialising repeated keys/values.
        """

        packed_kernel = "flex"

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            assert packed_seq_params is None and attention_bias is None, (
                "SDPAttention: packed sequences/bias unsupported"
            )
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            p = self.attention_dropout.p if self.training else 0.0
            if p > 0 and not self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                rng = tensor_parallel.get_cuda_rng_tracker().fork()
            else:
                rng = contextlib.nullcontext()
            if attention_mask is not None and attention_mask.dtype != torch.bool:  # packed rows' segment ids
                assert p == 0, f"packed_attention {self.packed_kernel}: attention dropout must be 0"
                if self.packed_kernel == "varlen":
                    return varlen_packed(q, k, v, attention_mask, self.softmax_scale)
                out = flex_packed(q, k, v, attention_mask, self.softmax_scale, groups > 1)
            else:
                # a mask comes only with packed fine-tuning sequences (megatron's convention: True = masked
                # out; causal and block-diagonal per example); pretraining passes None
                mask = None if attention_mask is None else ~attention_mask
                with rng, kernel():
                    out = F.scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        attn_mask=mask,
                        dropout_p=p,
                        is_causal=mask is None,
                        scale=self.softmax_scale,
                        enable_gqa=groups > 1,
                    )
            s, b = out.size(2), out.size(0)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SDPAttention


# the last micro-batch's block mask and cumulative lengths, with its segments tensor (held, so that no other tensor
# can take its memory and match the key): every layer of a forward pass and its recomputation reuse them
_BLOCK_MASKS: dict[tuple, tuple[Any, Any]] = {}


def _per_batch(segments: Any, what: tuple, build: Any) -> Any:
    """``build()``, once per micro-batch's ``segments`` and ``what``: the last batch's results are kept."""
    batch = (segments.data_ptr(), segments._version, tuple(segments.shape), segments.stride(), str(segments.device))
    key: tuple = batch + what
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        return hit[1]
    if any(k[:5] != batch for k in _BLOCK_MASKS):  # another micro-batch: drop the last one's
        _BLOCK_MASKS.clear()
    value = build()
    _BLOCK_MASKS[key] = (segments, value)
    return value


def _block_mask_of(segments: Any, q_len: int) -> Any:
    """FlexAttention's block mask of packed rows: query i sees key j when both are in one segment and j <= i."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segments.reshape(segments.size(0), -1)

    def same_segment_causal(b, h, q_idx, kv_idx):
        return (seg[b, q_idx] == seg[b, kv_idx]) & (q_idx >= kv_idx)

    def build() -> Any:
        return create_block_mask(same_segment_causal, seg.size(0), None, q_len, seg.size(1), device=seg.device)

    return _per_batch(segments, ("block_mask", q_len), build)


def block_mask_of(segments: Any, q_len: int) -> Any:
    """:func:`_block_mask_of`, run eagerly where the layers are compiled (a cache lookup, not a graph op)."""
    import torch

    return torch.compiler.disable(_block_mask_of)(segments, q_len)


_FLEX: list[Any] = []


def _flex() -> Any:
    """``flex_attention`` eager, and compiled once (its fused kernel; eager it materialises the scores)."""
    if not _FLEX:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.extend([flex_attention, torch.compile(flex_attention, dynamic=False)])
    return _FLEX


def flex_packed(q: Any, k: Any, v: Any, segments: Any, scale: float | None, gqa: bool) -> Any:
    """Attention of packed rows (q/k/v ``[b, heads, s, d]``) through FlexAttention with their block mask: on a
    GPU its compiled kernel (inside compiled layers, traced into their graph), on the CPU eager (numerics)."""
    import warnings

    import torch

    eager, compiled = _flex()
    mask = block_mask_of(segments, q.size(2))
    if not q.is_cuda:
        with warnings.catch_warnings():
            # eager flex_attention (the CPU) warns that it is for debugging: here it checks the numerics
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            return eager(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    fn = eager if torch.compiler.is_compiling() else compiled  # inside compiled layers: traced into their graph
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)


def set_packed_kernel(model: Any, kind: str) -> int:
    """Packed rows' attention of every core attention of ``model``: ``flex`` or ``varlen``; the count set."""
    n = 0
    for m in model.modules():
        if hasattr(m, "packed_kernel"):
            m.packed_kernel = kind
            n += 1
    return n


def cu_seqlens_of(segments: Any) -> Any:
    """The packed rows' segments as one batch of sequences over the flattened ``[b * s]`` tokens: int32
    cumulative lengths ``[0, ..., b * s]``, a new sequence wherever the segment id changes or a row starts
    (padding, segment 0, is a sequence of its own that no real token sees)."""
    import torch

    seg = segments.reshape(segments.size(0), -1)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    idx = starts.reshape(-1).nonzero().reshape(-1)
    total = torch.tensor([seg.numel()], dtype=idx.dtype, device=idx.device)
    return torch.cat([idx, total]).to(torch.int32)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The parameters of this torch's ``varlen_attn`` (read once)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_call(q: Any, k: Any, v: Any, cu: Any, max_len: int, scale: float | None) -> Any:
    """torch's ``varlen_attn`` on ``[tokens, heads, d]`` tensors, causal, across its signatures (2.10: is_causal,
    no scale, no GQA; later: window_size, scale, enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kw: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if k.size(1) != q.size(1):
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if scale is not None:
        if "scale" in params:
            kw["scale"] = scale
        else:  # the kernel's own 1/sqrt(d), undone on q
            q = q * (scale * q.size(-1) ** 0.5)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _varlen_packed(q: Any, k: Any, v: Any, segments: Any, scale: float | None, attn: Any = None) -> Any:
    b, heads, s, d = q.shape
    cu = _per_batch(segments, ("cu_seqlens",), lambda: cu_seqlens_of(segments))  # one host sync a micro-batch
    flat = [t.transpose(1, 2).reshape(b * s, t.size(1), d) for t in (q, k, v)]  # [b*s, heads, d]
    kernel = attn or _varlen_call
    out = kernel(flat[0], flat[1], flat[2], cu, s, scale)
    return out.view(b, s, heads * d).transpose(0, 1).contiguous()  # megatron's [s, b, heads * d]


def varlen_packed(q: Any, k: Any, v: Any, segments: Any, scale: float | None, attn: Any = None) -> Any:
    """Attention of packed rows (q/k/v ``[b, heads, s, d]``, segment ids ``[b, 1, 1, s]``) as flash
    variable-length attention, each segment a causal sequence of its own; megatron's ``[s, b, heads * d]`` out.
    Eager where the layers are compiled (the cumulative lengths have a data-dependent size). ``attn``: the
    kernel, ``varlen_attn``'s by default (a test passes a CPU reference of its contract)."""
    import torch

    return torch.compiler.disable(_varlen_packed)(q, k, v, segments, scale, attn)


def varlen_reference(q: Any, k: Any, v: Any, cu: Any, max_len: int, scale: float | None) -> Any:
    """``varlen_attn``'s contract on any device (SDPA per sequence, slow): each ``cu`` slice of the
    ``[tokens, heads, d]`` tensors a causal sequence alone, fewer key/value heads shared by groups. The CPU tests'
    and ``scripts/check_varlen_gpu.py --smoke``'s stand-in for the CUDA kernel."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if b - a > max_len:
            raise ValueError(f"sequence of {b - a} tokens past max_len {max_len}")
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=k.size(1) != q.size(1))
        out[a:b] = o.transpose(0, 1)
    return out
