"""Hang detection for multi-rank training: which rank stopped, instead of a silent wait.

A rank that hangs (a lost node, a stuck data loader, a SIGSTOPped process, a deadlock)
leaves every other rank blocked inside a collective. NCCL's and gloo's own timeouts
then end the job with "Timed out waiting ... for recv", which names no culprit, and
NCCL's default is 10 minutes, gloo's 30. This module gives every rank a heartbeat in
the job's rendezvous store (the TCPStore that ``init_process_group`` already serves
from rank 0), and a daemon thread per rank that, once its own rank made no progress
for ``timeout`` seconds, reads the other ranks' heartbeats, names the ones that are
behind or silent (rank, host, local rank, last step, seconds since) on stderr (and appends
it to ``record``, e.g. ``runs/<run>/watchdog.log``, which outlives the attempt's own log when
the next attempt overwrites it) and ends the process with :data:`EXIT_HANG`. Under ``srun --kill-on-bad-exit=1`` that ends the
whole step at once, so the allocation is free within ``timeout``, not at the time limit.

Two stamps per rank: the training loop's step (``beat``), and the thread's own
"alive" time every ``poll`` seconds. A rank blocked in a collective waits with the
GIL released, so its thread keeps stamping; a stopped, dead or cut-off rank does not.
The hanging ranks are those behind this rank's step or silent for several polls. All
store traffic goes through a client of its own whose operations time out after a few
seconds: when rank 0, the store's host, is the rank that hangs, the others say so.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_HANG = 124  # what `timeout(1)` returns: the step was ended for making no progress
PREFIX = "snakellm/heartbeat/"


def describe(rank: int, info: dict[int, tuple[int, float, str, int]], now: float) -> str:
    """One rank's line: ``rank 3 (host node2, local rank 1): last at step 5, 42 s ago``."""
    if rank not in info:
        return f"rank {rank}: no heartbeat at all"
    step, t, host, local = info[rank]
    return f"rank {rank} (host {host}, local rank {local}): last at step {step}, {now - t:.0f} s ago"


def laggards(
    info: dict[int, tuple[int, float, str, int]],
    alive: dict[int, float],
    world: int,
    my_step: int,
    now: float,
    stale: float,
) -> list[int]:
    """Ranks behind ``my_step``, without a heartbeat, or whose thread has been silent for ``stale`` seconds.

    When every rank is alive and at the same step, none is singled out: all are returned.
    """
    bad = [r for r in range(world) if r not in info or info[r][0] < my_step or now - alive.get(r, 0.0) > stale]
    return bad or list(range(world))


class Watchdog:
    """``beat(step)`` from the training loop; the thread ends the process when progress stops.

    ``store_factory`` makes the store client (a ``torch.distributed.TCPStore`` in
    training); ``exit`` is ``os._exit`` (a blocked collective cannot be unwound
    from another thread), replaceable in tests.
    """

    def __init__(
        self,
        store_factory: Callable[[], Any],
        rank: int,
        world: int,
        local_rank: int,
        timeout: float,
        exit: Callable[[int], None] = os._exit,
        poll: float = 2.0,
        record: Path | None = None,
    ):
        self.store = store_factory()
        self.rank, self.world, self.local_rank, self.timeout = rank, world, local_rank, timeout
        self.host = socket.gethostname()
        self._exit, self._poll, self.record = exit, poll, record
        self._lock = threading.Lock()
        self._step, self._t = 0, time.time()
        self._stopped = threading.Event()
        self.message: str | None = None
        self.beat(0)
        self._thread = threading.Thread(target=self._run, name="snakellm-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        with self._lock:
            self._step, self._t = step, time.time()
        try:
            self.store.set(f"{PREFIX}{self.rank}", f"{step} {self._t} {self.host} {self.local_rank}")
        except Exception:
            pass

    def stop(self) -> None:
        self._stopped.set()

    def _read(self) -> tuple[dict[int, tuple[int, float, str, int]], dict[int, float], str | None]:
        info: dict[int, tuple[int, float, str, int]] = {}
        alive: dict[int, float] = {}
        try:
            for r in range(self.world):
                key = f"{PREFIX}{r}"
                if self.store.check([key]):
                    step, t, host, local = self.store.get(key).decode().split()
                    info[r] = (int(step), float(t), host, int(local))
                if self.store.check([f"{PREFIX}alive/{r}"]):
                    alive[r] = float(self.store.get(f"{PREFIX}alive/{r}").decode())
        except Exception as e:
            return (
                info,
                alive,
                (f"the rendezvous store on rank 0 does not answer ({type(e).__name__}): rank 0 hangs or is gone"),
            )
        return info, alive, None

    def _stamp(self) -> None:
        try:
            self.store.set(f"{PREFIX}alive/{self.rank}", str(time.time()))
        except Exception:  # reported once this rank itself times out
            pass

    def _progressed_since(self, t: float) -> bool:
        with self._lock:
            return self._t != t

    def _run(self) -> None:
        while not self._stopped.wait(self._poll):
            self._stamp()
            with self._lock:
                step, t = self._step, self._t
            if time.time() - t < self.timeout:
                continue
            stale = max(3 * self._poll, 5.0)
            now = time.time()
            info, alive, store_error = self._read()
            culprits = [0] if store_error else laggards(info, alive, self.world, step, now, stale=stale)
            if not store_error and len(culprits) == self.world:
                # nobody behind and every thread still stamping: a rank stopped just now looks alive for
                # up to `stale` seconds; look once more after that before blaming every rank
                until = time.time() + stale
                while time.time() < until:  # still stamping, so that the other ranks do not blame this one
                    time.sleep(self._poll)
                    self._stamp()
                now = time.time()
                info, alive, store_error = self._read()
                culprits = [0] if store_error else laggards(info, alive, self.world, step, now, stale=stale)
            if self._progressed_since(t):
                continue  # this rank moved on while the others were read (a slow start-up that just ended)
            lines = [
                f"rank {self.rank} made no progress for {now - t:.0f} s (--collective-timeout {self.timeout:g} s) "
                f"at step {step}, waiting for the other ranks;"
            ]
            lines.append(store_error or "hanging: " + "; ".join(describe(r, info, now) for r in culprits))
            self.message = " ".join(lines)
            line = f"snakellm train: error: {self.message}"
            print(line, file=sys.stderr, flush=True)
            if self.record is not None:
                try:  # one short line, appended in one write: no partial record worth guarding against
                    with open(self.record, "a") as fh:
                        fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
                except OSError:
                    pass
            self._stopped.set()
            self._exit(EXIT_HANG)
            return


def start(
    torch: Any, dist: Any, timeout: float, log: Callable[[str], None] = print, record: Path | None = None
) -> Watchdog | None:
    """After ``init_process_group``: check and log the rank table, then start this rank's watchdog.

    ``None`` for a single process, which has nobody to wait for.
    """
    if dist.world_size == 1:
        return None
    import datetime

    from snakellm.launch.distributed import rank_table

    rows: list[Any] = [None] * dist.world_size
    torch.distributed.all_gather_object(rows, (dist.rank, dist.local_rank, dist.local_world_size, socket.gethostname()))
    log(f"ranks: {rank_table(rows)}; rendezvous {dist.master_addr}:{dist.master_port}")
    return Watchdog(
        lambda: torch.distributed.TCPStore(
            dist.master_addr, dist.master_port, is_master=False, timeout=datetime.timedelta(seconds=10)
        ),
        dist.rank,
        dist.world_size,
        dist.local_rank,
        timeout,
        record=record,
    )
