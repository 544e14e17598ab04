"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

A pure function of the update number, so resuming needs no scheduler state
beyond the iteration (the checkpoint still stores the parameters under
``opt_param_scheduler``, with Megatron-LM's key names, for whoever inspects it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CosineSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int  # the update at which min_lr is reached; constant afterwards
    style: str = "cosine"  # cosine | linear | constant

    def __post_init__(self):
        if self.style not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr decay style must be cosine, linear or constant, got {self.style!r}")
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr {self.min_lr} is above lr {self.max_lr}")
        if self.warmup_steps < 0 or self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"lr schedule needs 0 <= warmup_steps ({self.warmup_steps}) <= decay_steps ({self.decay_steps})"
            )

    def lr(self, update: int) -> float:
        """The learning rate of update number ``update`` (1 for the first optimizer step)."""
        if self.warmup_steps and update <= self.warmup_steps:
            return self.max_lr * update / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if update >= self.decay_steps:
            return self.min_lr
        ratio = (update - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if self.style == "cosine" else 1.0 - ratio
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def state_dict(self, iteration: int) -> dict:
        # Megatron-LM's OptimizerParamScheduler keys (here counted in iterations, not samples)
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.warmup_steps,
            "lr_decay_steps": self.decay_steps,
            "lr_decay_style": self.style,
            "num_steps": iteration,
            "units": "iterations",
        }

    def as_dict(self) -> dict:
        return asdict(self)
