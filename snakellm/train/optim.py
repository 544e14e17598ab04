"""AdamW over megatron-core DDP gradients, with fp32 master weights for bf16 models.

megatron-core's own optimizer wrappers allocate on ``device="cuda"`` and, without
apex or Transformer Engine, run an unfused torch AdamW plus Python-level
multi-tensor fallbacks. This is the same algorithm in a few lines: gradients
come from DDP's contiguous fp32 ``main_grad`` buffers, the clip coefficient is
computed on the device (no host sync per step), torch's fused AdamW updates
fp32 master weights, and bf16 model weights are refreshed with one
``_foreach_copy_``.

The checkpoint layout is Megatron's: for bf16 models that of
``Float16OptimizerWithFloat16Params`` (``optimizer`` + ``fp32_from_fp16_params``),
for fp32 models that of ``FP32Optimizer``, with every per-parameter tensor a
``ShardedTensor`` keyed after its model parameter (``optimizer.state.exp_avg.<key>``),
so tensor-parallel resharding works as for the model.
"""

from __future__ import annotations

from typing import Any

import torch


def _is_tp_duplicate(p) -> bool:
    """True for a parameter the gradient norm counts elsewhere: a replicated one on a tensor-parallel rank
    other than 0, or the last pipeline stage's copy of tied embeddings (megatron-core marks it ``shared``)."""
    from megatron.core import parallel_state

    if getattr(p, "shared", False):
        return True
    if getattr(p, "tensor_model_parallel", False):
        return False
    return parallel_state.get_tensor_model_parallel_rank() != 0


def _is_expert(p) -> bool:
    """A mixture-of-experts weight: megatron-core marks the experts ``allreduce = False`` (each expert-parallel
    rank holds other experts; their gradients are reduced over the expert data-parallel ranks only)."""
    return not getattr(p, "allreduce", True)


def _expert_sq(grads: list[torch.Tensor], experts: list[bool]) -> torch.Tensor | None:
    """The experts' squared gradient norm summed over the expert-parallel ranks (None: no experts here)."""
    from megatron.core import parallel_state as ps

    mine = [g for g, e in zip(grads, experts) if e]
    if not mine:
        return None
    sq = torch.stack(torch._foreach_norm(mine)).square().sum()
    if ps.get_expert_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sq, group=ps.get_expert_model_parallel_group())
    return sq


