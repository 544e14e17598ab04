"""When to stop early: SIGTERM/SIGUSR1 (what Slurm sends before a time limit) and ``max_time``.

The trainer asks :meth:`StopPolicy.check` between steps. With several ranks the
answer is agreed on collectively (a max over a gloo group), so that every rank
saves the same checkpoint and stops at the same step even when only one of them
received the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType
from typing import Any

EXIT_STOPPED = 75


class StopPolicy:
    """Signals and a wall-clock budget, checked between steps (never inside one)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(
        self,
        *,
        max_time: float | None = None,
        max_time_text: str | None = None,
        started_at: float | None = None,
        world_size: int = 1,
        group: Any = None,
        prog: str = "snakellm train",
    ):
        self.signal: str | None = None
        self.max_time = max_time
        self.max_time_text = max_time_text if max_time_text is not None else str(max_time)
        self.started_at = time.time() if started_at is None else started_at
        self.world_size = world_size
        self.group = group
        self.prog = prog

    def install(self) -> None:
        """From the first training step on; before it a signal simply ends the process (nothing to save)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            print(
                f"{self.prog}: received {self.signal}: saving a checkpoint after this step, then exiting "
                f"with status {EXIT_STOPPED} (send it again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
        else:  # a second signal: the default action (terminate) from now on
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def local_reason(self) -> str | None:
        if self.signal is not None:
            return self.signal
        if self.max_time is not None and time.time() - self.started_at >= self.max_time:
            return f"max time {self.max_time_text}"
        return None

    def check(self) -> str | None:
        """This rank's reason to stop, or another rank's (collective when there are several ranks)."""
        reason = self.local_reason()
        if self.world_size > 1:
            import torch

            flag = torch.tensor([1.0 if reason else 0.0])  # on the CPU: a gloo group, no GPU sync
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
            if flag.item() and reason is None:
                reason = "another rank stopped"
        return reason
