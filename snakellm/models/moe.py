"""Mixture of experts on megatron-core's own MoE layer: its settings, counts and grouped experts.

A MoE model is a family whose architecture has ``num_experts`` (``snakellm/models/families/
mixtral.py``, ``qwen3_moe.py``): every layer's MLP is megatron-core's ``MoELayer`` (the local
spec's ``get_gpt_layer_local_spec(num_experts=...)``), with

* its ``TopKRouter``: softmax or sigmoid scores, top-k, renormalised or not
  (``moe_norm_topk_prob``: megatron-core's softmax over the top-k logits; without it, the
  softmax over all experts, then the top k, ``moe_router_pre_softmax``), the load-balancing
  auxiliary loss and the z-loss at the model's coefficients;
* the ``alltoall`` token dispatcher (expert parallelism over ``parallel.ep`` ranks); at tp > 1 each
  expert split over the tensor-parallel ranks, with sequence parallelism (:func:`check_tp`);
* ``SequentialMLP`` experts, dropless (no capacity factor). megatron-core's grouped experts
  without Transformer Engine are the legacy ``GroupedMLP``, which needs the ``grouped_gemm``
  package (a CUDA source build, no wheel); ``TEGroupedMLP`` needs Transformer Engine, whose
  layer spec is used where it imports.

Torch-free to import: the config checks and ``snakellm plan`` use the counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def is_moe(arch: dict[str, Any]) -> bool:
    return bool(arch.get("num_experts"))


def moe_refuses(arch: dict[str, Any], hf_class: str, *, norm_topk: bool | None) -> str | None:
    """Why ``hf_class``'s router (softmax; top-k renormalised if ``norm_topk``, either if None) is not this one."""
    if arch["moe_score_function"] != "softmax":
        return f"moe_score_function {arch['moe_score_function']}: {hf_class} routes by softmax"
    if norm_topk is not None and bool(arch["moe_norm_topk_prob"]) != norm_topk:
        return f"moe_norm_topk_prob {arch['moe_norm_topk_prob']}: {hf_class} has {norm_topk}"
    return None  # the load-balancing and z-losses are training losses: the exported model computes the same


