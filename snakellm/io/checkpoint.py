"""Checkpoint directories as Megatron-LM writes them, published atomically.

Layout under ``runs/{run}/checkpoints/``::

    iter_0000100/                       megatron.core.dist_checkpointing (torch_dist):
        __0_0.distcp ... .metadata      model, optimizer, scheduler, RNG, iteration
        common.pt metadata.json
    latest_checkpointed_iteration.txt   "100"
    run_config.json                     snakellm: the run's settings and their fingerprint
    best.json                           snakellm: iteration and validation loss of the best checkpoint
    metrics.live.jsonl                  snakellm: per-step metrics up to the latest step (for resume)

A checkpoint is written to ``.iter_0000100.partial/`` and renamed into place
only when every rank has finished (dist_checkpointing writes ``metadata.json``
last), then the tracker file is replaced atomically. A job killed at any
moment therefore leaves either the previous checkpoint as latest or the new
one complete; a ``.partial`` directory is garbage from a killed save and is
removed by the next save.

Everything here except :func:`save`/:func:`load` is plain Python: the resume
decision is taken before torch is imported.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snakellm.errors import StepFailed
from snakellm.io.atomic import write_json, write_text

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.json"
BEST = "best.json"
LIVE_METRICS = "metrics.live.jsonl"
ITER_RE = re.compile(r"^iter_(\d{7})$")


class CheckpointError(StepFailed, RuntimeError):
    pass


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def is_complete(path: Path) -> bool:
    return (path / "metadata.json").is_file() and (path / "common.pt").is_file()


def list_iterations(ckpt_dir: str | os.PathLike) -> list[int]:
    """Iterations of the complete checkpoint directories, ascending."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    its = []
    for p in d.iterdir():
        m = ITER_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            its.append(int(m.group(1)))
    return sorted(its)


def latest_iteration(ckpt_dir: str | os.PathLike) -> int | None:
    """The iteration named by the tracker file, verified; None if there is no checkpoint at all.

    Inconsistent states are errors, never a silent fresh start: a tracker that
    names a missing or incomplete directory, or complete iteration directories
    without a tracker.
    """
    d = Path(ckpt_dir)
    tracker = d / TRACKER
    if not tracker.is_file():
        its = list_iterations(d)
        if its:
            raise CheckpointError(
                f"{d} holds checkpoints ({', '.join(iter_name(i) for i in its[-3:])}) but no {TRACKER}; "
                f"write the iteration to resume from into it, or move the directory away to start fresh"
            )
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    it = int(text)
    path = d / iter_name(it)
    if not path.is_dir():
        raise CheckpointError(f"{tracker} names iteration {it} but {path} is missing")
    if not is_complete(path):
        raise CheckpointError(f"{path} is incomplete (no metadata.json/common.pt): the checkpoint is damaged")
    return it


def read_run_config(ckpt_dir: str | os.PathLike) -> dict | None:
    p = Path(ckpt_dir) / RUN_CONFIG
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise CheckpointError(f"{p}: not valid JSON: {e}") from None


def write_run_config(ckpt_dir: str | os.PathLike, fingerprint: str, config: dict, **extra: object) -> None:
    """The settings the checkpoints were made with (``config``, fingerprinted) and what describes
    them without being part of the trajectory (``extra``: the tokenizer, the blend path)."""
    write_json(Path(ckpt_dir) / RUN_CONFIG, {"fingerprint": fingerprint, "config": config, **extra})


