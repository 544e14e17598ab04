"""`snakemake --profile profiles/slurm` on a real Slurm cluster: sbatch, srun, sacct, requeue.

scripts/slurm-up.sh brings up a single-node Slurm 22.05 (slurmctld, slurmd, slurmdbd with
MariaDB so that `sacct` works, munge, two fake GPUs as GRES) on this machine from Debian
packages; the tests submit through it exactly as on a cluster. Nothing is mocked: every
job is an sbatch job, `pretrain` runs 2 ranks through the rule's own `srun` (gloo on CPU)
with a `gpu` request served by the fake GRES, and the failures are real (an HTTP 503, a
SIGKILLed rank, `scontrol requeue`, the job's time limit).

The profile is pointed at the test cluster only through its environment variables
(SNAKELLM_SLURM_PARTITION, SNAKELLM_TRAIN_GPUS_PER_NODE, ...), so the file under test is
profiles/slurm/config.yaml as shipped. Skipped, with the reason, where the machine cannot
run a cluster: not root, or Slurm missing and no apt-get to install it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, SNAKEFILE, Workspace, age, env_with_venv

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PROFILE = REPO / "profiles" / "slurm"
SLURM_DIR = Path(os.environ.get("SNAKELLM_SLURM_DIR", "/tmp/snakellm-slurm"))
TIMINGS: dict[str, float] = {}

# The test cluster: one node, 2 CPUs (or what the machine has), 2 fake GPUs.
CLUSTER_ENV = {
    "SNAKELLM_SLURM_PARTITION": "debug",
    "SNAKELLM_SLURM_ACCOUNT": "ci",
    "SNAKELLM_SLURM_RUNTIME": "10",
    "SNAKELLM_SLURM_MEM_MB": "1000",
    "SNAKELLM_SLURM_CPUS": "1",
    "SNAKELLM_TRAIN_NODES": "1",
    "SNAKELLM_TRAIN_GPUS_PER_NODE": "2",
    "SNAKELLM_TRAIN_CPUS_PER_GPU": "1",
    "SNAKELLM_TRAIN_MEM_MB": "4000",
    "SNAKELLM_TRAIN_RUNTIME": "10",
    "SNAKELLM_TRAIN_SIGNAL_S": "0",
}


def _slurm_installed() -> bool:
    return all(shutil.which(c) for c in ("slurmctld", "slurmd", "slurmdbd", "sbatch", "munged", "mariadbd"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """The test cluster, up (scripts/slurm-up.sh); stopped afterwards if this session started it."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root: scripts/slurm-up.sh installs packages and starts daemons")
    if not _slurm_installed() and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and there is no apt-get to install it (scripts/slurm-up.sh needs Debian/Ubuntu)")
    was_up = subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout.count("UP") > 0 if shutil.which("scontrol") else False
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm-up.sh")], capture_output=True, text=True, timeout=900)
    TIMINGS["slurm-up (cold)" if not was_up else "slurm-up (warm)"] = time.monotonic() - t0
    assert proc.returncode == 0, f"scripts/slurm-up.sh failed:\n{proc.stdout}\n{proc.stderr}"
    facts = dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)
    yield facts
    if not was_up and os.environ.get("SNAKELLM_SLURM_KEEP") != "1":
        subprocess.run(["bash", str(REPO / "scripts" / "slurm-down.sh")], capture_output=True, text=True, timeout=120)


def sacct(*job_ids: str, duplicates: bool = False) -> list[dict]:
    """One dict per job (and step) record: JobID, State, ExitCode, NTasks, AllocTRES, Start, End."""
    fmt = "JobID,State,ExitCode,NTasks,AllocTRES,Start,End"
    cmd = ["sacct", "-P", "-n", f"--format={fmt}", "-j", ",".join(job_ids)]
    if duplicates:
        cmd.append("-D")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    keys = fmt.split(",")
    return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]