def _sum_over_model_parallel(sq: torch.Tensor) -> None:
    """The squared norm summed over the tensor- and pipeline-parallel ranks (each holds part of the model)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sq, group=ps.get_model_parallel_group())
    elif ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sq, group=ps.get_tensor_model_parallel_group())


RUN_MAX = 1 << 28  # elements of one coalesced run: 1 GB of fp32 master (kernels index well inside int32 chunks)


class _One:
    """One parameter as its own optimizer tensor: its fp32 master (the parameter itself when it is fp32) and its
    ``main_grad``, read at every step (whoever set it may have replaced it)."""

    def __init__(self, param: torch.nn.Parameter, expert: bool, counted: bool):
        self.params = [param]
        self.master = param if param.dtype == torch.float32 else param.detach().clone().float()
        self.views, self.offsets = [self.master], [(0, param.numel())]
        self.expert, self.counted = expert, counted

    def grad(self) -> torch.Tensor:
        g = self.params[0].main_grad  # type: ignore[attr-defined]  # set by megatron-core DDP
        return g if g.dtype == torch.float32 else g.float()


class _Run:
    """Parameters of one optimizer group whose ``main_grad``s lie back to back in one of DDP's gradient
    buffers: one fp32 master tensor, one view of the buffer as their gradient, one set of Adam states for all
    of them (the masters of the parameters are views of it). At Qwen3-30B-A3B's shape this turns ~2,100
    tensors into ~100 for the fused AdamW, the norm and the clip, whose per-tensor host work otherwise leaves
    the GPU waiting (tens of ms a step)."""

    def __init__(self, params: list[torch.nn.Parameter], expert: bool, counted: bool):
        g0 = params[0].main_grad  # type: ignore[attr-defined]
        total = sum(p.numel() for p in params)
        self.params, self.expert, self.counted = params, expert, counted
        self._grad, self._ptr = g0.as_strided((total,), (1,), g0.storage_offset()), g0.data_ptr()
        self.master = torch.empty(total, dtype=torch.float32, device=g0.device)
        self.views, self.offsets, o = [], [], 0  # each parameter's master and its (offset, numel) in the run
        with torch.no_grad():
            for p in params:
                v = self.master[o : o + p.numel()].view(p.shape)
                v.copy_(p.detach())
                self.views.append(v)
                self.offsets.append((o, p.numel()))
                o += p.numel()

    def grad(self) -> torch.Tensor:
        if self.params[0].main_grad.data_ptr() != self._ptr:  # type: ignore[attr-defined]
            raise RuntimeError("a parameter's main_grad moved after the optimizer was built (DDP rebuilt its buffers?)")
        return self._grad if self._grad.dtype == torch.float32 else self._grad.float()


def _coalesce(params: list[torch.nn.Parameter], keys: list[tuple]) -> list[list[int]]:
    """Indices of ``params`` (bf16 with ``main_grad`` views) in runs of back-to-back gradients of equal key."""

    def where(i: int) -> tuple[int, int]:
        g = params[i].main_grad  # type: ignore[attr-defined]
        return g.untyped_storage().data_ptr(), g.storage_offset()

    runs: list[list[int]] = []
    size = 0
    for i in sorted(range(len(params)), key=where):
        if runs:
            j = runs[-1][-1]
            (ps, po), (pj, oj) = where(i), where(j)
            n = params[i].numel()
            if ps == pj and po == oj + params[j].numel() and keys[i] == keys[j] and size + n <= RUN_MAX:
                runs[-1].append(i)
                size += n
                continue
        runs.append([i])
        size = params[i].numel()
    return runs


def _coalescable(p: torch.nn.Parameter) -> bool:
    g = getattr(p, "main_grad", None)
    return p.dtype != torch.float32 and g is not None and g.is_contiguous() and g.shape == p.shape


class MixedPrecisionAdamW:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        fused: bool | None = None,
        coalesce: bool = True,
    ):
        self.clip_grad = clip_grad
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for _name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            # no weight decay on biases and norm gains (1-D), as in Megatron-LM and GPT-2
            (no_decay if p.dim() < 2 else decay).append(p)
        self.model_groups = [g for g in (decay, no_decay) if g]
        # the optimizer's tensors, per group: runs of parameters whose gradients are one buffer slice (bf16
        # parameters under DDP), else one tensor a parameter
        self.entries: list[list[Any]] = []
        for group in self.model_groups:
            keys = [(_is_expert(p), not _is_tp_duplicate(p) and not _is_expert(p)) for p in group]
            ok = [i for i, p in enumerate(group) if coalesce and _coalescable(p)]
            runs = _coalesce([group[i] for i in ok], [keys[i] for i in ok]) if ok else []
            in_run = {ok[i] for r in runs if len(r) > 1 for i in r}
            row: list[Any] = [_Run([group[ok[i]] for i in r], *keys[ok[r[0]]]) for r in runs if len(r) > 1]
            row += [_One(p, *keys[i]) for i, p in enumerate(group) if i not in in_run]
            self.entries.append(row)
        # each parameter's master (a view where it is in a run) and where its Adam state lives: checkpoints
        # keep Megatron's layout of one state a parameter whatever the grouping here
        where = {id(p): (e, v, o) for row in self.entries for e in row for p, v, o in zip(e.params, e.views, e.offsets)}
        self.master_groups = [[where[id(p)][1] for p in g] for g in self.model_groups]
        self._slots = [(where[id(p)][0], where[id(p)][2]) for g in self.model_groups for p in g]
        self.has_masters = any(p.dtype != torch.float32 for g in self.model_groups for p in g)
        self.coalesced = any(isinstance(e, _Run) for row in self.entries for e in row)
        wds = [weight_decay, 0.0] if (decay and no_decay) else ([weight_decay] if decay else [0.0])
        device = next(model.parameters()).device
        if fused is None:
            fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            [{"params": [e.master for e in row], "weight_decay": wd} for row, wd in zip(self.entries, wds)],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self._pairs = [(p, m) for pg, mg in zip(self.model_groups, self.master_groups) for p, m in zip(pg, mg)]
        self._all = [e for row in self.entries for e in row]
        self._copies = [(p, m) for p, m in self._pairs if m is not p]

    # ------------------------------------------------------------------ step

    def step(self, lr: float) -> torch.Tensor:
        """Clip and apply the accumulated ``main_grad``s; return the gradient norm (on the device)."""
        grads = []
        for e in self._all:
            e.master.grad = e.grad()
            grads.append(e.master.grad)
        norm_grads = [g for g, e in zip(grads, self._all) if e.counted]
        sq = torch.stack(torch._foreach_norm(norm_grads)).square().sum() if norm_grads else grads[0].new_zeros(())
        esq = _expert_sq(grads, [e.expert for e in self._all])
        if esq is not None:
            sq = sq + esq
        _sum_over_model_parallel(sq)
        norm = sq.sqrt()
        fused = bool(self.optimizer.defaults.get("fused"))
        if self.clip_grad > 0 and fused:
            # the fused AdamW divides each gradient by ``grad_scale`` as it reads it (GradScaler's unscaling):
            # the clip costs no pass of its own over the fp32 gradients
            self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.clip_grad, min=1.0)  # type: ignore[attr-defined]
        elif self.clip_grad > 0:
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.grad_scale = None  # type: ignore[attr-defined]
        if self._copies:
            torch._foreach_copy_([p.data for p, _ in self._copies], [m for _, m in self._copies])
        for e in self._all:
            e.master.grad = None
        return norm

    # ------------------------------------------------------------------ checkpoints

    def _init_state(self):
        """Allocate the (lazily created) AdamW state so there is something to load into."""
        fused = bool(self.optimizer.defaults.get("fused"))
        for e in self._all:
            st = self.optimizer.state[e.master]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=e.master.device if fused else "cpu")
                st["exp_avg"] = torch.zeros_like(e.master, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(e.master, memory_format=torch.preserve_format)

    def _per_param_state(self) -> dict:
        """torch AdamW's ``state_dict()`` as it is for one tensor a parameter (the checkpoint's layout): the
        state of a parameter in a run is its slice of the run's, a view."""
        inner = self.optimizer.state_dict()
        if not self.coalesced:
            return inner
        state: dict[Any, Any] = {}
        for i, (e, (lo, n)) in enumerate(self._slots):
            st = self.optimizer.state.get(e.master)
            if st:
                shape = self._pairs[i][0].shape
                state[i] = {k: v if k == "step" else v[lo : lo + n].view(shape) for k, v in st.items()}
        first, groups = 0, []
        for g, pg in zip(inner["param_groups"], self.model_groups):
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(first, first + len(pg)))}
            )
            first += len(pg)
        return {"state": state, "param_groups": groups}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        if is_loading:
            self._init_state()
        inner = self._per_param_state()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, [p for p, _ in self._pairs])
        step = None
        for st in inner["state"].values():
            step = st.get("step", step)
        optim_state_to_sharding_state(inner, id_map, exclude_keys=("step",))
        if step is not None:  # on the CPU: fused AdamW keeps it on each rank's GPU, which the common state compares
            inner["state"]["common_step"] = _cpu(step)
        if not self.has_masters:
            return inner
        fp32 = []
        idx = 0
        for mg in self.master_groups:
            row = []
            for m in mg:
                row.append(make_sharded_optimizer_tensor(id_map[idx], m, prefix="optimizer.state.fp32_param"))
                idx += 1
            fp32.append(row)
        return {"optimizer": inner, "fp32_from_fp16_params": fp32}

    def load_state_dict(self, state: dict) -> None:
        inner = state["optimizer"] if self.has_masters else state
        step = inner["state"].pop("common_step", None)
        if step is not None:
            for st in inner["state"].values():
                st["step"] = step.clone() if torch.is_tensor(step) else step
        if self.coalesced:
            self._load_per_param(inner)
        else:
            self.optimizer.load_state_dict(inner)
        if self.has_masters:
            with torch.no_grad():
                for mg, loaded in zip(self.master_groups, state["fp32_from_fp16_params"]):
                    for m, t in zip(mg, loaded):
                        m.copy_(t)
                for p, m in self._pairs:
                    if m is not p:
                        p.data.copy_(m)

    def _load_per_param(self, inner: dict) -> None:
        """A per-parameter AdamW state (:meth:`_per_param_state`'s layout) copied into the runs' states."""
        self._init_state()
        with torch.no_grad():
            for i, st in inner["state"].items():
                e, (lo, n) = self._slots[int(i)]
                mine = self.optimizer.state[e.master]
                for k in ("exp_avg", "exp_avg_sq"):
                    mine[k][lo : lo + n].view(self._pairs[int(i)][0].shape).copy_(st[k])
                if "step" in st:
                    s = st["step"]
                    mine["step"].fill_(float(s.item() if torch.is_tensor(s) else s))
        for g, loaded in zip(self.optimizer.param_groups, inner["param_groups"]):
            g.update({k: v for k, v in loaded.items() if k != "params"})


