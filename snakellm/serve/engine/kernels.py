"""Fused Triton kernels for the decode step of small batches (one to 32 rows).

Why: at batch 1 a decode step reads every weight once and does little else, so
its floor is the weight bytes over the memory bandwidth (about 0.5 ms for
llama-1b on an H200). The PyTorch step spends as long again in ~20 small
kernels per layer (norms, RoPE, the cache write, residual adds, the SwiGLU
product) and in cuBLAS's matrix-vector products, which stream the weights
well below the bandwidth. Here a layer is five kernels:

1. :func:`linear` with the norm folded in: ``qkv = W_qkv @ norm(x)``;
2. :func:`attend`: RoPE on the row's new query heads and key, the key and value
   written to the static cache at the row's position, and attention of the
   group's query heads over the cache (online softmax, the new token from
   registers);
3. :func:`linear` with the residual add as its epilogue: ``x = x + W_o @ o``;
4. :func:`linear` with the second norm folded in and the activation as its
   epilogue: ``h = act(W_fc1 @ norm(x))`` (for SwiGLU a program computes its
   block of both the gate and the up rows, so ``h`` is half as wide);
5. :func:`linear` with the residual add: ``x = x + W_fc2 @ h``.

The matrix-vector kernel reads each weight tile once, whole rows per program
(so the epilogue needs no second pass), with several tiles in flight;
a batch of 2-16 rows goes through ``tl.dot`` on a 16-row tile, 17-32 rows on a
32-row tile, so the weights are still read once per step. Values are rounded to the model's dtype where
the eager decoder stores them (the matrix product, the activation), so the
two agree to the usual bf16 tolerance, and to fp32 rounding in fp32
(the tests run these kernels in Triton's interpreter on the CPU).

Batches above ``fused_max_batch`` (1 by default: the tiles lose to cuBLAS on
Hopper from 4 rows up) keep cuBLAS's products and take only :func:`attend` (see
``FastDecoder._logits``). Triton is imported only where these kernels run: CUDA
with a 16-bit model and ``fused_max_batch`` > 0, or the interpreter
(``TRITON_INTERPRET=1``) in the tests.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# the matrix-vector kernel's norms (before the product) and activations (after it)
NONE, RMSNORM, LAYERNORM, SWIGLU, GELU = 0, 1, 2, 3, 4
MAX_ROWS = 32  # the largest dot tile: batches of up to 32 rows can take these kernels
TILES = (1, 16, 32)  # the row tiles: one row (elementwise), then tl.dot on 16 or 32 rows


def interpreting() -> bool:
    """Triton's interpreter (the CPU tests): fixed tiles instead of autotuning, no PDL."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def pdl() -> bool:
    """Programmatic dependent launch (Hopper and later): each kernel is scheduled into the tail of the
    one before and fetches its first weight tile before it waits for that kernel's output, which
    hides most of the gap between two short kernels. ``SNAKELLM_NO_PDL=1`` turns it off (to measure)."""
    import torch

    if interpreting() or os.environ.get("SNAKELLM_NO_PDL", "0") not in ("", "0"):
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@triton.jit
def _round(v, DT: tl.constexpr):
    """``v`` rounded to the model's dtype and back to fp32 (where the eager path stores a tensor)."""
    return v.to(DT).to(tl.float32)


