"""Mixture of experts on megatron-core's own MoE layer: its settings, counts and CPU shim.

A MoE model is a family whose architecture has ``num_experts`` (``snakellm/models/families/
mixtral.py``, ``qwen3_moe.py``): every layer's MLP is megatron-core's ``MoELayer`` (the local
spec's ``get_gpt_layer_local_spec(num_experts=...)``), with

* its ``TopKRouter``: softmax or sigmoid scores, top-k, renormalised or not
  (``moe_norm_topk_prob``: megatron-core's softmax over the top-k logits; without it, the
  softmax over all experts, then the top k, ``moe_router_pre_softmax``), the load-balancing
  auxiliary loss and the z-loss at the model's coefficients;
* the ``alltoall`` token dispatcher (expert parallelism over ``parallel.ep`` ranks);
* ``SequentialMLP`` experts, dropless (no capacity factor). megatron-core's grouped experts
  without Transformer Engine are the legacy ``GroupedMLP``, which needs the ``grouped_gemm``
  package (a CUDA source build, no wheel); ``TEGroupedMLP`` needs Transformer Engine, whose
  layer spec is used where it imports.

Torch-free to import: the config checks and ``snakellm plan`` use the counts.
"""

from __future__ import annotations

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


def scale_aux_losses(scale: float) -> None:
    """The factor megatron-core's MoE auxiliary losses' gradients get (``MoEAuxLossAutoScaler``): 1 / micro-batches
    in a step, as megatron-core's own schedules set it (a no-op for a dense model)."""
    import sys

    if "megatron.core.transformer.moe.moe_utils" not in sys.modules:
        return
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))


def install_cpu_shim() -> None:
    """Two places megatron-core 0.16.1's MoE layer needs CUDA or Transformer Engine, for the CPU (gloo).

    * the alltoall dispatcher makes a ``torch.cuda.Stream`` for its device-to-host copies of the split
      sizes and synchronises on its event: on the CPU the sizes are host tensors already, so the class's
      stream is a placeholder and the copy point only turns them into the numpy arrays the GPU path makes;
    * ``router_gating_linear`` tests ``te_general_gemm``, which is defined only when Transformer Engine
      imports: without it the name is None (its own fallback, a plain matmul).
    The GPU path is megatron-core's, unchanged.
    """
    import torch
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as td

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    cls = td.MoEAlltoAllTokenDispatcher
    if getattr(cls._maybe_dtoh_and_synchronize, "_snakellm_cpu", False):
        return
    if cls.cuda_dtoh_stream is None:
        cls.cuda_dtoh_stream = object()

    def on_cpu(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                v = getattr(self, name)
                if torch.is_tensor(v):
                    setattr(self, name, v.numpy())
        return tokens_per_expert

    on_cpu._snakellm_cpu = True  # type: ignore[attr-defined]
    cls._maybe_dtoh_and_synchronize = on_cpu