# ---------------------------------------------------------------------- the distributed optimizer


def flat_range_blocks(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[lo, hi)`` of a C-contiguous tensor of ``shape`` as rectangular blocks.

    Returns ``(offset, block shape, flat start)`` in flat order; at most ``2 * ndim - 1`` blocks (a
    partial first row, whole rows, a partial last row, recursively). dist_checkpointing
    0.16 refuses ``flattened_range`` shards, but takes any number of rectangular ones.
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, last = lo // inner, (hi - 1) // inner
    if first == last:  # inside one row
        base = first * inner
        return [((first, *o), (1, *s), f + base) for o, s, f in flat_range_blocks(shape[1:], lo - base, hi - base)]
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    if lo % inner:
        out += flat_range_blocks(shape, lo, (first + 1) * inner)
        first += 1
    end_row = hi // inner
    if end_row > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (end_row - first, *shape[1:]), first * inner))
    if hi % inner:
        out += flat_range_blocks(shape, end_row * inner, hi)
    return out


class _Shard:
    """This rank's slice ``[lo, hi)`` of one parameter (flattened), with its views and fp32 master."""

    def __init__(self, index: int, param: torch.nn.Parameter, lo: int, hi: int):
        self.index, self.param, self.lo, self.hi = index, param, lo, hi
        self.model = param.detach().view(-1)[lo:hi]  # a view into DDP's parameter buffer
        self.grad = param.main_grad.view(-1)[lo:hi]  # type: ignore[attr-defined]  # DDP's reduce-scattered slice
        self.master = self.model if param.dtype == torch.float32 else self.model.clone().float()
        self.tp_duplicate = _is_tp_duplicate(param)


