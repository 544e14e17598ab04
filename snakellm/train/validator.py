"""Validation loss and early stopping, separate from the loop that calls them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class Validator:
    """Mean loss over a fixed set of validation micro-batches, averaged over data-parallel ranks.

    ``make_batches`` returns a fresh iterable each call (the same batches every
    time, so validation losses of different steps compare); ``loss_fn(model,
    batch)`` is the training loss function, evaluated in ``eval()`` mode
    without gradients. A batch whose ``loss_mask`` is all zero scores nothing:
    it runs (an FSDP rank with fewer examples than the others must gather the
    weights as often as they do) but is not counted. The loss is the mean over
    every rank's scored batches (ranks with more batches weigh more: at micro
    batch 1, one process's mean over the examples); every rank joins the
    reduction, also one without a batch.
    """

    def __init__(
        self,
        model: Any,
        make_batches: Callable[[], Iterable[dict[str, Any]]],
        loss_fn: Callable[[Any, dict[str, Any]], Any],
        *,
        to_device: Callable[[dict[str, Any]], dict[str, Any]],
        dp_group: Any = None,
        dp_size: int = 1,
        evaluate: Callable[[list[dict[str, Any]]], Any] | None = None,
    ):
        self.model = model
        self.make_batches = make_batches
        self.loss_fn = loss_fn
        self.to_device = to_device
        self.dp_group = dp_group
        self.dp_size = dp_size
        # pipeline parallelism: all the batches go through the schedule at once, their mean loss comes back
        self.evaluate = evaluate

    def __call__(self) -> float | None:
        import torch

        self.model.eval()
        total, count = None, 0
        with torch.no_grad():
            if self.evaluate is not None:
                batches = [self.to_device(b) for b in self.make_batches()]
                total, count = (self.evaluate(batches), 1) if batches else (None, 0)
            for b in [] if self.evaluate is not None else self.make_batches():
                scored = "loss_mask" not in b or bool(b["loss_mask"].any())
                out = self.loss_fn(self.model, self.to_device(b))
                loss = (out[0] if isinstance(out, tuple) else out).detach()
                if scored:
                    total = loss if total is None else total + loss
                    count += 1
        self.model.train()
        if self.dp_size == 1:
            return None if total is None else float(total.item()) / count
        # (sum of this rank's batch losses, their number), reduced over the data-parallel ranks
        mine = self.to_device({"v": torch.zeros(2)})["v"]
        if total is not None:
            mine[0], mine[1] = total.float(), count
        torch.distributed.all_reduce(mine, group=self.dp_group)
        return float(mine[0].item()) / float(mine[1].item()) if mine[1].item() else None


class EarlyStopping:
    """Stop when the validation loss has not improved for ``patience`` evaluations (None: never)."""

    def __init__(self, patience: int | None, min_delta: float = 0.0):
        self.patience = patience
        self.min_delta = min_delta
        self.best: float | None = None
        self.bad_evals = 0

    def __call__(self, val_loss: float | None) -> str | None:
        if self.patience is None or val_loss is None:
            return None
        if self.best is None or val_loss < self.best - self.min_delta:
            self.best, self.bad_evals = val_loss, 0
            return None
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            return f"early stopping: validation loss {self.best:.4f} not improved for {self.bad_evals} evaluations"
        return None