@triton.jit
def _row_stats(x_ptr, stride_x, B, K: tl.constexpr, eps, rb, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """LayerNorm's mean and reciprocal standard deviation of each row of ``x`` [B, K], in fp32 (two passes)."""
    bmask = rb < B
    s1 = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        m = bmask[:, None] & (rk < K)[None, :]
        s1 += tl.sum(tl.load(x_ptr + rb[:, None] * stride_x + rk[None, :], mask=m, other=0.0).to(tl.float32), 1)
    mean = s1 / K
    s2 = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        m = bmask[:, None] & (rk < K)[None, :]
        v = tl.load(x_ptr + rb[:, None] * stride_x + rk[None, :], mask=m, other=0.0).to(tl.float32)
        v = tl.where(m, v - mean[:, None], 0.0)
        s2 += tl.sum(v * v, 1)
    return mean, 1.0 / tl.sqrt(s2 / K + eps)


@triton.jit
def _input_tile(x_ptr, nw_ptr, nb_ptr, stride_x, K: tl.constexpr, rb, rk, m, mean, rstd, PRO: tl.constexpr):
    """The input tile [BLOCK_B, BLOCK_K] in fp32 and its squares' row sums (RMSNorm's statistic).

    RMSNorm is applied after the product: ``W @ (x * rstd * g) = rstd * (W @ (x * g))``, so the sum of
    squares accumulates in the same pass and no program reads ``x`` twice; LayerNorm's statistics come
    from a first pass (:func:`_row_stats`).
    """
    v = tl.load(x_ptr + rb[:, None] * stride_x + rk[None, :], mask=m, other=0.0).to(tl.float32)
    sq = tl.zeros_like(v)
    if PRO == 1 or PRO == 2:
        kmask = rk < K
        g = tl.load(nw_ptr + rk, mask=kmask, other=0.0).to(tl.float32)[None, :]
        if PRO == 1:
            sq = v * v
            v = v * g
        else:
            v = (v - mean[:, None]) * rstd[:, None] * g
            v += tl.load(nb_ptr + rk, mask=kmask, other=0.0).to(tl.float32)[None, :]
    return v, tl.sum(sq, 1)


@triton.jit
def _weight_tiles(w_ptr, rn, nmask, N, K: tl.constexpr, rk, ACT: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns ``rk`` and, for SwiGLU, the up rows' tile (else the same)."""
    wm = nmask[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wm, other=0.0)
    w_up = w
    if ACT == 3:
        w_up = tl.load(w_ptr + (rn + N)[:, None] * K + rk[None, :], mask=wm, other=0.0)
    return w, w_up


@triton.jit
def _product(acc, x, w, BLOCK_B: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr):
    """``acc += x @ w.T``: elementwise into a [BLOCK_N, BLOCK_K] accumulator for one row (summed at the
    end, no reduction per tile), ``tl.dot`` on the 16-row tile."""
    if BLOCK_B == 1:
        acc += w.to(tl.float32) * x
    elif IEEE:
        acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x.to(DT), tl.trans(w))
    return acc


@triton.jit
def _finish(acc, BLOCK_B: tl.constexpr):
    """The accumulator as [BLOCK_B, BLOCK_N]."""
    if BLOCK_B == 1:
        out = tl.sum(acc, 1)[None, :]
    else:
        out = acc
    return out


@triton.jit
def _output(
    acc, ss, bias_ptr, rn, nmask, K: tl.constexpr, eps, PRO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr
):
    """The product [BLOCK_B, BLOCK_N] in fp32: RMSNorm's scale (applied after the product) and the bias."""
    out = _finish(acc, BLOCK_B)
    if PRO == 1:
        out = out / tl.sqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    res_ptr,
    bias_ptr,
    nw_ptr,
    nb_ptr,
    B,
    N,
    K: tl.constexpr,
    stride_x,
    eps,
    PRO: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    OUT_F32: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``y[b, n] = res[b, n] + act(bias[n] + sum_k norm(x)[b, k] * w[n, k])`` for a block of ``n``.

    ``ACT == SWIGLU``: ``w`` holds gate rows ``0..N-1`` and up rows ``N..2N-1`` (fc1); the program
    computes both halves of its block and stores ``silu(gate) * up`` [B, N], so fc2 reads N values.
    """
    DT: tl.constexpr = w_ptr.dtype.element_ty
    if PDL:
        gdc_launch_dependents()  # the next kernel may be scheduled into this one's tail
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_B)
    nmask, bmask = rn < N, rb < B
    # one row: the weights do not depend on the kernel before, so the first tile loads (with PDL, in
    # its tail) before the wait, and each iteration fetches the next; the 16-row tile keeps Triton's
    # own pipelining of the loop, which that prefetch defeats
    PREFETCH: tl.constexpr = BLOCK_B == 1
    if PREFETCH:
        w, w_up = _weight_tiles(w_ptr, rn, nmask, N, K, tl.arange(0, BLOCK_K), ACT)
    if PDL:
        gdc_wait()  # x is the kernel before's output
    if PRO == 2:
        mean, rstd = _row_stats(x_ptr, stride_x, B, K, eps, rb, BLOCK_B, BLOCK_K)
    else:
        mean = tl.zeros([BLOCK_B], dtype=tl.float32)
        rstd = mean
    if BLOCK_B == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    up = acc
    ss = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        if not PREFETCH:
            w, w_up = _weight_tiles(w_ptr, rn, nmask, N, K, rk, ACT)
        xv, sq = _input_tile(
            x_ptr, nw_ptr, nb_ptr, stride_x, K, rb, rk, bmask[:, None] & kmask[None, :], mean, rstd, PRO
        )
        ss += sq
        acc = _product(acc, xv, w, BLOCK_B, IEEE, DT)
        if ACT == 3:
            up = _product(up, xv, w_up, BLOCK_B, IEEE, DT)
        if PREFETCH:  # the next tile (all masked off after the last)
            w, w_up = _weight_tiles(w_ptr, rn, nmask, N, K, rk + BLOCK_K, ACT)
    # the matrix product's output, rounded as the eager path stores it
    out = _round(_output(acc, ss, bias_ptr, rn, nmask, K, eps, PRO, HAS_BIAS, BLOCK_B), DT)
    if ACT == 3:
        u = _round(_output(up, ss, bias_ptr + N, rn, nmask, K, eps, PRO, HAS_BIAS, BLOCK_B), DT)
        out = _round(_round(out / (1.0 + tl.exp(-out)), DT) * u, DT)
    elif ACT == 4:
        out = _round(0.5 * out * (1.0 + tl.erf(out * 0.7071067811865476)), DT)
    offs = rb[:, None] * N + rn[None, :]
    m = bmask[:, None] & nmask[None, :]
    if HAS_RES:
        out += tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if OUT_F32:
        tl.store(y_ptr + offs, _round(out, DT), mask=m)
    else:
        tl.store(y_ptr + offs, out.to(DT), mask=m)


# (BLOCK_N, BLOCK_K, warps, stages) tried by the autotuner: one row streams whole weight rows with
# several tiles in flight; the 16- and 32-row tiles (tl.dot) need BLOCK_N >= 16
_CONFIGS = {
    1: ((1, 1024, 4, 3), (2, 1024, 4, 3), (2, 512, 4, 4), (4, 512, 4, 3), (4, 1024, 8, 3), (2, 2048, 8, 2)),
    16: ((16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 3)),
    32: ((16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3)),
}


def row_tile(rows: int) -> int:
    """The smallest row tile that holds ``rows`` (1, 16 or 32)."""
    return next(t for t in TILES if t >= rows)


@functools.cache
def _tuned_linear(rows_tile: int) -> Any:
    """The kernel autotuned per (shape, prologue) on the GPU: the best tile differs by matrix."""
    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in _CONFIGS[rows_tile]
    ]
    return triton.autotune(configs, key=["N", "K", "PRO", "ACT", "HAS_RES", "OUT_F32"], cache_results=True)(
        _linear_kernel
    )


def linear(
    x: Any,
    w: Any,
    *,
    bias: Any = None,
    residual: Any = None,
    norm: int = NONE,
    norm_w: Any = None,
    norm_b: Any = None,
    eps: float = 0.0,
    act: int = NONE,
    out_f32: bool = False,
) -> Any:
    """``residual + act(bias + norm(x) @ w.T)`` for ``x`` [B <= 32, K] and ``w`` [N, K] (one kernel).

    ``norm``: RMSNORM or LAYERNORM (``norm_w``, ``norm_b``, ``eps``) or NONE; ``act``: SWIGLU (``w``
    holds the gate rows then the up rows; the output is [B, N/2]), GELU or NONE; ``out_f32``: fp32
    output (the logits), rounded as the eager path rounds.
    """
    import torch

    B, K = x.shape
    N = w.shape[0] // 2 if act == SWIGLU else w.shape[0]
    if B > MAX_ROWS or x.stride(1) != 1 or not w.is_contiguous() or w.shape[1] != K:
        raise ValueError(f"linear: needs x [<= {MAX_ROWS}, K] with unit column stride and w [N, K] contiguous")
    y = torch.empty(B, N, dtype=torch.float32 if out_f32 else w.dtype, device=x.device)
    args: tuple[Any, ...] = (x, w, y, residual if residual is not None else y, bias if bias is not None else w)
    args += (norm_w if norm_w is not None else w, norm_b if norm_b is not None else w, B, N, K, x.stride(0), eps)
    flags = {
        "PRO": norm,
        "ACT": act,
        "HAS_BIAS": bias is not None,
        "HAS_RES": residual is not None,
        "OUT_F32": out_f32,
        "IEEE": w.dtype == torch.float32,
        "PDL": pdl(),
    }
    tile = row_tile(B)
    if interpreting():
        _linear_kernel[(triton.cdiv(N, 1024),)](*args, **flags, BLOCK_B=tile, BLOCK_N=1024, BLOCK_K=128)
    else:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _tuned_linear(tile)[grid](*args, **flags, BLOCK_B=tile, launch_pdl=flags["PDL"])
    return y


@triton.jit
def _attend_kernel(
    qkv_ptr,
    kv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    out_ptr,
    stride_qkv,
    plane,
    row_stride,
    slots,
    L: tl.constexpr,
    scale,
    PER: tl.constexpr,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """One (row, KV group): RoPE, cache write at ``pos``, attention over slots ``0..pos``."""
    DT: tl.constexpr = kv_ptr.dtype.element_ty
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # qkv is the kernel before's output
    b, g = tl.program_id(0), tl.program_id(1)
    G = tl.num_programs(1)
    pos = tl.load(pos_ptr + b + tl.arange(0, 1))  # [1]: the interpreter wants tensors, not scalars
    rh, rd = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    hm, dm = rh < PER, rd < D
    base = qkv_ptr + b * stride_qkv + g * (PER + 2) * D
    qm = hm[:, None] & dm[None, :]
    q = tl.load(base + rh[:, None] * D + rd[None, :], mask=qm, other=0.0).to(tl.float32)
    k = tl.load(base + PER * D + rd, mask=dm, other=0.0).to(tl.float32)
    v = tl.load(base + (PER + 1) * D + rd, mask=dm, other=0.0).to(tl.float32)
    if ROPE:  # t * cos + rotate_half(t) * sin, rounded as the eager path rounds each product
        rp = (rd + D // 2) % D
        sign = tl.where(rd < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + pos * D + rd, mask=dm, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + rd, mask=dm, other=0.0).to(tl.float32)
        q_p = tl.load(base + rh[:, None] * D + rp[None, :], mask=qm, other=0.0).to(tl.float32)
        k_p = tl.load(base + PER * D + rp, mask=dm, other=0.0).to(tl.float32)
        q = _round(_round(q * cos[None, :], DT) + _round(sign[None, :] * q_p * sin[None, :], DT), DT)
        k = _round(_round(k * cos, DT) + _round(sign * k_p * sin, DT), DT)
    cache_k = kv_ptr + b * row_stride + g * slots * D
    cache_v = cache_k + plane
    tl.store(cache_k + pos * D + rd, k.to(DT), mask=dm)
    tl.store(cache_v + pos * D + rd, v.to(DT), mask=dm)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    qd = q if IEEE else q.to(DT)
    for s0 in range(0, L, BLOCK_L):
        rl = s0 + tl.arange(0, BLOCK_L)
        lm = rl < pos  # the slots before this token; the new one comes from registers below
        km = lm[:, None] & dm[None, :]
        kt = tl.load(cache_k + rl[:, None] * D + rd[None, :], mask=km, other=0.0)
        vt = tl.load(cache_v + rl[:, None] * D + rd[None, :], mask=km, other=0.0)
        if IEEE:
            s = tl.dot(qd, tl.trans(kt.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(qd, tl.trans(kt)).to(tl.float32) * scale
        s = tl.where(lm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(DT), vt).to(tl.float32)
        m_i = m_new
    s_new = tl.sum(q * k[None, :], 1) * scale
    m_new = tl.maximum(m_i, s_new)
    p_new = tl.exp(s_new - m_new)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * v[None, :]
    o = acc / l_i[:, None]
    out = out_ptr + b * (G * PER * D) + (g * PER + rh[:, None]) * D + rd[None, :]
    tl.store(out, o.to(DT), mask=qm)


def attend(qkv: Any, kv: Any, pos: Any, cos: Any, sin: Any, per: int, length: int) -> Any:
    """Attention output [B, n * d] for the new tokens in ``qkv`` [B, g * (per + 2) * d] (one kernel).

    ``kv``: one layer's cache [2, rows, g, slots, d] (written at each row's ``pos``); ``cos``/``sin``:
    [slots, d] tables in the model's dtype, or None (no RoPE); ``length``: a bound on ``pos`` (the
    length bucket) that sets the loop over the cache.
    """
    import torch

    B = qkv.shape[0]
    _two, _rows, g, slots, d = kv.shape
    out = torch.empty(B, g * per * d, dtype=kv.dtype, device=kv.device)
    rope = cos is not None
    kernel = _attend_kernel if interpreting() else _tuned_attend()
    kernel[(B, g)](
        qkv,
        kv,
        cos if rope else kv,
        sin if rope else kv,
        pos,
        out,
        qkv.stride(0),
        kv.stride(0),
        kv.stride(1),
        slots,
        length,
        d**-0.5,
        PER=per,
        D=d,
        ROPE=rope,
        IEEE=kv.dtype == torch.float32,
        PDL=pdl(),
        launch_pdl=pdl(),
        BLOCK_H=max(16, triton.next_power_of_2(per)),
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        **({"BLOCK_L": 32} if interpreting() else {}),
    )
    return out


@functools.cache
def _tuned_attend() -> Any:
    """The attention kernel autotuned per (length bucket, heads per group, head size): wider cache tiles
    mean fewer dependent load-softmax rounds (rewriting the same key and value while timing is harmless)."""
    configs = [
        triton.Config({"BLOCK_L": n}, num_warps=w, num_stages=s)
        for n, w, s in ((64, 4, 3), (128, 4, 3), (128, 8, 2), (256, 8, 2), (64, 2, 4))
    ]
    return triton.autotune(configs, key=["L", "PER", "D"], cache_results=True)(_attend_kernel)