def archive(ckpt_dir: str | os.PathLike) -> Path:
    """Move a checkpoint directory aside (never delete): ``checkpoints`` -> ``checkpoints.old-<UTC time>``."""
    d = Path(ckpt_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = d.with_name(f"{d.name}.old-{stamp}")
    n = 1
    while dest.exists():
        dest = d.with_name(f"{d.name}.old-{stamp}-{n}")
        n += 1
    os.rename(d, dest)
    return dest


def read_best(ckpt_dir: str | os.PathLike) -> dict | None:
    p = Path(ckpt_dir) / BEST
    return json.loads(p.read_text()) if p.is_file() else None


def prune(ckpt_dir: str | os.PathLike, keep_last: int, keep: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Delete complete checkpoints except the newest ``keep_last`` and those in ``keep``; return the deleted."""
    d = Path(ckpt_dir)
    its = list_iterations(d)
    latest = latest_iteration(d)
    protected = set(its[-keep_last:]) if keep_last > 0 else set()
    protected |= set(keep)
    if latest is not None:
        protected.add(latest)
    gone = [i for i in its if i not in protected]
    for i in gone:
        shutil.rmtree(d / iter_name(i), ignore_errors=True)
    return gone


def truncate_live_metrics(ckpt_dir: str | os.PathLike, iteration: int) -> None:
    """Keep the live metrics of steps <= ``iteration`` (the steps after the checkpoint run again)."""
    p = Path(ckpt_dir) / LIVE_METRICS
    if not p.is_file():
        return
    keep = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if rec.get("step", 0) <= iteration:
            keep.append(line)
    write_text(p, "".join(ln + "\n" for ln in keep))


def mark_resumed(ckpt_dir: str | os.PathLike, iteration: int) -> None:
    """Record that a new session continues from ``iteration``: ``{"step": N, "resumed": true}``.

    merge_metrics folds it into step N's record; the report draws a dashed line there
    and counts the run's sessions (snakellm/report/train.py).
    """
    with open(Path(ckpt_dir) / LIVE_METRICS, "a") as fh:
        fh.write(json.dumps({"step": iteration, "resumed": True}) + "\n")


# --------------------------------------------------------------- save / load (torch)


def _in_process_results_queue() -> None:
    """Keep dist_checkpointing from starting a multiprocessing Manager.

    Its file writer (0.16.1, strategies/filesystem_async.py) hands the results of
    its forked writer processes back through a queue owned by a ``spawn``
    Manager: a server process that re-imports ``__main__`` and, when the trainer
    is SIGKILLed, lives on as an orphan holding the job's stderr. Our saves are
    synchronous, so the results arrive in this very process: a plain queue does
    the same job, with no extra process.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", False) is None:
        fa._results_queue = queue.Queue()


class DrainedQueue:
    """A fork-context queue for the forked writer's results, emptied in this process as they arrive.

    megatron-core 0.16.1's asynchronous save forks a writer, which puts its write results on the
    queue and exits; the trainer joins the writer (``TemporalAsyncCaller.close``) and reads the
    queue only after that. A process exits only once its queue's feeder thread has pushed every
    byte into the pipe, and a pipe holds 64 KiB: results larger than that (Llama 3.1 8B's shape on
    4 ranks; 48 layers of tiny-llama on 2 CPU ranks: 75-101 KB) deadlock the join, the trainer waits
    forever at its next save. Here a daemon thread of the trainer moves each result from the pipe
    to an in-process queue as soon as it is written, so the writer can always exit; ``get_nowait``
    (megatron-core's read, after the join) waits a moment for that thread.
    """

    def __init__(self, grace_s: float = 30.0):
        import multiprocessing as mp
        import threading

        self._pipe = mp.get_context("fork").Queue()
        self._got: queue.Queue = queue.Queue()
        self._grace_s = grace_s
        threading.Thread(target=self._drain, name="snakellm-checkpoint-results", daemon=True).start()

    def _drain(self) -> None:
        while True:
            self._got.put(self._pipe.get())

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        self._pipe.put(obj, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self._got.get(block, timeout)

    def get_nowait(self) -> Any:
        return self._got.get(timeout=self._grace_s)  # the writer has exited: its result is in the pipe


def _fork_results_queue() -> None:
    """Asynchronous saves: the writer runs in a forked process, whose results come back through a
    :class:`DrainedQueue` it inherits (no Manager server process, see :func:`_in_process_results_queue`)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if not isinstance(fa._results_queue, DrainedQueue):
        fa._results_queue = DrainedQueue()


def save(
    ckpt_dir: str | os.PathLike,
    iteration: int,
    sharded_state_dict: dict,
    *,
    rank: int,
    barrier,
    sharded_strategy: Any = None,
    async_queue: Any = None,
    on_done: Callable[[], None] | None = None,
) -> Path:
    """Collective: write ``iter_{N:07d}`` through a ``.partial`` directory and point the tracker at it.

    ``sharded_strategy``: megatron-core's default torch_dist writer unless given (streaming import's).
    ``async_queue`` (megatron-core's ``AsyncCallsQueue``): the tensors are copied to host memory here,
    written by a forked process while training goes on, and the directory is published (renamed,
    tracker replaced, then ``on_done``) when the queue finalizes the save on every rank; until then
    the previous checkpoint stays the latest, so a job killed mid-save resumes from it.
    """
    from megatron.core import dist_checkpointing

    if async_queue is None:
        _in_process_results_queue()
    else:
        _fork_results_queue()

    d = Path(ckpt_dir)
    partial = d / f".{iter_name(iteration)}.partial"
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        for stale in [*d.glob(".iter_*.partial"), *d.glob(".iter_*.old")]:
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    barrier()
    if async_queue is not None:
        if sharded_strategy is None:
            from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

            sharded_strategy = get_default_save_sharded_strategy()
        request = dist_checkpointing.save(
            sharded_state_dict, str(partial), sharded_strategy=sharded_strategy, async_sharded_save=True
        )

        def finalize() -> None:
            barrier()
            publish(d, iteration, rank)
            barrier()
            if on_done is not None:
                on_done()

        request.add_finalize_fn(finalize)
        async_queue.schedule_async_request(request)
        return d / iter_name(iteration)
    dist_checkpointing.save(sharded_state_dict, str(partial), sharded_strategy=sharded_strategy)
    barrier()
    publish(d, iteration, rank)
    barrier()
    if on_done is not None:
        on_done()
    return d / iter_name(iteration)


def publish(d: Path, iteration: int, rank: int) -> None:
    """Rank 0: the complete ``.partial`` directory becomes ``iter_{N}`` and the tracker names it."""
    if rank != 0:
        return
    final = d / iter_name(iteration)
    partial = d / f".{iter_name(iteration)}.partial"
    # an existing directory of this iteration (saved once, then resumed from an earlier one)
    # is moved aside, never deleted in place: a kill mid-delete must not leave a
    # half-deleted directory under the final name
    old = d / f".{iter_name(iteration)}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    write_text(d / TRACKER, f"{iteration}\n")
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(ckpt_dir: str | os.PathLike, iteration: int, sharded_state_dict: dict) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state_dict, str(Path(ckpt_dir) / iter_name(iteration)))


def load_common(ckpt_dir: str | os.PathLike, iteration: int) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(Path(ckpt_dir) / iter_name(iteration)))


# --------------------------------------------------------------- the manager the Trainer uses


class CheckpointManager:
    """Save (keep the newest ``keep_last`` + the best by validation loss, prune the rest) and restore.

    What goes into a checkpoint is the caller's: ``sharded_state(is_loading)``
    returns the sharded state dict (model, optimizer, RNG... or only a
    fine-tune's adapters), ``common_state(step)`` the plain extras saved with it
    (iteration, scheduler, metadata). The manager owns the directory's layout
    and its invariants (see the module docstring); it keeps ``best`` in
    ``best.json``.
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike,
        *,
        keep_last: int,
        sharded_state: Callable[[bool], dict[str, Any]],
        common_state: Callable[[int], dict[str, Any]],
        rank: int,
        barrier: Callable[[], None],
        log: Callable[[str], None] = lambda _msg: None,
        best: dict[str, Any] | None = None,
        async_save: bool = False,
        save_group: Any = None,
    ):
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.sharded_state = sharded_state
        self.common_state = common_state
        self.rank = rank
        self.barrier = barrier
        self.log = log
        self.best = best
        self.save_group = save_group  # the data-parallel group: its ranks share the writing of replicated tensors
        self._queue: Any = None
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()

    def save(self, step: int, val_loss: float | None) -> Path:
        """Collective. ``val_loss`` (if any) may make this the best checkpoint, which pruning keeps.

        Asynchronous saves: one at a time (the previous one is finished first); the time printed
        first is what training waited for (the copy to host memory), the second the whole save.
        """
        self.wait()
        if val_loss is not None and (self.best is None or val_loss < self.best["val_loss"]):
            self.best = {"iteration": step, "val_loss": val_loss}
        t0 = time.time()
        sd = self.sharded_state(False)
        sd.update(self.common_state(step))
        best = dict(self.best) if self.best else None

        def done() -> None:
            if self.rank == 0:
                if best is not None:
                    write_json(self.dir / BEST, best)
                gone = prune(self.dir, self.keep_last, {best["iteration"]} if best else set())
                self.log(
                    f"saved {self.dir / iter_name(step)} in {time.time() - t0:.1f}s"
                    + (f"; removed {len(gone)} older" if gone else "")
                )

        path = save(
            self.dir,
            step,
            sd,
            rank=self.rank,
            barrier=self.barrier,
            sharded_strategy=self._strategy(),
            async_queue=self._queue,
            on_done=done,
        )
        if self._queue is not None:
            self.log(f"saving {path} in the background (training waited {time.time() - t0:.1f}s)")
        self.barrier()
        return path

    def _strategy(self) -> Any:
        """megatron-core's torch_dist writer; over a data-parallel group, its fully parallel wrapper: the tensors
        every rank holds (a replicated model, the replicated optimizer) are written by all ranks, each a share,
        instead of all by the first (what is sharded, FSDP's and the distributed optimizer's, is each rank's own)."""
        import torch

        if self.save_group is None or torch.distributed.get_world_size(self.save_group) == 1:
            return None
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), self.save_group)

    def poll(self) -> None:
        """Collective (every rank, every step): publish a finished asynchronous save."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Collective: finish and publish the asynchronous save in flight, if any."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=True)

    def restore(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(loaded sharded state, common state) of ``iter_{step}``; the caller puts them into its objects."""
        loaded = load(self.dir, step, self.sharded_state(True))
        common = load_common(self.dir, step)
        if int(common["iteration"]) != step:
            raise CheckpointError(f"{iter_name(step)} holds iteration {common['iteration']}")
        return loaded, common
