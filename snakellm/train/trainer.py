"""The training loop, in the shape torchtitan uses: ``fit()`` over ``train_step()``, parts kept apart.

The loop knows nothing about GPT pretraining: it gets a model (megatron-core
DDP, or anything with ``zero_grad_buffer``/``no_sync``/``finish_grad_sync``; a
``finalize_grads`` callable replaces the last where more is needed), an
optimizer with ``step(lr) -> grad norm``, a learning-rate schedule with
``lr(step)``, an iterator of micro-batches (dicts of tensors) and a
``loss_fn(model, batch) -> scalar``. Around it, separate parts with one job
each:

* :class:`snakellm.io.checkpoint.CheckpointManager`: save, keep-last-K + best, prune;
* :class:`snakellm.train.validator.Validator`: validation loss (and an optional early-stopping rule);
* :class:`snakellm.train.metrics.MetricsLogger`: metrics.jsonl, TensorBoard, tokens/s, MFU;
* :class:`snakellm.train.signals.StopPolicy`: SIGTERM/SIGUSR1 and max_time.

Pretraining (:mod:`snakellm.train.pretrain`) and fine-tuning assemble these
with their own data, loss and trainable parameters (the optimizer and the
checkpoint's sharded state decide what is trained and saved) and run the same
loop. Exit statuses: :data:`EXIT_OK` (reached ``steps`` or stopped early by the
early-stopping rule) and :data:`EXIT_STOPPED` (a signal or max_time: a
checkpoint was saved; rerun to resume).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from snakellm.io.checkpoint import CheckpointManager
from snakellm.io.log import log
from snakellm.io.progress import progress
from snakellm.train.metrics import MetricsLogger
from snakellm.train.profiling import StepProfiler
from snakellm.train.signals import EXIT_STOPPED, StopPolicy
from snakellm.train.validator import Validator

EXIT_OK = 0

Batch = dict[str, Any]


@dataclass
class Intervals:
    """How often the loop does what (in optimizer steps); ``save`` is off when ``checkpoints`` is False."""

    steps: int
    save: int
    eval: int
    log: int
    checkpoints: bool = True


def split_loss(out: Any) -> tuple[Any, dict[str, Any] | None]:
    """A loss function's result: the loss, or (loss, {metric name: 0-d tensor}) whose micro-batch means
    go into each step's metrics line beside the loss (DPO's rewards and log-probabilities)."""
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


class Trainer:
    """``fit()`` runs ``train_step()`` from ``start_step + 1`` to ``intervals.steps``."""

    def __init__(
        self,
        *,
        model: Any,
        optimizer: Any,
        lr_schedule: Any,
        batches: Iterator[Batch],
        loss_fn: Callable[[Any, Batch], Any],
        num_micro: int,
        intervals: Intervals,
        metrics: MetricsLogger,
        stop: StopPolicy,
        checkpoints: CheckpointManager | None = None,
        validator: Validator | None = None,
        early_stop: Callable[[float | None], str | None] | None = None,
        to_device: Callable[[Batch], Batch] = lambda b: b,
        start_step: int = 0,
        overlap_grad_reduce: bool = False,
        profiler: StepProfiler | None = None,
        rank0: bool = True,
        desc: str = "train",
        show_progress: bool = True,
        heartbeat: Callable[[int], None] | None = None,
        finalize_grads: Callable[[], None] | None = None,
        forward_backward: Callable[[list[Batch]], Any] | None = None,
    ):
        self.model, self.optimizer, self.lr_schedule = model, optimizer, lr_schedule
        self.batches, self.loss_fn, self.num_micro = batches, loss_fn, num_micro
        self.iv, self.metrics, self.stop = intervals, metrics, stop
        self.checkpoints, self.validator, self.early_stop = checkpoints, validator, early_stop
        self.to_device, self.step, self.overlap = to_device, start_step, overlap_grad_reduce
        self.profiler, self.rank0, self.desc, self.show_progress = profiler, rank0, desc, show_progress
        self.heartbeat = heartbeat  # called with each step number as it starts (the hang watchdog's)
        # after the last micro-batch's backward: the data-parallel gradient sync, and whatever else the model
        # needs (sequence parallelism: megatron-core's finalize_model_grads also sums the norms' gradients
        # over the tensor-parallel ranks)
        self.finalize_grads = finalize_grads or model.finish_grad_sync
        # pipeline parallelism: a step's micro-batches go to megatron-core's schedule in one call, which
        # returns their mean loss with the gradients finalised (snakellm.train.pipeline.Pipeline.step)
        self.forward_backward = forward_backward
        self.last_val: float | None = None
        self.stopped_by: str | None = None

    def train_step(self, step: int) -> None:
        """One optimizer step: accumulate ``num_micro`` micro-batches, sync gradients, update.

        Its phases are named ranges in ``--profile-steps``' trace (zero_grad, forward, backward,
        finalize_grads, optimizer)."""
        import torch

        phase = torch.profiler.record_function
        lr = self.lr_schedule.lr(step)
        with phase("zero_grad"):
            self.model.zero_grad_buffer()
        if self.forward_backward is not None:
            with phase("forward_backward"):
                mean = self.forward_backward([next(self.batches) for _ in range(self.num_micro)])
            with phase("optimizer"):
                norm = self.optimizer.step(lr)
            self.metrics.record(step, lr, mean, norm)
            return
        total, stats = None, None
        if self.num_micro > 1:  # the MoE auxiliary losses' gradients, averaged over micro-batches as the loss is
            from snakellm.models.moe import scale_aux_losses

            scale_aux_losses(1.0 / self.num_micro)
        for m in range(self.num_micro):
            batch = self.to_device(next(self.batches))
            sync_later = self.overlap and m < self.num_micro - 1
            with self.model.no_sync() if sync_later else contextlib.nullcontext():
                with phase("forward"):
                    loss, more = split_loss(self.loss_fn(self.model, batch))
                with phase("backward"):
                    (loss / self.num_micro).backward()
            total = loss.detach() if total is None else total + loss.detach()
            if more:
                stats = {k: v.detach() + (stats[k] if stats else 0) for k, v in more.items()}
        with phase("finalize_grads"):
            self.finalize_grads()
        with phase("optimizer"):
            norm = self.optimizer.step(lr)
        mean = (total if total is not None else torch.zeros(())) / self.num_micro
        self.metrics.record(step, lr, mean, norm, {k: v / self.num_micro for k, v in stats.items()} if stats else None)

    def validate(self, step: int) -> float | None:
        self.metrics.flush()  # keep evaluation out of the throughput window
        self.last_val = self.validator() if self.validator is not None else None
        self.metrics.validation(step, self.last_val)
        self.metrics.restart_window()
        return self.last_val

    def fit(self) -> int:
        """The loop. Returns EXIT_OK, or EXIT_STOPPED after a signal/max_time (with a checkpoint if enabled)."""
        iv, status = self.iv, EXIT_OK
        self.stop.install()
        with progress(
            total=iv.steps, initial=self.step, desc=self.desc, unit="step", enabled=self.show_progress
        ) as bar:
            reason = self.stop.check() if self.step < iv.steps else None
            if reason:
                log(f"stopping before the first step ({reason})", self.rank0)
                status = EXIT_STOPPED
            while status == EXIT_OK and self.step < iv.steps:
                self.step += 1
                step = self.step
                if self.heartbeat:
                    self.heartbeat(step)
                self.last_val = None
                if self.profiler:
                    self.profiler.before_step(step)
                self.train_step(step)
                bar.update(1)
                if self.profiler:
                    self.profiler.after_step(step)
                do_save = iv.checkpoints and self.checkpoints is not None and (step % iv.save == 0 or step == iv.steps)
                val = self.validate(step) if self.validator and (step % iv.eval == 0 or do_save) else None
                if step % iv.log == 0 or do_save or step == iv.steps:
                    self.metrics.flush()
                    if self.metrics.last_losses:
                        bar.set_postfix(loss=f"{self.metrics.last_losses[-1]:.4f}", refresh=False)
                reason = self.stop.check() if step < iv.steps else None
                early = self.early_stop(val) if (self.early_stop and val is not None and not reason) else None
                if self.checkpoints is not None and (do_save or ((reason or early) and iv.checkpoints)):
                    self.metrics.flush()
                    self.checkpoints.save(step, val)
                    self.metrics.restart_window()
                if self.checkpoints is not None:
                    self.checkpoints.poll()  # an asynchronous save that has finished is published
                if reason:
                    log(
                        f"stopped at iteration {step} ({reason}); "
                        + ("checkpoint saved; rerun to resume" if iv.checkpoints else "--no-checkpoints: nothing saved")
                        + f" (exit status {EXIT_STOPPED})",
                        self.rank0,
                    )
                    status, self.stopped_by = EXIT_STOPPED, reason
                elif early:
                    log(f"stopped at iteration {step}: {early}", self.rank0)
                    self.stopped_by = early
                    break
            self.metrics.flush()
        if self.checkpoints is not None:
            self.checkpoints.wait()  # the last asynchronous save is published before the job ends
        self.metrics.close()
        return status
