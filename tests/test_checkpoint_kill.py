"""A job killed in the middle of writing a checkpoint: the previous one stays the latest and the next start
resumes from it, with the losses of an uninterrupted run. Asynchronous saves (``--async-save``: megatron-core's
async torch_dist writer in a forked process, published when complete) and synchronous ones.

The kill (SIGKILL to the whole process group: the trainer and its forked writer) lands while
``.iter_N.partial`` exists, that is while iteration N is being written, after a first complete checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import env_with_venv
from test_train import latest, losses, make_blend, train, train_cmd

STEPS = ["--steps", "12", "--save-interval", "4", "--keep-last", "3"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("ckpt-kill")
    make_blend(r)
    return r


def kill_mid_save(root: Path, run: str, *extra: str) -> int:
    """Start the run, SIGKILL it as soon as a save after the first one is under way; the iteration being saved."""
    ckpts = root / "runs" / run / "checkpoints"
    log = root / f"{run}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            train_cmd(run, *STEPS, *extra), cwd=root, env=env_with_venv(), stdout=fh, stderr=fh, start_new_session=True
        )
    deadline = time.time() + 240
    try:
        while True:
            partial = [p for p in ckpts.glob(".iter_*.partial")] if ckpts.exists() else []
            if partial and (ckpts / "latest_checkpointed_iteration.txt").exists():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
                return int(partial[0].name[len(".iter_") : -len(".partial")])
            assert proc.poll() is None, f"the run ended before a second save:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, "no second save within 240 s"
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(root) -> dict[int, float]:
    """The uninterrupted run (synchronous saves: an asynchronous one must not change a loss)."""
    train(root, "ref", *STEPS)
    return losses(root, "ref")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--async-save"], []], ids=["async", "sync"])
def test_killed_mid_save_resumes_from_the_previous_checkpoint(root, reference, mode):
    run = f"killed-{len(mode)}"
    saving = kill_mid_save(root, run, *mode)
    prev = latest(root, run)
    assert prev < saving, (prev, saving)  # the save in flight was never published
    assert (root / "runs" / run / "checkpoints" / f"iter_{prev:07d}" / "metadata.json").is_file()
    proc = train(root, run, *STEPS, *mode)
    assert f"resumed from runs/{run}/checkpoints/iter_{prev:07d}" in proc.stderr
    assert losses(root, run) == reference
    assert latest(root, run) == 12
    assert not list((root / "runs" / run / "checkpoints").glob(".iter_*"))  # the killed save's leftovers are gone


@pytest.mark.slow  # two 2-rank torchrun launches per mode (~10 s each): the GPU script's own path, kept from rotting
@pytest.mark.parametrize("mode", [[], ["--sync"]], ids=["async", "sync"])
def test_the_gpu_checkpoint_script_smoke(tmp_path, mode):
    """`scripts/check_checkpoint_8b_gpu.py --smoke` (the 8B GPU check's path on 2 CPU ranks): killed in the middle
    of the final save, the next start resumes from the previous checkpoint, asynchronous or synchronous.

    48 layers: each rank's write results (75-101 KB) overflow a pipe's 64 KiB, as Llama 3.1 8B's do on 4 ranks;
    megatron-core joins its forked writer before reading them, which hung every asynchronous 8B save until
    :class:`snakellm.io.checkpoint.DrainedQueue`."""
    from conftest import REPO

    script = REPO / "scripts" / "check_checkpoint_8b_gpu.py"
    cmd = [sys.executable, str(script), "--smoke", "--num-layers", "48", "--timeout", "120", *mode]
    cmd += ["--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env_with_venv(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "killed mid-save -> previous checkpoint intact and resumed: YES" in proc.stdout
    assert "resumed from iteration 2: True" in proc.stdout
    waits = "the whole save" if mode else "copy to host memory"
    assert f"({waits})" in proc.stdout


def _put_and_exit(q, n: int) -> None:
    q.put({"results": b"x" * n})


def test_a_forked_writer_with_large_results_exits_before_they_are_read():
    """megatron-core's order: fork the writer, join it, then read its results; a plain fork-context queue
    deadlocks that join once the results pass the pipe's 64 KiB (the writer cannot exit before they are read)."""
    import multiprocessing as mp

    from snakellm.io.checkpoint import DrainedQueue

    q = DrainedQueue()
    proc = mp.get_context("fork").Process(target=_put_and_exit, args=(q, 1 << 20))
    proc.start()
    proc.join(timeout=30)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive, "the writer could not exit: its results were not drained"
    assert q.get_nowait() == {"results": b"x" * (1 << 20)}
