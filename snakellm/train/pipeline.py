"""Pipeline parallelism: one optimizer step through megatron-core's own schedules.

With ``pp > 1`` the model is this rank's pipeline stage, or with virtual stages
(``virtual_pp > 1``) its model chunks, each wrapped in megatron-core DDP.
:class:`Pipeline` runs a step's micro-batches through
``megatron.core.pipeline_parallel.get_forward_backward_func()``: the 1F1B
schedule, or the interleaved one over the chunks; activations and their
gradients travel between stages by point-to-point sends (gloo on the CPU, NCCL
on GPUs, the same schedule; :func:`snakellm.launch.runtime.install_cpu_megatron_shims`
covers the schedules' one CUDA-only allocation). megatron-core's
``finalize_model_grads`` then syncs the data-parallel gradients, the tied
embedding's two copies (first and last stage) and, with sequence parallelism,
the norms'.

Every stage reads the same micro-batches (the first needs the tokens, the last
the labels and loss mask); the loss exists on the last stage and is summed over
the pipeline group so that every rank reports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

Batch = dict[str, Any]


class Pipeline:
    """The chunks of one pipeline rank, driven by megatron-core's schedule; the Trainer's ``model``.

    ``forward(chunk, batch)`` runs one chunk (the last one returns per-token losses), ``reduce(output,
    batch)`` turns the last chunk's output into the micro-batch's mean loss.
    """

    def __init__(
        self,
        chunks: list[Any],
        config: Any,
        *,
        forward: Callable[[Any, Batch], Any],
        reduce: Callable[[Any, Batch], Any],
        to_device: Callable[[Batch], Batch],
        seq_length: int,
        micro_batch_size: int,
    ):
        from megatron.core.distributed import finalize_model_grads

        self.chunks, self.config = chunks, config
        self.forward, self.reduce, self.to_device = forward, reduce, to_device
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        # what megatron-LM's training loop hands the schedule: per-chunk no_sync, and the gradient finalisation
        syncs = [c.no_sync for c in chunks]
        config.no_sync_func = syncs[0] if len(syncs) == 1 else syncs
        config.finalize_model_grads_func = finalize_model_grads
        if len(chunks) > 1:
            # Megatron-LM's default for the interleaved schedule, and a must at pp 2, where the previous and
            # the next stage are one rank: batched sends and receives to one peer pair up by order (an
            # activation would be received as a gradient); the unbatched ones use a communicator per direction
            config.overlap_p2p_comm, config.batch_p2p_comm = True, False

    # ---------------------------------------------------------------- what the Trainer and Validator call

    def zero_grad_buffer(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def train(self, mode: bool = True) -> None:
        for c in self.chunks:
            c.train(mode)

    def eval(self) -> None:
        self.train(False)

    def no_sync(self) -> Any:
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:  # done by the schedule (finalize_model_grads)
        pass

    def parameters(self) -> Iterator[Any]:
        for c in self.chunks:
            yield from c.parameters()

    def step(self, batches: list[Batch]) -> Any:
        """Forward and backward of a step's micro-batches, gradients finalised; the mean loss on every rank."""
        return self._run(batches, forward_only=False)

    def evaluate(self, batches: list[Batch]) -> Any:
        """The mean loss of ``batches``, forward only (validation).

        The interleaved schedule runs micro-batches in groups of pp: the list is filled up to a
        multiple of pp with its own first batches, whose losses are left out of the mean.
        """
        from megatron.core import parallel_state as ps

        n, pp = len(batches), ps.get_pipeline_model_parallel_world_size()
        padded = batches
        if len(self.chunks) > 1 and n % pp:
            padded = batches + [batches[i % n] for i in range(pp - n % pp)]
        return self._run(padded, forward_only=True, count=n)

    # ---------------------------------------------------------------- the schedule

    def _forward_step(self, data_iterator: Iterator[Batch], model: Any) -> tuple[Any, Any]:
        b = self.to_device(next(data_iterator))
        out = self.forward(model, b)
        return out, partial(self._loss, b)

    def _loss(self, b: Batch, out: Any) -> tuple[Any, dict[str, Any]]:
        loss = self.reduce(out, b)
        return loss, {"loss": loss.detach().clone()}  # the schedule divides ``loss`` in place

    def _run(self, batches: list[Batch], forward_only: bool, count: int | None = None) -> Any:
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(batches)
        count = n if count is None else count
        # each chunk reads every micro-batch once, in order (the interleaved schedule asks per chunk)
        iters: Any = [iter(batches) for _ in self.chunks]
        out = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=n,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=forward_only,
        )
        device = next(self.chunks[0].parameters()).device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for d in out[:count]:  # only on the last stage
            total += d["loss"].float()
        total /= count
        torch.distributed.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        return total