def megatron_config(arch: dict[str, Any], ep: int = 1) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` arguments of the MoE layers ({} for a dense model)."""
    if not is_moe(arch):
        return {}
    aux, z = float(arch["moe_aux_loss_coeff"]), float(arch["moe_z_loss_coeff"])
    return dict(
        num_moe_experts=arch["num_experts"],
        moe_ffn_hidden_size=arch["moe_ffn_hidden_size"],
        moe_router_topk=arch["moe_router_topk"],
        moe_router_score_function=arch["moe_score_function"],
        # softmax: renormalised top-k = softmax over the top-k logits; else softmax first, then the top k
        moe_router_pre_softmax=arch["moe_score_function"] == "softmax" and not arch["moe_norm_topk_prob"],
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=z if z > 0 else None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
    )


def expert_params(arch: dict[str, Any]) -> int:
    """Parameters of one layer's experts (all of them) and of one expert."""
    h, f = arch["hidden_size"], arch["moe_ffn_hidden_size"]
    gated = arch["activation"] == "swiglu"
    return h * f * (3 if gated else 2)


def mlp_params(arch: dict[str, Any], active: bool = False) -> int:
    """One layer's MoE MLP: the router and every expert (``active``: the top-k experts a token uses)."""
    n = arch["moe_router_topk"] if active else arch["num_experts"]
    return arch["num_experts"] * arch["hidden_size"] + n * expert_params(arch)


def check_ep(arch: dict[str, Any], ep: int, world: int | None = None, tp: int = 1, pp: int = 1) -> str | None:
    """Why ``ep`` expert-parallel ranks cannot hold this model (None: they can)."""
    if ep < 1:
        return f"ep must be >= 1, got {ep}"
    if ep > 1 and not is_moe(arch):
        return f"ep {ep}: expert parallelism needs a mixture-of-experts model (num_experts)"
    if is_moe(arch) and arch["num_experts"] % ep:
        return f"num_experts {arch['num_experts']} is not divisible by ep {ep}"
    if world is not None and world % (tp * pp) == 0 and (world // (tp * pp)) % ep:
        return (
            f"ep {ep} must divide the data-parallel size (world {world} / (tp {tp} x pp {pp}) = "
            f"{world // (tp * pp)}): the expert-parallel ranks are data-parallel ranks of the dense layers"
        )
    return None


def check_tp(
    arch: dict[str, Any], tp: int, sequence_parallel: bool | None, name: Callable[[str], str] = str
) -> str | None:
    """Why this model cannot train at ``tp`` tensor-parallel ranks with ``sequence_parallel`` (None: it can;
    ``sequence_parallel`` None: the step has none, fine-tuning), the settings named by ``name``.

    megatron-core (without Transformer Engine too) splits each expert over the tensor-parallel ranks
    (``expert_tensor_parallel_size`` = tp) and trains a MoE layer at tp > 1 only with the sequence split
    over them: its ``MoELayer`` raises in the first training forward otherwise."""
    if tp == 1 or not is_moe(arch) or sequence_parallel:
        return None
    why = (
        f"a mixture-of-experts model at {name('tp')} {tp} needs sequence parallelism: megatron-core's MoE layer "
        "trains at tp > 1 only with the sequence split over the tensor-parallel ranks"
    )
    if sequence_parallel is None:
        return f"{why}, which this step does not run: use {name('tp')} 1"
    return f"{why}: set {name('sequence_parallel')}"


def scale_aux_losses(scale: float) -> None:
    """The factor megatron-core's MoE auxiliary losses' gradients get (``MoEAuxLossAutoScaler``): 1 / micro-batches
    in a step, as megatron-core's own schedules set it (a no-op for a dense model)."""
    import sys

    if "megatron.core.transformer.moe.moe_utils" not in sys.modules:
        return
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))


# ----------------------------------------------------------------------------- grouped experts (no TE)


def grouped_usable(config: Any) -> str | None:
    """Why :class:`GroupedExperts` cannot run these experts (None: it can), megatron-core's loop then runs them."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return "torch has no _grouped_mm"
    if config.add_bias_linear or not config.gated_linear_unit:
        return "experts with biases or without a gated MLP"
    if config.fp8 or getattr(config, "fp4", None) or config.moe_apply_probs_on_input:
        return "fp8/fp4 experts or probabilities applied on the input"
    if config.expert_tensor_parallel_size not in (None, 1):
        return "expert tensor parallelism"
    return None


_VIEWS: dict[tuple[Any, ...], Any] = {}  # a list of tensors' shape, dtype and data pointers -> stacked_view of them


def _known_view(tensors: list[Any]) -> tuple[Any, bool] | None:
    """:func:`stacked_view`, remembered by the tensors' data pointers: its checks walk every tensor's storage
    (about 0.9 ms for 128 experts, in every layer's passes, while the GPU waits); the pointers alone are cheap."""
    import torch

    key = (tensors[0].shape, tensors[0].dtype, *map(torch.Tensor.data_ptr, tensors))
    if key not in _VIEWS:
        if len(_VIEWS) > 256:
            _VIEWS.clear()
        _VIEWS[key] = stacked_view(tensors)
    return _VIEWS[key]


def stacked(weights: list[Any]) -> Any:
    """``[E, out, in]`` over the experts' weights: a view when they are consecutive slices of one storage
    in expert order (:func:`pack_experts`), else a copy (torch.stack)."""
    import torch

    view = _known_view(weights)
    if view is not None and not view[1] and view[0].is_contiguous():
        return view[0]
    return torch.stack(weights)


def stacked_view(tensors: list[Any]) -> tuple[Any, bool] | None:
    """``tensors`` as one ``[E, ...]`` view of their common storage, when they lie at evenly spaced offsets
    of it without overlapping: (view, False) when the offsets rise in order, (view, True) when they fall
    (the view's row ``j`` is then ``tensors[E-1-j]``: megatron-core DDP lays a bucket's parameters out
    last first, each expert's fc1 and fc2 side by side); None otherwise."""
    first = tensors[0]
    n, base = first.numel(), first.untyped_storage().data_ptr()
    if not all(
        t.is_contiguous() and t.shape == first.shape and t.untyped_storage().data_ptr() == base for t in tensors
    ):
        return None
    offs = [t.storage_offset() for t in tensors]
    step = offs[1] - offs[0] if len(offs) > 1 else n
    if abs(step) < n or any(b - a != step for a, b in zip(offs, offs[1:])):
        return None
    lo = tensors[0] if step > 0 else tensors[-1]
    return lo.as_strided((len(tensors), *first.shape), (abs(step), *first.stride()), lo.storage_offset()), step < 0


def in_ddp_buffers(weights: Any) -> bool:
    """Whether megatron-core DDP gave every one of ``weights`` a ``main_grad`` in its gradient buffers."""
    return all(hasattr(w, "main_grad") and hasattr(w, "grad_added_to_main_grad") for w in weights)


def weight_grads(weights: tuple[Any, ...], x: Any, dy: Any, offs: Any) -> list[Any]:
    """The experts' weight gradients (``dy^T x`` per expert, a grouped matrix product) added into
    megatron-core DDP's ``main_grad`` buffers where DDP gave the weights one; what autograd then gets.

    Without it, autograd hands each of the E weights its gradient and DDP's hook adds it into the
    buffer: one kernel and one Python hook per expert and pass (2,048 a step for 8 layers of 128 experts).
    Here it is one add over the experts' slice of the buffer (a strided view: DDP lays a bucket out last
    parameter first, each expert's fc1 and fc2 side by side), or one copy where :func:`defer_expert_zeroing`
    left that slice unzeroed for the step's first pass. At one rank the dispatcher hands the tokens over
    last expert first (:func:`one_rank_dispatch`), the buffer's order; elsewhere the product runs over the
    tokens reversed for it (reversing the routed tokens is cheap, the gradients of all experts are not). A
    multi-tensor add serves where they are not evenly spaced. Like
    megatron-core's fused gradient accumulation, the weights are marked ``grad_added_to_main_grad`` (the
    hook then skips its add); autograd gets an empty placeholder where DDP overlaps its reduction (its
    hook must still fire, to mark the bucket ready), else nothing. Without ``main_grad`` (no DDP, or
    FSDP) the gradients go to autograd as they are. The routed tokens are exactly the counted ones
    (``offs[-1]`` rows, as megatron-core's dispatchers hand them over).
    """
    import torch

    def product(x: Any, dy: Any, offs: Any) -> Any:
        return torch._grouped_mm(dy.t(), x, offs=offs)  # [E, out, in]; experts with no tokens: zeros

    if not in_ddp_buffers(weights):
        return list(product(x, dy, offs).unbind(0))
    grads = [w.main_grad for w in weights]
    view = _known_view(grads)
    first = _take_unset(weights)  # the buffer holds last step's values: write, not add
    if view is None:
        parts = [g.to(grads[0].dtype) for g in product(x, dy, offs).unbind(0)]
        (torch._foreach_copy_ if first else torch._foreach_add_)(grads, parts)
    else:
        if view[1]:  # the buffer's order is the experts' last first: so are the tokens, reversed
            counts = torch.diff(offs, prepend=offs.new_zeros(1))
            x, dy, offs = x.flip(0), dy.flip(0), counts.flip(0).cumsum(0).to(offs.dtype)
        into_buffer(view[0], product(x, dy, offs), first)
    out: list[Any] = []
    for w in weights:
        w.grad_added_to_main_grad = True
        hook = getattr(w, "ddp_hook_needs_grad", False)  # set by the assembly where DDP overlaps its reduction
        out.append(torch.empty(w.shape, dtype=dy.dtype, device=dy.device) if hook else None)
    return out


def _take_unset(weights: Any) -> bool:
    """Whether the experts' part of DDP's buffer is unset this step (:func:`defer_expert_zeroing`: the first
    pass writes, not adds); it is set from then on. The mark is a host tensor, which a compiled layer's
    opaque :func:`buffer_ops` read at run time (a Python attribute would be a constant to Dynamo)."""
    unset = getattr(weights[0], "main_grad_unset", None)
    return unset is not None and _take_mark(unset)


def _take_mark(unset: Any) -> bool:
    """Whether the host tensor ``unset`` is set; it is cleared from then on."""
    if not bool(unset):
        return False
    unset.fill_(False)
    return True


@functools.cache
def buffer_ops() -> Any:
    """``snakellm::experts_linear``: the grouped experts' product (``y = x W_e^T`` per expert, as
    :func:`_grouped_linear_fn`) where DDP's buffers alone take the weights' gradients, as one operator
    opaque to ``torch.compile``, so a compiled layer runs it in its graph (no graph break, no eager
    autograd node). Its inputs are the experts' stacked weights ``w``, their stacked ``main_grad`` view
    ``grad`` of DDP's buffer and its ``unset`` mark (:func:`buffer_path`); its backward
    (``experts_linear_backward``) returns the input's gradient and writes (first pass of a step) or adds the
    weights' gradients into ``grad``, which no other operator of the graph reads: a side effect on a buffer
    outside the graph, as DDP's own hooks make."""
    import torch

    forward = "(Tensor x, Tensor offs, Tensor w, Tensor grad, Tensor unset) -> Tensor"

    @torch.library.custom_op("snakellm::experts_linear", mutates_args=(), schema=forward)
    def experts_linear(x: Any, offs: Any, w: Any, grad: Any, unset: Any) -> Any:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @experts_linear.register_fake
    def _(x: Any, offs: Any, w: Any, grad: Any, unset: Any) -> Any:
        return x.new_empty((x.shape[0], w.shape[1]))

    backward_schema = "(Tensor x, Tensor dy, Tensor offs, Tensor w, Tensor grad, Tensor unset) -> Tensor"

    @torch.library.custom_op("snakellm::experts_linear_backward", mutates_args=(), schema=backward_schema)
    def experts_linear_backward(x: Any, dy: Any, offs: Any, w: Any, grad: Any, unset: Any) -> Any:
        dy = dy.contiguous()
        into_buffer(grad, torch._grouped_mm(dy.t(), x, offs=offs), _take_mark(unset))  # [E, out, in]
        return torch._grouped_mm(dy, w, offs=offs)

    @experts_linear_backward.register_fake
    def _(x: Any, dy: Any, offs: Any, w: Any, grad: Any, unset: Any) -> Any:
        return dy.new_empty((dy.shape[0], w.shape[2]))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.rest = inputs[2:]  # not saved for autograd's version checks: the buffer and mark change each pass

    def backward(ctx: Any, dy: Any) -> Any:
        x, offs = ctx.saved_tensors
        return experts_linear_backward(x, dy, offs, *ctx.rest), None, None, None, None

    experts_linear.register_autograd(backward, setup_context=setup_context)
    return experts_linear


def buffer_path(experts: Any) -> dict[str, tuple[Any, Any, Any]] | None:
    """For grouped experts whose weights' gradients go only into DDP's buffers and are deferred
    (:func:`defer_expert_zeroing`): per ``linear_fc1``/``linear_fc2``, the stacked weights, the stacked
    ``main_grad`` view and the unset mark that :func:`buffer_ops` take, when both stack as views in the
    tokens' order (:func:`pack_experts`, DDP's buffer laid out last expert first: the gradients' view is
    strided, each expert's fc1 and fc2 side by side); else None."""
    buffer_ops()  # registered
    out = {}
    for name in ("linear_fc1", "linear_fc2"):
        weights = experts.in_token_order(name)
        if not grads_to_buffers_only_static(weights) or getattr(weights[0], "main_grad_unset", None) is None:
            return None
        w, g = stacked_view(weights), stacked_view([p.main_grad for p in weights])
        if w is None or g is None or w[1] or g[1] or not w[0].is_contiguous():
            return None
        out[name] = (w[0], _own_version(g[0]), weights[0].main_grad_unset)
    return out


def _own_version(view: Any) -> Any:
    """The same memory as ``view``, with a version counter of its own: a compiled layer saves the gradients'
    view for its backward, and autograd checks that no in-place operation changed a saved tensor since;
    every expert's gradients are views of one DDP buffer, whose shared counter every write moves."""
    import torch

    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def into_buffer(view: Any, product: Any, first: bool) -> None:
    """The experts' bf16 weight gradients ``product`` ``[E, out, in]`` written (``first``) or added into their
    fp32 ``main_grad`` ``view``, expert by expert: each expert's slice of DDP's buffer is contiguous, but the
    view over all of them is strided (each expert's fc1 and fc2 lie side by side), where one copy runs
    TensorIterator's element-wise kernel at about 1.8 TB/s (16 ms a step at Qwen3-30B-A3B's 8 layers on an
    H200); the multi-tensor copy over the experts' slices reads and writes with vector loads."""
    import torch

    dst, src = view.unbind(0), product.unbind(0)
    (torch._foreach_copy_ if first else torch._foreach_add_)(dst, src)


def permute_without_sync(
    tokens: Any,
    routing_map: Any,
    probs: Any = None,
    num_out_tokens: Any = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> tuple[Any, Any, Any]:
    """megatron-core's ``permute`` (the tokens sorted by expert, then by position; their probabilities; the
    sorting indices), the same values, without its two ``masked_select``s, each of which waits for the
    device to learn its output's size (two host synchronisations in every MoE layer's forward pass, after
    which the host's work on the layer is no longer hidden behind the device's). Where the routing map
    holds exactly ``num_out_tokens`` routed tokens (dropless top-k routing: every token ``k`` distinct
    experts) that size is known: ``nonzero_static``. Elsewhere megatron-core's own runs."""
    import torch

    if fused or drop_and_pad or not isinstance(num_out_tokens, int):
        from megatron.core.transformer.moe.moe_utils import permute

        return permute(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
    num_tokens = routing_map.shape[0]
    where = torch.nonzero_static(routing_map.bool().T, size=num_out_tokens)  # (expert, token), expert-major
    sorted_indices = where[:, 1]
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.T.reshape(-1).index_select(0, where[:, 0] * num_tokens + sorted_indices)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def trace_aux_losses(router: Any) -> bool:
    """megatron-core's ``TopKRouter`` with its load-balancing loss and z-loss bookkeeping in a form a
    compiled layer traces once for all layers; returns whether it applies (the ``aux_loss`` balancing type
    or none, a layer number).

    megatron-core's ``attach_and_log_load_balancing_loss`` and ``apply_z_loss`` save each layer's loss at
    ``values[layer_number - 1]`` of its aux-loss tracker; traced, the layer's number is a constant to
    Dynamo, which then compiles the layer once per layer. Here the same values go to the same tracker
    entries (made beforehand, as megatron-core makes them on a first call) at an index held by a tensor
    (``snakellm_slot``); the losses and their gradients are megatron-core's (``MoEAuxLossAutoScaler``'s, its
    scale an input: :func:`_aux_loss_scaler`)."""
    import types

    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    cfg = router.config
    if router.layer_number is None or cfg.moe_router_load_balancing_type not in ("aux_loss", "none"):
        return False
    if getattr(router, "snakellm_slot", None) is not None:
        return True
    device = router.weight.device
    tracker = get_moe_layer_wise_logging_tracker()
    layers = cfg.num_layers + (cfg.mtp_num_layers or 0)
    names = {"load_balancing_loss": router.tp_cp_group} if router.get_aux_loss_coeff("aux_loss") > 0 else {}
    if cfg.moe_z_loss_coeff is not None:
        names["z_loss"] = None
    for name, group in names.items():
        entry = tracker.setdefault(name, {})
        if "values" not in entry:
            entry["values"] = torch.zeros(layers, device=device)
        entry.update(reduce_group=group, avg_group=None, reduce_group_has_dp=False)
    if MoEAuxLossAutoScaler.main_loss_backward_scale is None:  # what its backward makes on a first call
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0, device=device)
    router.snakellm_aux_scale = MoEAuxLossAutoScaler.main_loss_backward_scale  # set_loss_scale copies into it
    router.snakellm_aux_scaler = _aux_loss_scaler()  # made here: a class made in a compiled layer breaks its graph
    router.snakellm_slot = torch.tensor([router.layer_number - 1], device=device)
    router.attach_and_log_load_balancing_loss = types.MethodType(_attach_aux_loss, router)
    router.apply_z_loss = types.MethodType(_apply_z_loss, router)
    return True


def _track(router: Any, name: str, loss: Any) -> None:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    values = get_moe_layer_wise_logging_tracker()[name]["values"]
    values.index_add_(0, router.snakellm_slot, loss.detach().reshape(1).to(values.dtype))


@functools.cache
def _aux_loss_scaler() -> Any:
    import torch

    class AuxLossScaler(torch.autograd.Function):
        """megatron-core's ``MoEAuxLossAutoScaler`` (the output as it is; the auxiliary loss's gradient the
        main loss's backward scale) with that scale an input: megatron-core's backward reads it from a class
        attribute, which Dynamo does not trace (a graph break in every compiled layer, which then fell apart
        into nine compiled regions)."""

        @staticmethod
        def forward(ctx: Any, output: Any, aux_loss: Any, scale: Any) -> Any:
            ctx.save_for_backward(aux_loss, scale)
            return output

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            aux_loss, scale = ctx.saved_tensors
            return grad_output, torch.ones_like(aux_loss) * scale, None

    return AuxLossScaler


def _scaled(router: Any, activation: Any, aux_loss: Any) -> Any:
    """(megatron-core's class attribute, read by Dynamo from the router: as the class's it is no tensor to it)"""
    return router.snakellm_aux_scaler.apply(activation, aux_loss, router.snakellm_aux_scale)


def _attach_aux_loss(
    self: Any,
    activation: Any,
    aux_loss_coeff: float,
    aux_loss: Any,
    aux_loss_name: str,
    reduce_group: Any,
    reduce_group_has_dp: bool = False,
    valid_token_count: Any = None,
) -> Any:
    """megatron-core 0.16.1's ``TopKRouter.attach_and_log_load_balancing_loss`` (:func:`trace_aux_losses`)."""
    _track(self, aux_loss_name, aux_loss / aux_loss_coeff)
    if self.calculate_per_token_loss:
        num_tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
        return _scaled(self, activation, aux_loss * num_tokens)
    return _scaled(self, activation, aux_loss)


def _apply_z_loss(self: Any, logits: Any, padding_mask: Any = None) -> Any:
    """megatron-core 0.16.1's ``TopKRouter.apply_z_loss`` (:func:`trace_aux_losses`)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import z_loss_func

    if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
        return logits
    coeff = self.config.moe_z_loss_coeff / self.tp_cp_group.size()
    z_loss = z_loss_func(logits, coeff, padding_mask=padding_mask)
    if self.calculate_per_token_loss:
        num_tokens = (~padding_mask).sum() if padding_mask is not None else logits.shape[0]
        logits = _scaled(self, logits, z_loss * num_tokens)
    else:
        logits = _scaled(self, logits, z_loss)
    _track(self, "z_loss", z_loss / coeff)
    return logits


def one_rank_dispatch(dispatcher: Any) -> bool:
    """At one expert-parallel and one tensor-parallel rank, megatron-core's alltoall dispatcher with the
    grouped experts keeps the tokens per expert on the device and skips its chunk sorting.

    There its all-to-alls are identities (skipped here), but it still copies the tokens per expert to the
    host and waits for them (a device synchronisation per layer and forward pass), and sorts the tokens by local expert
    and back, which at one rank is the identity permutation (a ``torch.cat`` of 128 chunks of all the
    routed tokens, and its backward: about 10 ms a step at Qwen3-30B-A3B's shape on an H200). The grouped
    experts take the counts on the device. Returns whether the shortcut applies (not with token dropping,
    padding for quantization, shared experts, or more than one rank).

    Its permutation of the tokens does not wait for the device (:func:`permute_without_sync`). It also
    hands the tokens over sorted by expert last first (the routing map's expert columns reversed
    before the permutation; megatron-core's unpermutation then uses the same map): the order in which
    DDP's gradient buffer lays out the experts, so that the weights' gradients go there without
    reversing the routed tokens (:func:`weight_grads`). The experts then take their weights last first
    too (``tokens_last_expert_first``, set by :func:`one_rank_dispatch_where_grouped`).
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    cfg = dispatcher.config
    if (
        type(dispatcher) is not MoEAlltoAllTokenDispatcher
        or dispatcher.ep_size * dispatcher.tp_size != 1
        or dispatcher.drop_and_pad
        or cfg.moe_expert_capacity_factor is not None
        or cfg.moe_router_padding_for_quantization
        or dispatcher.shared_experts is not None
    ):
        return False

    def preprocess(hidden_states: Any, routing_map: Any, probs: Any) -> tuple[Any, Any]:
        """megatron-core's ``dispatch_preprocess`` at one rank (its steps and attributes, for its combine
        steps), the experts' columns reversed, the counts kept on the device, no synchronisation."""
        d = dispatcher
        d.hidden_shape, d.probs, d.routing_map = hidden_states.shape, probs.flip(1), routing_map.flip(1)
        hidden_states = hidden_states.view(-1, d.hidden_shape[-1])
        d.tokens_per_expert = d.preprocess(d.routing_map)
        d.hidden_shape_before_permute = hidden_states.shape
        tokens, permuted_probs, d.reversed_local_input_permutation_mapping = permute_without_sync(
            hidden_states, d.routing_map, probs=d.probs, num_out_tokens=d.num_out_tokens
        )
        return tokens, permuted_probs

    def postprocess(global_input_tokens: Any, global_probs: Any) -> tuple[Any, Any, Any]:
        tokens, dispatcher.tokens_per_expert = dispatcher.tokens_per_expert, None
        return global_input_tokens, tokens, global_probs

    # megatron-core's preprocess moves its (here unused) sync point on a first call: made once here, so that a
    # compiled layer does not recompile for the second call's value
    import torch

    dispatcher.preprocess(torch.zeros(1, dispatcher.num_experts, dtype=torch.bool))
    dispatcher.dispatch_preprocess = preprocess
    dispatcher.token_dispatch = lambda tokens, probs: (tokens, probs)  # the all-to-alls of one rank
    dispatcher.dispatch_postprocess = postprocess
    dispatcher.combine_preprocess = lambda hidden_states: hidden_states
    dispatcher.token_combine = lambda hidden_states, *args, **kwargs: hidden_states
    dispatcher.waits_for_nothing = True  # its layer may compile it (snakellm.models.build.eager_moe)
    return True


def _grouped_linear_fn() -> Any:
    import torch

    class GroupedLinear(torch.autograd.Function):
        """``y[rows of expert e] = x[rows of e] @ W_e^T`` for every local expert: two grouped matrix products
        a pass (torch._grouped_mm; ``offs``: the cumulative tokens per expert), the weights' gradients
        one more (:func:`weight_grads`).

        ``weights`` rides along as a plain tuple; ``graph_weights`` are the same weights as inputs of the
        autograd graph, or none where their gradients go only into DDP's buffers
        (:func:`grads_to_buffers_only`): then the backward pass has no per-expert nodes. With them, the
        autograd engine visits every expert's gradient accumulator and DDP's Python hook on it, each pass:
        about 2.6 ms for 128 experts, 16 times a step at Qwen3-30B-A3B's 8 layers, while the GPU waits."""

        @staticmethod
        def forward(ctx: Any, x: Any, offs: Any, weights: tuple[Any, ...], *graph_weights: Any) -> Any:
            w = stacked(list(weights)).detach()
            ctx.save_for_backward(x, offs, w)
            ctx.weights, ctx.in_graph = weights, bool(graph_weights)
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x, offs, w = ctx.saved_tensors
            dy = dy.contiguous()
            dx = torch._grouped_mm(dy, w, offs=offs)
            grads = weight_grads(ctx.weights, x, dy, offs)
            return (dx, None, None, *(grads if ctx.in_graph else ()))

    return GroupedLinear


def grads_to_buffers_only(x: Any, weights: list[Any]) -> bool:
    """Whether the experts' weights need no autograd gradient: DDP gave them ``main_grad`` buffers (all of a
    layer's experts alike, so the first and last stand for them), its hooks need not fire for them (no
    overlapped reduction) and the input carries a gradient, which makes autograd run the backward."""
    return bool(x.requires_grad and grads_to_buffers_only_static(weights))


def grads_to_buffers_only_static(weights: list[Any]) -> bool:
    """:func:`grads_to_buffers_only` but for the input: what the model's setup decides."""
    ends = (weights[0], weights[-1])
    return in_ddp_buffers(ends) and not any(getattr(w, "ddp_hook_needs_grad", False) for w in ends)


def grouped_experts_class() -> Any:
    """megatron-core's SequentialMLP with its local experts run as grouped matrix products.

    The same modules, parameters and ``sharded_state_dict`` (checkpoints of either load in the other, at
    any expert, tensor or pipeline layout); only the forward differs: megatron-core's loop runs one small matmul per
    expert, with the token counts copied to the host first; here every expert's up-projection is one
    ``torch._grouped_mm`` and every down-projection another (megatron-core's own grouped experts need
    Transformer Engine, or the legacy ``GroupedMLP`` the ``grouped_gemm`` CUDA package). Where
    :func:`grouped_usable` says no, megatron-core's loop runs.
    """
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP

    # eager inside a compiled layer where buffer_ops does not serve: its backward writes into DDP's buffers and marks the weights
    grouped = _grouped_linear_fn().apply

    @torch.compiler.disable
    def apply(x: Any, offs: Any, weights: list[Any]) -> Any:
        return grouped(x, offs, tuple(weights), *(() if grads_to_buffers_only(x, weights) else weights))

    class GroupedExperts(SequentialMLP):
        def runs_grouped(self) -> bool:
            """Whether the grouped products run these experts (else megatron-core's loop does)."""
            return self.num_local_experts > 1 and grouped_usable(self.config) is None

        def in_token_order(self, name: str) -> list[Any]:
            """The experts' ``name`` weights in the order of the tokens the dispatcher hands over."""
            weights = [getattr(e, name).weight for e in self.local_experts]
            return weights[::-1] if getattr(self, "tokens_last_expert_first", False) else weights

        def forward(self, hidden: Any, tokens_per_expert: Any, probs: Any) -> Any:
            if not self.runs_grouped():
                return super().forward(hidden, tokens_per_expert, probs)
            counts = torch.as_tensor(tokens_per_expert).to(device=hidden.device, dtype=torch.int64)
            offs = counts.cumsum(0).to(torch.int32)
            path = getattr(self, "buffer_path", None)
            if path is not None:  # an operator the compiled layer keeps in its graph (buffer_ops)
                a = torch.ops.snakellm.experts_linear(hidden, offs, *path["linear_fc1"])
            else:
                a = apply(hidden, offs, self.in_token_order("linear_fc1"))
            if self.config.bias_activation_fusion:  # megatron-core's fused weighted SwiGLU (GPU)
                from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

                a = weighted_bias_swiglu_impl(a, None, probs.unsqueeze(-1), False)
            else:
                a1, a2 = a.chunk(2, dim=-1)
                a = (self.config.activation_func(a1) * a2 * probs.unsqueeze(-1)).to(hidden.dtype)
            if path is not None:
                return torch.ops.snakellm.experts_linear(a, offs, *path["linear_fc2"]), None
            return apply(a, offs, self.in_token_order("linear_fc2")), None

    return GroupedExperts


def one_rank_dispatch_where_grouped(model: Any) -> int:
    """:func:`one_rank_dispatch` for every layer whose experts run as grouped products; returns how many."""
    done = 0
    for m in model.modules():
        disp, grouped = getattr(m, "token_dispatcher", None), getattr(getattr(m, "experts", None), "runs_grouped", None)
        if disp is not None and grouped is not None and grouped() and one_rank_dispatch(disp):
            m.experts.tokens_last_expert_first = True
            done += 1
    return done


def pack_experts(model: Any) -> int:
    """Each layer's local experts' fc1 (and fc2) weights moved into one storage, in the order the experts
    take their tokens (``in_token_order``), so that :func:`stacked` views them without a copy; the
    parameters stay the same objects. Returns the layers packed. Call after the dtype and device are final
    (``.bfloat16()`` / ``.cuda()`` make new storage) and after :func:`one_rank_dispatch_where_grouped`."""
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP

    packed = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SequentialMLP) and m.num_local_experts > 1:
                for name in ("linear_fc1", "linear_fc2"):
                    params = [getattr(e, name).weight for e in m.local_experts]
                    if hasattr(m, "in_token_order"):
                        params = m.in_token_order(name)
                    if any(hasattr(p, "main_grad") for p in params):
                        continue  # a gradient buffer owns them already
                    store = torch.stack([p.data for p in params])
                    for i, p in enumerate(params):
                        p.data = store[i]
                packed += 1
    return packed


def defer_expert_zeroing(ddp: Any) -> int:
    """megatron-core DDP's ``zero_grad_buffer`` without zeroing the grouped experts' gradients (the gradient
    buffers' ``reset``, which it calls, zeroes the rest of each buffer): their first pass of a step writes
    its gradients into the buffer (:func:`weight_grads` copies instead of adding), so the zeroing and the
    read of the zeros are saved (for Qwen3-30B-A3B's 8 layers, 19 GB of the step's
    traffic each). Where a layer's experts had no backward pass by the end of the step, ``finish_grad_sync``
    zeroes their gradients before the reduction. Not where DDP overlaps the reduction with the backward
    pass (a bucket's reduction may start before the step ends). Returns the groups of weights so treated."""
    import torch

    if ddp.ddp_config.overlap_grad_reduce:
        return 0
    groups, modules = [], []
    for m in ddp.module.modules():
        if callable(getattr(m, "runs_grouped", None)) and m.runs_grouped():
            modules.append(m)
            for name in ("linear_fc1", "linear_fc2"):
                weights = m.in_token_order(name)
                if in_ddp_buffers(weights):
                    weights[0].main_grad_unset = torch.zeros((), dtype=torch.bool)
                    groups.append(weights)
    if not groups:
        return 0
    for m in modules:
        m.buffer_path = buffer_path(m)
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        mine = [ws for ws in groups if any(w in buffer.param_index_map for w in (ws[0], ws[-1]))]
        if mine:
            buffer.reset = _reset_around(buffer, mine)
    finish = ddp.finish_grad_sync

    def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
        unset = [w.main_grad for ws in groups if _take_unset(ws) for w in ws]
        if unset:
            torch._foreach_zero_(unset)
        return finish(*args, **kwargs)

    ddp.finish_grad_sync = finish_grad_sync
    return len(groups)


def _reset_around(buffer: Any, groups: list[list[Any]]) -> Callable[[], None]:
    """A gradient buffer's ``reset`` that zeroes it but for the slices of the ``groups``' weights, and marks
    the groups unset (:func:`weight_grads` then writes their first gradients)."""
    import torch

    deferred = {w for ws in groups for w in ws}
    spans = sorted((s, e) for p, (s, e, _) in buffer.param_index_map.items() if p in deferred)
    rest, at = [], 0  # the slices between the deferred weights
    for start, end in [*spans, (buffer.grad_data.numel(), buffer.grad_data.numel())]:
        if start > at:
            rest.append(buffer.grad_data[at:start])
        at = max(at, end)

    def reset() -> None:
        if rest:
            torch._foreach_zero_(rest)
        for ws in groups:
            ws[0].main_grad_unset.fill_(True)

    return reset