class SlurmWorkspace(Workspace):
    """A Workspace whose runs go through `--profile profiles/slurm` to the test cluster."""

    def slurm(self, *args: str, env: dict | None = None, check: bool = True, timeout: float = 900,
              background: bool = False):
        cmd = [
            str(BIN / "snakemake"), "-s", str(SNAKEFILE), "-d", str(self.root),
            "--configfile", str(self.config_path), "--replace-workflow-config",
            "--profile", str(PROFILE), "--nocolor", *args,
        ]
        e = env_with_venv()
        e.update(CLUSTER_ENV)
        e.update(env or {})
        if background:
            log = open(self.root / f"snakemake.{time.monotonic_ns()}.out", "w")
            p = subprocess.Popen(cmd, cwd=self.root, env=e, stdout=log, stderr=subprocess.STDOUT, text=True)
            p.log_path = Path(log.name)
            return p
        proc = subprocess.run(cmd, cwd=self.root, env=e, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def slurm_jobs(self) -> dict[str, tuple[str, str]]:
        """Slurm job id -> (rule, wildcards), from the plugin's log files logs/slurm/rule_<rule>/<wildcards>/<id>.log."""
        jobs = {}
        for p in (self.root / "logs" / "slurm").glob("rule_*/**/*.log"):
            rel = p.relative_to(self.root / "logs" / "slurm")
            rule = rel.parts[0].removeprefix("rule_")
            jobs[p.stem] = (rule, "/".join(rel.parts[1:-1]))
        return jobs

    def slurm_log(self, job_id: str) -> str:
        return next((self.root / "logs" / "slurm").glob(f"rule_*/**/{job_id}.log")).read_text()


def default_config(root: Path, steps: int = 20) -> dict:
    """config/config.yaml (the default workflow) on a private copy of resources/, with a short run."""
    shutil.copytree(REPO / "resources", root / "resources")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for run in cfg["runs"].values():
        run["train"].update(steps=steps, save_interval=10, eval_interval=10, eval_iters=1, log_interval=5, warmup_steps=2)
    return cfg


# ---------------------------------------------------------------- the cluster itself


def test_cluster_is_up_and_a_second_bring_up_is_a_no_op(slurm_cluster):
    assert slurm_cluster["partition"] == "debug" and int(slurm_cluster["gpus"]) == 2
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm-up.sh")], capture_output=True, text=True, timeout=120)
    TIMINGS["slurm-up (warm)"] = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "started" not in proc.stderr and "wrote" not in proc.stderr, proc.stderr  # nothing restarted or rewritten
    assert TIMINGS["slurm-up (warm)"] < 10
    # sacct answers (the plugin's status command) and the GPUs are schedulable
    subprocess.run(["sacct", "-n", "-X", "--starttime", "now-1minutes"], check=True, capture_output=True)
    out = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, check=True).stdout
    assert "gpu:2" in out


# ---------------------------------------------------------------- failures: retried as the profile says


def test_a_failed_job_is_resubmitted_as_the_profile_says(slurm_cluster, tmp_path):
    """A download job that gets an HTTP 503 (with download.retries 0) fails; the profile's
    `retries` resubmits it as a new sbatch job, which succeeds."""
    from httpserver import ShardServer

    www = tmp_path / "www"
    shutil.copytree(REPO / "resources" / "corpus" / "wikitext", www)
    ws = SlurmWorkspace(tmp_path / "ws")
    ws.root.mkdir()
    with ShardServer(www) as srv:
        ws.write_config({
            "sources": {"web": {"kind": "http", "url": srv.url("chunk{1..2}/example_train_{0..7}.jsonl.zst"),
                                "format": "jsonl.zst", "shards_per_chunk": 8}},
            "download": {"retries": 0, "timeout_s": 10},
        })
        srv.inject("chunk2/example_train_3.jsonl.zst", {"status": 503})
        t0 = time.monotonic()
        proc = ws.slurm("data/jsonl/web/chunk-00000.jsonl", "data/jsonl/web/chunk-00001.jsonl")
        TIMINGS["failed download retried"] = time.monotonic() - t0
        assert [s.status for s in srv.seen("chunk2/example_train_3.jsonl.zst")] == [503, 200]

    jobs = ws.slurm_jobs()
    downloads = sorted((jid for jid, (rule, wc) in jobs.items() if rule == "download" and wc == "web_chunk-00001"), key=int)
    assert len(downloads) == 2, jobs  # the failed attempt and its resubmission, two sbatch jobs
    states = {r["JobID"]: r["State"] for r in sacct(*downloads)}
    assert states[downloads[0]] == "FAILED" and states[downloads[1]] == "COMPLETED", states
    assert "Error in rule download" in ws.slurm_log(downloads[0])
    assert "HTTP 503" in proc.stdout + proc.stderr  # show-failed-logs: the rule's log of the failed attempt
    other = [jid for jid, (rule, wc) in jobs.items() if rule == "download" and wc == "web_chunk-00000"]
    assert len(other) == 1  # the healthy chunk ran once
    assert ws.path("data/jsonl/web/chunk-00001.jsonl").stat().st_size > 0
    assert "Trying to restart job" in proc.stdout + proc.stderr
