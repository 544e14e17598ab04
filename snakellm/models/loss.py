"""The language-model loss: per-token cross-entropy from megatron's logits layout."""

from __future__ import annotations

from typing import Any


def cross_entropy(logits: Any, labels: Any) -> Any:
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


# ---------------------------------------------------------------------- tensor parallelism


def _max(logits: Any) -> Any:
    return logits.float().amax(dim=-1)


def _stats(logits: Any, gmax: Any, local_t: Any, inside: Any) -> tuple[Any, Any]:
    """sum(exp(x - max)) over this rank's vocabulary slice, and the target's logit (0 where it is elsewhere)."""
    x = logits.float()
    sum_exp = (x - gmax.unsqueeze(-1)).exp().sum(dim=-1)
    target = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
    return sum_exp, target


def _grad(logits: Any, lse: Any, local_t: Any, inside: Any, g: Any) -> Any:
    """d loss / d logits = (softmax - one_hot(target)) * g, in the logits' dtype."""
    import torch

    x = logits.float()
    p = (x - lse.unsqueeze(-1)).exp()
    ids = torch.arange(x.size(-1), device=x.device)
    onehot = ((ids == local_t.unsqueeze(-1)) & inside.unsqueeze(-1)).to(x.dtype)
    return ((p - onehot) * g.unsqueeze(-1)).to(logits.dtype)


_KERNELS: dict[bool, tuple[Any, Any, Any]] = {}


def _kernels(compiled: bool) -> tuple[Any, Any, Any]:
    if compiled not in _KERNELS:
        import torch

        fns = (_max, _stats, _grad)
        _KERNELS[compiled] = tuple(torch.compile(f, dynamic=False) for f in fns) if compiled else fns  # type: ignore[assignment]
    return _KERNELS[compiled]


def vocab_parallel_cross_entropy(logits: Any, labels: Any, *, compiled: bool = True, group: Any = None) -> Any:
    """Per-token loss [b, s] from this rank's vocabulary slice of the logits [s, b, V / tp] and labels [b, s].

    megatron-core's ``vocab_parallel_cross_entropy`` with the same three
    reductions over the tensor-parallel group (the maximum, the sum of
    exponentials, the target's logit: the last two in one all-reduce), but each
    pass over the [tokens, V / tp] logits is one compiled kernel that reads them
    in their own dtype: no fp32 copy of the logits is materialised, in the
    forward or the backward (megatron-core's keeps several).
    """
    if group is None:  # megatron-core's tensor-parallel group
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelCE.apply(logits, labels.t(), group, _kernels(compiled)).t()


def _make_function() -> Any:
    import torch
    import torch.distributed as dist

    class VocabParallelCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, target: Any, group: Any, kernels: Any) -> Any:
            kmax, kstats, _ = kernels
            world = dist.get_world_size(group) if group is not None else 1
            vp = logits.size(-1)
            start = (dist.get_rank(group) if world > 1 else 0) * vp
            local_t = target - start
            inside = (local_t >= 0) & (local_t < vp)
            local_t = torch.where(inside, local_t, torch.zeros_like(local_t))
            gmax = kmax(logits)
            if world > 1:
                dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            sum_exp, tgt = kstats(logits, gmax, local_t, inside)
            both = torch.stack([sum_exp, tgt])
            if world > 1:
                dist.all_reduce(both, group=group)
            lse = both[0].log() + gmax
            ctx.kernels = kernels
            ctx.save_for_backward(logits, lse, local_t, inside)
            return lse - both[1]

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            logits, lse, local_t, inside = ctx.saved_tensors
            grad = ctx.kernels[2](logits, lse, local_t, inside, g.contiguous())
            return row_major(grad), None, None, None

    return VocabParallelCE


def row_major(t: Any) -> Any:
    """``t`` [s, b, V] (contiguous) as a view with row-major strides, also along a size-1 dimension.

    Inductor may give the compiled gradient's micro-batch dimension any stride when it has size 1
    (``(V, s * V, 1)`` for [s, 1, V]); every element is where row-major puts it, but
    ``torch.matmul`` then cannot fold [s, 1, V] @ [V, h] into one matrix product and runs a batched
    one per token instead: in the output layer's backward at 8B, tensor parallel, micro batch 1,
    that was 152 ms a micro-batch, 40% of the step.
    """
    return t.reshape(-1, t.size(-1)).view(t.shape)


class _Lazy:
    """The autograd function, created on first use (this module's top level stays torch-free)."""

    fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _make_function()
        return self.fn.apply(*args)


_VocabParallelCE = _Lazy()
