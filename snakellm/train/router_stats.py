"""Router health of a mixture-of-experts model, per training step, for the one metrics writer.

megatron-core's routers (``TopKRouter``) are observed, not changed: a forward hook adds each training
forward's routing map (``[tokens, experts]``, true where a token goes) to a per-expert count on the
device, and megatron-core's own aux-loss tracker holds the load-balancing loss and the z-loss of each
layer (unscaled by their coefficients: 1.0 is a perfectly balanced router), summed over the step's
micro-batches (with sequence parallelism, of this tensor-parallel rank's slice of the sequence).
:meth:`RouterStats.take` hands :class:`snakellm.train.metrics.MetricsLogger` one
step's values (device tensors: no host sync) and starts the next step; the logger sums the counts
over the data-parallel ranks (and the tensor-parallel slices) at its flush and writes ``moe_tokens_per_expert`` (summed over the
layers), ``moe_max_load`` (the busiest expert's share over the mean), ``moe_aux_loss``,
``moe_z_loss`` (means over the layers) and ``moe_dropped_tokens`` (routed assignments that did not
reach an expert: 0 when dropless, the default) to ``metrics.jsonl`` and TensorBoard.
"""

from __future__ import annotations

from typing import Any


class RouterStats:
    def __init__(self, modules: list[Any], topk: int, num_micro: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for mod in modules for m in mod.modules() if isinstance(m, TopKRouter)]
        self.topk, self.num_micro = topk, num_micro
        # sequence parallelism: each tensor-parallel rank routes its own slice of the sequence
        self.sliced = any(r.config.sequence_parallel for r in self.routers)
        self.counts: Any = None
        self.assigned: Any = None
        for r in self.routers:
            r.register_forward_hook(self._seen)

    def _seen(self, module: Any, args: Any, out: Any) -> None:
        if not module.training:
            return  # validation forwards are not the step's routing
        routing_map = out[1]
        # device tensors, both: traced into a compiled layer, a Python counter would recompile it at every call
        c = routing_map.sum(dim=0)  # int64 per expert (the layers' counts are summed)
        n = c.new_full((), routing_map.shape[0] * self.topk)
        self.counts = c if self.counts is None else self.counts + c
        self.assigned = n if self.assigned is None else self.assigned + n

    def take(self) -> dict[str, Any] | None:
        """This step's values (device tensors), and a fresh start for the next; None before any forward."""
        import torch
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        if self.counts is None:
            return None
        tracker = get_moe_layer_wise_logging_tracker()
        layers = max(len(self.routers), 1)

        def total(name: str) -> Any:  # over this rank's layers, averaged over the step's micro-batches
            t = tracker.get(name, {}).get("values")
            return t.sum() / self.num_micro if t is not None else self.counts.new_zeros((), dtype=torch.float)

        out = {
            "counts": self.counts,
            "assigned": self.assigned,
            "sliced": self.sliced,
            # the losses summed over this rank's layers, and how many layers that is (a pipeline stage's)
            "losses": torch.stack(
                [
                    total("load_balancing_loss").float(),
                    total("z_loss").float(),
                    torch.tensor(float(layers), device=self.counts.device),
                ]
            ),
        }
        clear_aux_losses_tracker()
        self.counts, self.assigned = None, None
        return out


def reduce(pending: list[dict[str, Any]], dp_group: Any, dp_size: int) -> list[dict[str, Any]]:
    """The steps' router records: counts summed over the data-parallel ranks, the pipeline stages (each holds
    its own layers' routers) and, with sequence parallelism, the tensor-parallel ranks (each routes its slice of
    the sequence); the losses averaged over the data-parallel ranks and all layers. Over the slices the
    load-balancing loss adds up (megatron-core computes each slice's part with the whole sequence's counts)
    and the z-loss (a mean over the slice's tokens) averages."""
    import torch
    from megatron.core import parallel_state as ps

    counts = torch.stack([p["counts"] for p in pending])
    assigned = torch.stack([p["assigned"] for p in pending])
    losses = torch.stack([p["losses"] for p in pending])  # [steps, (aux, z, layers)]
    torch.distributed.all_reduce(counts, group=dp_group)
    torch.distributed.all_reduce(assigned, group=dp_group)
    torch.distributed.all_reduce(losses, group=dp_group)
    losses = losses / dp_size  # the layer count too: every data-parallel rank of a stage holds the same layers
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1 and pending[0]["sliced"]:
        group = ps.get_tensor_model_parallel_group()
        for t in (counts, assigned, losses):
            torch.distributed.all_reduce(t, group=group)
        losses[:, 1:] /= tp  # the z-loss is the slices' mean; every tensor-parallel rank holds the same layers
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        for t in (counts, assigned, losses):
            torch.distributed.all_reduce(t, group=group)
    out = []
    for c, a, (aux, z, layers) in zip(counts.tolist(), assigned.tolist(), losses.tolist()):
        aux, z = aux / max(layers, 1.0), z / max(layers, 1.0)
        mean = sum(c) / len(c) if c else 0.0
        out.append(
            {
                "moe_tokens_per_expert": c,
                "moe_max_load": max(c) / mean if mean else None,
                "moe_aux_loss": aux,
                "moe_z_loss": z,
                "moe_dropped_tokens": a - sum(c),
            }
        )
    return out