class DistributedAdamW:
    """The same AdamW as :class:`MixedPrecisionAdamW`, each data-parallel rank updating only its shard.

    megatron-core DDP built with ``use_distributed_optimizer=True`` gives every rank
    a contiguous slice of each gradient bucket: ``finish_grad_sync`` reduce-scatters
    the gradients into it, and ``start_param_sync`` all-gathers the parameter
    buffer afterwards. This optimizer keeps fp32 masters and Adam moments only for
    the parameters (or parts of them) inside this rank's slices: 12 bytes a
    parameter become ``12 / dp``, as with megatron-core's ``DistributedOptimizer``.
    A mixture of experts split over ``ep`` expert-parallel ranks has its experts' buffers sharded over
    the expert data-parallel ranks (``dp / ep``), as megatron-core DDP reduce-scatters them: an expert
    parameter's 12 bytes become ``12 / (dp / ep)`` on each of the ``ep``-th of the ranks that hold it.
    That class itself cannot run here: it accepts only ``torch.cuda.*Tensor``
    parameters (optimizer/distrib_optimizer.py) and allocates on ``device='cuda'``
    (optimizer.py, clip_grads.py), so it would leave the CPU tests blind; this one
    is the same algorithm, on CPU (gloo) and GPU (NCCL).

    Checkpoints hold the optimizer in model space, exactly as
    :class:`MixedPrecisionAdamW` writes it (``optimizer.state.exp_avg.<param key>``
    ..., and ``optimizer.state.fp32_param.<param key>`` for bf16): each rank writes
    its shards as rectangular blocks of those tensors. A checkpoint therefore
    resumes with or without the distributed optimizer and on any data-parallel or
    tensor-parallel size, like the model.
    """

    def __init__(
        self,
        model: Any,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        fused: bool | None = None,
    ):
        from megatron.core import parallel_state

        if not model.ddp_config.use_distributed_optimizer:
            raise ValueError("DistributedAdamW needs megatron-core DDP with use_distributed_optimizer=True")
        self.model = model
        self.overlap_param_gather = bool(model.ddp_config.overlap_param_gather)
        self.clip_grad = clip_grad
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for _name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if p.dim() < 2 else decay).append(p)
        # the canonical order (MixedPrecisionAdamW's): checkpoints index the state by it
        self.model_groups = [g for g in (decay, no_decay) if g]
        self.params = [p for g in self.model_groups for p in g]
        index = {id(p): i for i, p in enumerate(self.params)}
        wds = [weight_decay, 0.0] if (decay and no_decay) else ([weight_decay] if decay else [0.0])

        # this rank's slice of every bucket, intersected with the parameters in it. A buffer is sharded over its
        # own group: the dense weights' over the data-parallel ranks, a mixture of experts' over the expert
        # data-parallel ones (the ranks holding the same experts: dp / ep of them), as megatron-core's DDP
        # reduce-scatters them
        owned: dict[int, tuple[int, int]] = {}
        for buffer in model.buffers + model.expert_parallel_buffers:
            size_of, rank = buffer.data_parallel_world_size, buffer.data_parallel_group.rank()
            for bucket in buffer.buckets:
                size = bucket.grad_data.numel() // size_of
                s_lo = bucket.offset + rank * size
                s_hi = s_lo + size
                for p in bucket.params_list:
                    start, end, _ = buffer.param_index_map[p]
                    lo, hi = max(start, s_lo), min(end, s_hi)
                    if lo < hi:
                        owned[index[id(p)]] = (lo - start, hi - start)
        self._setup([_Shard(i, self.params[i], *owned[i]) for i in sorted(owned)], wds, lr, betas, eps, fused)

    def _setup(
        self, shards: list[Any], wds: list[float], lr: float, betas: Any, eps: float, fused: bool | None
    ) -> None:
        """The torch AdamW over this rank's shards (``model_groups`` and ``params`` set)."""
        self.shards = shards
        self.has_masters = any(s.master is not s.model for s in self.shards) or any(
            p.dtype != torch.float32 for p in self.params
        )
        group_of = {id(p): g for g, ps in enumerate(self.model_groups) for p in ps}
        groups = [
            {"params": [s.master for s in self.shards if group_of[id(s.param)] == g], "weight_decay": wd}
            for g, wd in enumerate(wds)
        ]
        device = self.params[0].device
        if fused is None:
            fused = device.type == "cuda"
        self.device = device
        # torch refuses an optimizer without parameters: a rank whose slices hold none keeps a placeholder
        self._placeholder = torch.zeros(1, device=device)
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]] or [{"params": [self._placeholder], "weight_decay": 0.0}],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self._norm_mask = [not s.tp_duplicate for s in self.shards]
        self._wds = wds
        self.numel = sum(s.hi - s.lo for s in self.shards)  # parameters whose Adam states this rank holds

    # ------------------------------------------------------------------ step

    def step(self, lr: float) -> torch.Tensor:
        """Clip and apply this rank's reduce-scattered gradients, then all-gather the weights; return the norm."""
        grads = []
        for s in self.shards:
            s.master.grad = s.grad if s.grad.dtype == torch.float32 else s.grad.float()
            grads.append(s.master.grad)
        norm_grads = [g for g, keep in zip(grads, self._norm_mask) if keep]
        sq = (
            torch.stack(torch._foreach_norm(norm_grads)).square().sum()
            if norm_grads
            else torch.zeros((), device=self.device)
        )
        # over the data-parallel ranks: each dense element is in one rank's slice, and each expert element in
        # one slice of the expert data-parallel ranks that hold its expert (their groups partition the
        # data-parallel ranks, one a set of experts): one sum counts every element of the model once
        if self.dp_size > 1:
            torch.distributed.all_reduce(sq, group=self.dp_group)
        _sum_over_model_parallel(sq)
        norm = sq.sqrt()
        if self.clip_grad > 0 and grads:
            coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.shards:
            self.optimizer.step()
        copies = [(s.model, s.master) for s in self.shards if s.master is not s.model]
        if copies:
            torch._foreach_copy_([m for m, _ in copies], [f for _, f in copies])
        for s in self.shards:
            s.master.grad = None
        if not self.overlap_param_gather:
            self.model.start_param_sync(force_sync=True)  # every rank's updated slices to every rank
        # else megatron-core DDP's forward pre-hooks gather each bucket just before the next forward uses it,
        # the next bucket's all-gather overlapping this one's compute
        return norm

    def sync_params(self) -> None:
        """The updated weights on every rank now (before a checkpoint reads them outside a forward pass)."""
        if self.overlap_param_gather:
            self.model.start_param_sync(force_sync=True)

    # ------------------------------------------------------------------ checkpoints

    def _init_state(self) -> None:
        fused = bool(self.optimizer.defaults.get("fused"))
        for s in self.shards:
            st = self.optimizer.state[s.master]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=s.master.device if fused else "cpu")
                st["exp_avg"] = torch.zeros_like(s.master)
                st["exp_avg_sq"] = torch.zeros_like(s.master)

    def _id_map(self, model_sharded_state_dict: dict) -> dict[int, Any]:
        """Parameter index -> its ShardedTensor (or ShardedTensorFactory) in the model's sharded state dict."""
        from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

        return get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)

    def _blocks(self, model_sharded_state_dict: dict) -> dict[int, list[tuple[Any, int, int]]]:
        """Per shard: (ShardedTensor template, start, end) of each rectangular block, start/end in the shard."""
        id_map = self._id_map(model_sharded_state_dict)
        return {s.index: range_blocks(id_map[s.index], s.param, s.lo, s.hi) for s in self.shards}

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        if is_loading:
            self._init_state()
        blocks = self._blocks(model_sharded_state_dict)
        self._loading_blocks = blocks
        step = None
        state: dict[Any, Any] = {}
        masters: dict[int, dict[int, dict[int, Any]]] = {}
        group_of = {id(p): g for g, ps in enumerate(self.model_groups) for p in ps}
        for s in self.shards:
            st = self.optimizer.state[s.master]
            step = st.get("step", step)
            entry: dict[str, dict[int, Any]] = {}
            for name in ("exp_avg", "exp_avg_sq"):
                if name in st:
                    entry[name] = {
                        j: _with_data(t, f"optimizer.state.{name}", st[name][a:b])
                        for j, (t, a, b) in enumerate(blocks[s.index])
                    }
            state[s.index] = entry
            if self.has_masters:
                masters.setdefault(group_of[id(s.param)], {})[s.index] = {
                    j: _with_data(t, "optimizer.state.fp32_param", s.master[a:b])
                    for j, (t, a, b) in enumerate(blocks[s.index])
                }
        if step is None:  # a rank without shards: every rank has taken the same number of steps
            step = torch.zeros((), dtype=torch.float32)
        state["common_step"] = _cpu(step)
        inner = {"state": state, "param_groups": self._canonical_param_groups()}
        if not self.has_masters:
            return inner
        return {"optimizer": inner, "fp32_from_fp16_params": masters}

    def _canonical_param_groups(self) -> list[dict[str, Any]]:
        """torch's param_groups as MixedPrecisionAdamW saves them (its parameter indices), for either to load."""
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        hyper = {k: v for k, v in self.optimizer.param_groups[0].items() if k not in ("params", "weight_decay")}
        out, n = [], 0
        for g, wd in zip(self.model_groups, self._wds):
            # as optim_state_to_sharding_state has it: the indices are not saved, each loader has its own
            params = LocalNonpersistentObject(list(range(n, n + len(g))))
            out.append({**hyper, "weight_decay": wd, "params": params})
            n += len(g)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Put the loaded blocks (requested by ``sharded_state_dict(..., is_loading=True)``) into the shards."""
        blocks = self._loading_blocks
        inner = state["optimizer"] if self.has_masters else state
        step = inner["state"].get("common_step")
        group_of = {id(p): g for g, ps in enumerate(self.model_groups) for p in ps}
        with torch.no_grad():
            for s in self.shards:
                st = self.optimizer.state[s.master]
                for name in ("exp_avg", "exp_avg_sq"):
                    for j, (_, a, b) in enumerate(blocks[s.index]):
                        st[name][a:b].copy_(inner["state"][s.index][name][j].reshape(-1))
                if step is not None:
                    st["step"].copy_(step)
                if self.has_masters:
                    loaded = state["fp32_from_fp16_params"][group_of[id(s.param)]][s.index]
                    for j, (_, a, b) in enumerate(blocks[s.index]):
                        s.master[a:b].copy_(loaded[j].reshape(-1))
                    if s.master is not s.model:
                        s.model.copy_(s.master)


def range_blocks(sh: Any, param: Any, lo: int, hi: int) -> list[tuple[Any, int, int]]:
    """The flat range ``[lo, hi)`` of ``param`` as (ShardedTensor template, start, end) blocks, start/end in the range.

    ``sh`` is the parameter's entry in the model's sharded state dict: a
    ShardedTensor, or a ShardedTensorFactory (the SwiGLU fc1 weight, saved as
    two halves at different global offsets): the factory is built on a tensor of
    flat indices to learn which part of the parameter each of its ShardedTensors holds.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    parts: list[tuple[Any, int]] = []  # (ShardedTensor of a contiguous part of the parameter, its flat start)
    if isinstance(sh, ShardedTensorFactory):
        n = param.numel()
        idx = torch.arange(n, dtype=torch.int64 if n >= 2**31 else torch.int32).view(tuple(param.shape))
        for part in nested_values(sh.build_fn(sh.key, idx, sh.replica_id, None)):
            flat = part.data.reshape(-1)
            start = int(flat[0])
            if not torch.equal(flat, torch.arange(start, start + flat.numel(), dtype=flat.dtype)):
                raise NotImplementedError(f"{sh.key}: a checkpoint factory whose parts are not contiguous")
            parts.append((part, start))
    else:
        parts.append((sh, 0))
    blocks = []
    for part, start in parts:
        a_lo, a_hi = max(lo, start), min(hi, start + part.data.numel())
        for off, shape, flat in flat_range_blocks(tuple(part.local_shape), a_lo - start, a_hi - start):
            a = flat + start - lo
            blocks.append((_block_of(part, off, shape), a, a + _numel(shape)))
    return blocks


