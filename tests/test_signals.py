"""The trainer's forked children end with it (snakellm.train.signals.children_die_with_this_process).

A trainer ended at once (a second SIGTERM, or SIGKILL at the end of Slurm's grace period) in the middle of
a save used to leave dist-checkpointing's forked writer behind: an orphan outside Slurm's process tracking,
waiting forever, after which Slurm drained the node. Real processes here: a trainer stand-in that forks
through multiprocessing's fork context, SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

REPO = Path(__file__).resolve().parents[1]

TRAINER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from snakellm.train.signals import StopPolicy

    if sys.argv[1] == "install":
        StopPolicy().install()  # what the trainer does before its first step

    def writer():
        time.sleep(120)

    p = mp.get_context("fork").Process(target=writer)
    p.start()
    print(p.pid, flush=True)
    time.sleep(120)
    """
)


def alive(pid: int) -> bool:
    """Running or sleeping (a zombie that nobody reaps has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def orphan_survives(mode: str) -> bool:
    """Start the stand-in, SIGKILL it once its child runs; whether the child is still running 1 s later."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, mode], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert alive(child)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.05)
    survived = alive(child)
    if survived:
        os.kill(child, signal.SIGKILL)
    return survived


def test_a_forked_writer_ends_with_the_trainer_that_forked_it():
    assert orphan_survives("plain"), "without the hook the orphan lives on (the test would prove nothing)"
    assert not orphan_survives("install")
