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


_forked_by: list[int] = []  # the pid of the process that forks, set just before each fork


def children_die_with_this_process() -> None:
    """Every process forked from now on (``os.fork``, multiprocessing's fork context) is SIGKILLed when the
    process that forked it ends (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing changes).

    A second signal ends the trainer at once, possibly in the middle of a save, whose writer processes
    dist-checkpointing forks. Such a writer, orphaned, was no longer a descendant of the job step's process, so
    Slurm's process tracking (``proctrack/linuxproc``) did not find it. It waited forever on a queue nobody read,
    and Slurm drained the node ("Kill task failed"). Once per process; children started by ``subprocess``
    (fork and exec, no Python hooks) are not affected.
    """
    if _forked_by or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def record() -> None:
        _forked_by[:] = [os.getpid()]

    def in_child() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != _forked_by[0]:  # the parent ended before the request took effect
            os._exit(128 + signal.SIGKILL)

    _forked_by.append(os.getpid())
    os.register_at_fork(before=record, after_in_child=in_child)


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
        children_die_with_this_process()
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
