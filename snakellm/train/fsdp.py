"""Parameters, gradients and optimizer states sharded over the data-parallel ranks (``parallel.fsdp``).

PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, the maintained ZeRO-3
path torchtitan trains Llama 3 with) around megatron-core's ``GPTModel``: every
transformer layer, the embedding and the output layer is one FSDP unit whose
bf16 weights are all-gathered just before it runs (the next unit's gather
overlaps this one's compute) and freed after it; the gradients are
reduce-scattered in fp32 as each unit's backward ends. Each rank keeps only its
``1 / dp`` row slice of every parameter as an fp32 master, the fp32 gradient of
that slice and its Adam moments: 16 bytes a parameter become ``16 / dp``
(Llama 3.1 8B on 4 GPUs: 32 GB a GPU, against 80 GB for the distributed optimizer).

Why not megatron-core's own Megatron-FSDP (``use_megatron_fsdp``): in 0.16.1 its
adapter imports Transformer Engine's linear class, its buffers and streams are
created on ``device="cuda"``, it needs megatron-core's ``DistributedOptimizer``
(CUDA tensors only) and its checkpoints use another layout (``fsdp_dtensor``): no
CPU test could see it, and the checkpoints would change.

Checkpoints keep the layout of every other run: the model and the optimizer
states in model space under the same keys (``optimizer.state.exp_avg.<key>``,
``optimizer.state.fp32_param.<key>`` for bf16 ...), each rank writing its row
slices as rectangular blocks of those tensors, exactly as
:class:`snakellm.train.optim.DistributedAdamW` does for its flat slices. A
checkpoint written with FSDP on 4 ranks resumes on 2, or without FSDP, and the
other way round.

Tensor parallelism composes (FSDP shards each rank's tensor-parallel slice over
its data-parallel group); with sequence parallelism the norms' gradient slices
are summed over the tensor-parallel group after the backward pass, as
megatron-core's ``finalize_model_grads`` does for its own buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import replace
from typing import Any

import torch

from snakellm.train.optim import DistributedAdamW, _is_tp_duplicate, _with_data, range_blocks


class FSDPModel:
    """What the trainer, the validator and the optimizer need of a model, over an FSDP2-sharded GPTModel."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        template: dict[str, Any],
        info: dict[str, dict[str, Any]],
        bf16: bool,
        fp8_all_gather: bool = False,
    ):
        from megatron.core import parallel_state as ps

        self.module = module
        self.fp8_all_gather = fp8_all_gather  # the block linears' weights gathered in float8 (their scales kept)
        self.template = template  # the model's sharded state dict before sharding (keys, TP layout)
        self.info = info  # parameter name -> what FSDP's parameters lost: tp_duplicate, sequence_parallel, entry
        self.bf16 = bf16
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.sp_names = [n for n, i in info.items() if i["sequence_parallel"]]

    # the trainer's model interface (megatron-core DDP's)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> FSDPModel:
        # validation's forward passes (no backward) leave the units that keep their weights gathered after
        # the forward as they are: back to the shards, or the next backward would miss their reduce-scatter
        self.reshard()
        self.module.train(mode)
        return self

    def eval(self) -> FSDPModel:
        return self.train(False)

    def named_parameters(self) -> Any:
        return self.module.named_parameters()

    def parameters(self) -> Any:
        return self.module.parameters()

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        # every micro-batch's gradients are reduce-scattered as its backward runs: holding them unsharded
        # until the last one would cost the 4 bytes a parameter FSDP exists to save
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        """Sequence parallelism: each tensor-parallel rank saw other tokens, so the norms' gradients are summed."""
        if self.tp_size == 1 or not self.sp_names:
            return
        params = dict(self.module.named_parameters())
        grads = [_local(params[n].grad) for n in self.sp_names if params[n].grad is not None]
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            torch.distributed.all_reduce(flat, group=self.tp_group)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Nothing to gather after a step: FSDP gathers each unit's weights when it runs (in float8: with the
        scales of the updated weights, computed here)."""
        self.refresh_fp8_scales()

    def refresh_fp8_scales(self) -> None:
        if self.fp8_all_gather:
            from snakellm.models import fp8

            fp8.precompute_all_gather_scales(self.module)

    # checkpoints: the model part, in the layout of every other run

    def reshard(self) -> None:
        """Back to the sharded parameters (a forward without backward leaves units with
        ``reshard_after_forward=False`` gathered, e.g. after validation)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def row_range(self, name: str, p: Any) -> tuple[int, int]:
        """This rank's slice of parameter ``name`` as a flat range of its (tensor-parallel) tensor."""
        local = _local(p)
        rows = p.shape[0] if p.dim() else 1
        chunk = -(-rows // self.dp_size)
        inner = p.numel() // max(rows, 1)
        lo = min(self.dp_rank * chunk, rows) * inner
        if local.numel() != max(0, min(chunk * inner, p.numel() - lo)):
            raise RuntimeError(
                f"FSDP parameter {name}: local slice {tuple(local.shape)} is not rows of {tuple(p.shape)}"
            )
        return lo, lo + local.numel()

    def sharded_state(self) -> dict[str, Any]:
        """The model's sharded state dict: this rank's row slices as blocks of the usual ShardedTensors."""
        self.reshard()
        params = dict(self.module.named_parameters())
        out: dict[str, Any] = {}
        self._loading: dict[str, list[tuple[int, int]]] = {}
        for name, p in params.items():
            lo, hi = self.row_range(name, p)
            if lo >= hi:
                continue
            local = _local(p).detach().reshape(-1)
            blocks = range_blocks(self.info[name]["entry"], p, lo, hi)
            dtype = torch.bfloat16 if self.bf16 else local.dtype
            out[name] = {
                j: _with_data(t, "", local[a:b].to(dtype) if dtype != local.dtype else local[a:b])
                for j, (t, a, b) in enumerate(blocks)
            }
            self._loading[name] = [(a, b) for _, a, b in blocks]
        # what is not a parameter (megatron's ``_extra_state`` objects) is saved as the model has it
        for key, entry in self.template["others"].items():
            out[key] = entry
        return out

    def whole_state(self) -> dict[str, Any]:
        """The model's sharded state dict as an unsharded run's: each weight gathered whole (one at a time, kept
        in host memory), under its usual entry; what a fine-tune's ``model/`` artifact writes, so that its files
        are those of a run without FSDP (collective: every data-parallel rank calls it)."""
        self.reshard()
        out: dict[str, Any] = {}
        for name, p in self.module.named_parameters():
            whole = _full(p)
            whole = whole.detach().to(torch.bfloat16 if self.bf16 else whole.dtype).cpu()
            out[name] = replace(self.info[name]["entry"], data=whole)
        for key, entry in self.template["others"].items():
            out[key] = entry
        return out

    def load_state(self, loaded: dict[str, Any]) -> None:
        self.reshard()
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, ranges in self._loading.items():
                local = _local(params[name]).reshape(-1)
                for j, (a, b) in enumerate(ranges):
                    local[a:b].copy_(loaded[name][j].reshape(-1))
        self.refresh_fp8_scales()

    def digest(self) -> str:
        """sha256 of the whole model (every rank's slices, gathered): one value on every rank."""
        self.reshard()
        h = hashlib.sha256()
        for name, p in sorted(self.module.named_parameters()):
            h.update(name.encode())
            h.update(_local(p).detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        parts: list[Any] = [None] * self.dp_size
        torch.distributed.all_gather_object(parts, h.hexdigest(), group=self.dp_group)
        return hashlib.sha256("".join(parts).encode()).hexdigest()[:16]


def _local(t: Any) -> Any:
    """The local tensor of a DTensor (FSDP's sharded parameters and gradients), or the tensor itself; under
    the float8 all-gather, the fp32 master inside torchao's wrapper (the optimizer and checkpoints see it)."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t._tensor if type(t).__name__ == "WeightWithDynamicFloat8CastTensor" else t


def _full(p: Any) -> Any:
    """The whole parameter (its shards gathered; collective), as a plain tensor."""
    if not hasattr(p, "full_tensor"):
        return p
    if _local(p) is p._local_tensor:
        return p.full_tensor()
    from torch.distributed.tensor import DTensor  # torchao's float8 wrapper: gather the fp32 masters inside it

    return DTensor.from_local(_local(p), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()


def shard(
    module: torch.nn.Module,
    *,
    bf16: bool,
    cuda: bool,
    reshard_after_forward: bool = True,
    fp8_all_gather: bool = False,
    reduce_bf16: bool = False,
) -> FSDPModel:
    """Shard ``module`` (a megatron-core GPTModel, the same weights on every data-parallel rank) with FSDP2;
    ``fp8_all_gather``: its float8 block linears' weights are gathered in float8 (:func:`fp8.float8_all_gather`);
    ``reduce_bf16``: gradients are reduce-scattered in bf16 (FSDP then accumulates them into the fp32 shards)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # what FSDP's new parameters will not carry: megatron's attributes and the checkpoint entries
    names = {id(p): n for n, p in module.named_parameters()}
    entries: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for key, entry in module.sharded_state_dict().items():  # type: ignore[operator]
        pid = id(entry.data) if isinstance(entry, ShardedTensor | ShardedTensorFactory) else None
        if pid in names:
            # shapes only: a reference to the parameter would keep the whole unsharded model alive
            entries[names[pid]] = replace(entry, data=torch.empty_like(entry.data, device="meta"))
        else:
            others[key] = entry
    info = {
        n: {
            "tp_duplicate": _is_tp_duplicate(p),
            "sequence_parallel": bool(getattr(p, "sequence_parallel", False)),
            "entry": entries[n],
        }
        for n, p in module.named_parameters()
    }
    dp_group = ps.get_data_parallel_group()
    src = torch.distributed.get_global_rank(dp_group, 0)
    with torch.no_grad():
        for p in module.parameters():  # one model on every data-parallel rank, whatever happened at init
            torch.distributed.broadcast(p.data, src=src, group=dp_group)
    if bf16:
        # the sharded parameters are the fp32 masters; FSDP casts the gathered copies to bf16 for compute
        module.float()
    if fp8_all_gather:
        from snakellm.models import fp8

        if not fp8.float8_all_gather(module):
            raise fp8.FP8Error("fp8_all_gather (--fp8-all-gather): the model has no float8 block linears")
    mesh = DeviceMesh.from_group(dp_group, "cuda" if cuda else "cpu")
    reduce = torch.bfloat16 if reduce_bf16 else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if bf16 else None
    kw: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    gpt: Any = module
    layers = list(gpt.decoder.layers)
    for i, layer in enumerate(layers):
        # the last layer's weights are needed again first in the backward: keep them gathered
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kw)
    if not gpt.share_embeddings_and_output_weights:
        fully_shard(gpt.embedding, **kw)
        fully_shard(gpt.output_layer, reshard_after_forward=False, **kw)
    fully_shard(module, **kw)  # the rest (final norm; tied embeddings)
    model = FSDPModel(module, template={"others": others}, info=info, bf16=bf16, fp8_all_gather=fp8_all_gather)
    model.refresh_fp8_scales()
    return model


class _FSDPShard:
    """This rank's row slice of one FSDP parameter (its fp32 master: FSDP's own local tensor)."""

    def __init__(self, index: int, param: Any, lo: int, hi: int, tp_duplicate: bool):
        self.index, self.param, self.lo, self.hi = index, param, lo, hi
        self.master = self.model = _local(param).data.view(-1)
        self.tp_duplicate = tp_duplicate

    @property
    def grad(self) -> Any:
        g = self.param.grad
        return torch.zeros_like(self.master) if g is None else _local(g).view(-1)


class FSDPAdamW(DistributedAdamW):
    """:class:`DistributedAdamW` over FSDP's row slices: same update, norm, clipping and checkpoint layout."""

    def __init__(
        self,
        model: FSDPModel,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        clip_grad: float,
        fused: bool | None = None,
    ):
        self.model = model
        self.overlap_param_gather = False  # FSDP gathers each unit's weights itself, overlapped
        self.clip_grad = clip_grad
        self.dp_group, self.dp_size = model.dp_group, model.dp_size
        named = list(model.named_parameters())
        decay = [(n, p) for n, p in named if p.requires_grad and p.dim() >= 2]
        no_decay = [(n, p) for n, p in named if p.requires_grad and p.dim() < 2]
        self.model_groups = [[p for _, p in g] for g in (decay, no_decay) if g]
        self.names = [n for g in (decay, no_decay) for n, _ in g]
        self.params = [p for g in self.model_groups for p in g]
        wds = [weight_decay, 0.0] if (decay and no_decay) else ([weight_decay] if decay else [0.0])
        shards = []
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            lo, hi = model.row_range(n, p)
            if lo < hi:
                shards.append(_FSDPShard(i, p, lo, hi, model.info[n]["tp_duplicate"]))
        self._setup(shards, wds, lr, betas, eps, fused)
        self.has_masters = model.bf16  # the checkpoint of a bf16 model holds fp32 masters, as every other run's

    def _id_map(self, model_sharded_state_dict: dict) -> dict[int, Any]:
        return {i: self.model.info[n]["entry"] for i, n in enumerate(self.names)}

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        out = super().sharded_state_dict(model_sharded_state_dict, is_loading)
        if is_loading and self.has_masters:
            # FSDP's sharded parameters are the fp32 masters themselves, and the model's bf16 part is put into
            # them before the optimizer's: loaded in place, the saved masters would be overwritten by their bf16
            # rounding (a bf16 FSDP run resumed with rounded masters: its losses parted from the second step)
            for group in out["fp32_from_fp16_params"].values():
                for blocks in group.values():
                    for j, entry in blocks.items():
                        blocks[j] = replace(entry, data=torch.empty_like(entry.data))
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        # the fp32 masters replaced the model's bf16 weights: the float8 scales follow them
        self.model.refresh_fp8_scales()