def _block_of(part: Any, offset: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """The ShardedTensor of a block at ``offset`` (within ``part``'s local tensor) of ``shape`` (no data yet)."""
    from dataclasses import replace

    pre = part.prepend_axis_num
    glob = tuple(part.global_offset[:pre]) + tuple(o + part.global_offset[pre + i] for i, o in enumerate(offset))
    rid = part.replica_id
    # every data-parallel rank holds other blocks: none is a replica of another (megatron's convention: the
    # last replica coordinate is the data-parallel one)
    rid = (*rid[:-1], 0) if isinstance(rid, tuple) else 0
    # prepended axes (a layer's index in the stacked ``decoder.layers.*`` tensors) become leading axes of size 1:
    # dist_checkpointing's path for irregular shards takes the local shape as the whole chunk
    return replace(
        part,
        data=None,
        local_shape=(1,) * pre + tuple(shape),
        global_offset=glob,
        axis_fragmentations=None,
        replica_id=rid,
        prepend_axis_num=0,
    )


def _with_data(block: Any, prefix: str, flat: torch.Tensor) -> Any:
    from dataclasses import replace

    t = replace(
        block, key=f"{prefix}.{block.key}" if prefix else block.key, data=flat.view(block.local_shape), dtype=flat.dtype
    )
    t.validate_metadata_integrity()
    return t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _cpu(step: Any) -> Any:
    """Adam's step count as saved in the common (rank 0) state: one CPU value, so every rank's compares equal
    (megatron-core's checkpoint check warned "common state dict differs" for each rank's cuda:N copy)."""
    return step.detach().to("cpu") if torch.is_tensor(step) else step
