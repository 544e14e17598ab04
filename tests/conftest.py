"""Shared helpers: real `snakemake` runs on temporary copies of a small config.

`Workspace` is a temp working directory holding a copy of the shipped corpus and
a config file; `ws.run(...)` runs the repository's Snakefile there in a
subprocess (`--replace-workflow-config` so the embedded default's sources do
not leak into the test's config) and `ws.snapshot()` / `changed()` tell which
outputs a run rewrote, by mtime — behaviour, not log parsing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# Triton's interpreter runs the fused decode kernels' tests (test_engine_kernels.py) on a machine
# without a GPU. It must be chosen before anything imports Triton (transformers and torch may):
# Triton decorates its own standard library (tl.sum's combine, ...) when it is imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
SNAKEFILE = REPO / "Snakefile"
BIN = Path(sys.executable).parent


# What a launcher sets for one rank: never passed on from the test process (an in-process
# test that started a process group must not make every later job think it is a rank).
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test leaves os.environ as it found it (snakellm.launch.distributed.export writes to it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def env_with_venv() -> dict[str, str]:
    """The environment for subprocesses: this interpreter's bin first (snakemake, snakellm)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_probe(cmd: list[str], cwd: Path, timeout: float = 300) -> dict:
    """Run a probe process (``env_with_venv``), assert it succeeded and return the JSON of its last stdout line."""
    proc = subprocess.run(cmd, cwd=cwd, env=env_with_venv(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Workspace:
    def __init__(self, root: Path):
        self.root = root
        self.config_path = root / "config.yaml"

    def path(self, rel: str) -> Path:
        return self.root / rel

    def write_config(self, config: dict) -> None:
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def read_config(self) -> dict:
        return yaml.safe_load(self.config_path.read_text())

    def run(self, *args: str, check: bool = True, cores: int = 2, timeout: float = 900) -> subprocess.CompletedProcess:
        cmd = [
            str(BIN / "snakemake"),
            "-s",
            str(SNAKEFILE),
            "-d",
            str(self.root),
            "--configfile",
            str(self.config_path),
            "--replace-workflow-config",
            "-c",
            str(cores),
            "--nocolor",
            *args,
        ]
        proc = subprocess.run(cmd, cwd=self.root, env=env_with_venv(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def nothing_to_do(self, *targets: str) -> bool:
        out = self.run("-n", *targets)
        return "Nothing to be done" in (out.stdout + out.stderr)

    def age(self, seconds: float = 60.0) -> None:
        age(self.root, seconds)

    def snapshot(self, *dirs: str) -> dict[str, int]:
        """mtime_ns of every file under the given dirs (default: data/)."""
        snap = {}
        for d in dirs or ("data",):
            base = self.root / d
            if base.exists():
                for p in base.rglob("*"):
                    if p.is_file():
                        snap[str(p.relative_to(self.root))] = p.stat().st_mtime_ns
        return snap

    def changed(self, before: dict[str, int], *dirs: str) -> set[str]:
        after = self.snapshot(*dirs)
        return {p for p, t in after.items() if before.get(p) != t}


def age(root: Path, seconds: float = 60.0, *dirs: str) -> None:
    """Move every file under ``dirs`` (default data/, runs/) back in time.

    Then a file edited now is unambiguously newer than the outputs built from it,
    whatever the filesystem's timestamp granularity (moving the edit into the
    future instead makes Snakemake complain about clock skew).
    """
    for d in dirs or ("data", "runs"):
        base = root / d
        if base.exists():
            for p in base.rglob("*"):
                st = p.stat()
                os.utime(p, ns=(st.st_atime_ns - int(seconds * 1e9), st.st_mtime_ns - int(seconds * 1e9)))


def small_config(root: Path) -> dict:
    """The embedded default's data stage on a private copy of the shipped corpus."""
    shutil.copytree(REPO / "resources" / "corpus", root / "resources" / "corpus")
    return {
        "sources": {
            "wikitext": {
                "kind": "local",
                "path": "resources/corpus/wikitext/chunk*/example_train_*.jsonl.zst",
                "format": "jsonl.zst",
                "shards_per_chunk": 6,
            },
            "botchan": {
                "kind": "local",
                "path": "resources/corpus/botchan/*.jsonl",
                "format": "jsonl",
                "weight": 0.5,
                "shards_per_chunk": 1,
            },
        }
    }


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path)


@pytest.fixture(scope="session")
def default_workflow(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """The embedded default config (config/config.yaml) built once per test session.

    A private copy of resources/ and the default config in a temp directory,
    built to its default target (every stage of the default graph, the tiny
    run included: a few minutes on 2 cores). Tests that need a pretrained
    model, exported artifacts or a report of the default workflow share it;
    they may build further targets with ``ws.run(target)`` but must not
    modify what is there.
    """
    root = tmp_path_factory.mktemp("default-workflow")
    shutil.copytree(REPO / "resources", root / "resources")
    shutil.copy(REPO / "config" / "config.yaml", root / "config.yaml")
    ws = Workspace(root)
    ws.first_run = ws.run(timeout=1800)  # what the terminal showed (tests/test_run_summary.py reads it)
    return ws


def pytest_addoption(parser: pytest.Parser) -> None:
    import timebudget  # the suite's time budget and its --times-report (tests/timebudget.py)

    timebudget.pytest_addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    import timebudget
    import xdist_schedule  # how the tests spread over pytest-xdist workers (tests/xdist_schedule.py)

    timebudget.pytest_configure(config)
    xdist_schedule.pytest_configure(config)
