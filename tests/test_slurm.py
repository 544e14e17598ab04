"""`snakemake --profile profiles/slurm` on a real Slurm cluster: sbatch, srun, sacct, requeue.

scripts/slurm-up.sh brings up a single-node Slurm 22.05 (slurmctld, slurmd, slurmdbd with
MariaDB so that `sacct` works, munge, two fake GPUs as GRES) on this machine from Debian
packages; the tests submit through it exactly as on a cluster. Nothing is mocked: every
job is an sbatch job, `pretrain` runs 2 ranks through the rule's own `srun` (gloo on CPU)
with a `gpu` request served by the fake GRES, and the failures are real (an HTTP 503, a
SIGKILLed rank, `scontrol requeue`, the job's time limit).

The profile is pointed at the test cluster only through its environment variables
(SNAKELLM_SLURM_PARTITION, SNAKELLM_TRAIN_GPUS_PER_NODE, ...: the site defaults of the job
resources), so the file under test is profiles/slurm/config.yaml as shipped; runs and fine-tunes
with resources of their own (`runs.<name>.resources`, `resources.finetune`) get those instead. Skipped, with the reason, where the machine cannot
run a cluster: not root, or Slurm missing and no apt-get to install it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
import zstandard
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
        pytest.skip(
            "Slurm is not installed and there is no apt-get to install it (scripts/slurm-up.sh needs Debian/Ubuntu)"
        )
    was_up = (
        subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout.count("UP") > 0
        if shutil.which("scontrol")
        else False
    )
    t0 = time.monotonic()
    env = dict(os.environ)
    if (os.cpu_count() or 1) < 2:  # pretrain runs 2 ranks of 1 CPU each
        env.setdefault("SLURM_CPUS", "2")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm-up.sh")], capture_output=True, text=True, timeout=900, env=env
    )
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

    def slurm(
        self, *args: str, env: dict | None = None, check: bool = True, timeout: float = 900, background: bool = False
    ):
        cmd = [
            str(BIN / "snakemake"),
            "-s",
            str(SNAKEFILE),
            "-d",
            str(self.root),
            "--configfile",
            str(self.config_path),
            "--replace-workflow-config",
            "--profile",
            str(PROFILE),
            "--nocolor",
            *args,
        ]
        e = env_with_venv()
        e.update(CLUSTER_ENV)
        e.update(env or {})
        if background:
            log = open(self.root / f"snakemake.{time.monotonic_ns()}.out", "w")
            p = subprocess.Popen(cmd, cwd=self.root, env=e, stdout=log, stderr=subprocess.STDOUT, text=True)
            p.log_path = Path(log.name)
            return p
        try:
            proc = subprocess.run(cmd, cwd=self.root, env=e, capture_output=True, text=True, timeout=timeout)
        finally:
            self.cancel_leftovers()
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def cancel_leftovers(self) -> None:
        """scancel this workspace's jobs still queued or running (a killed snakemake leaves them behind)."""
        out = subprocess.run(["squeue", "-h", "-o", "%A %Z"], capture_output=True, text=True).stdout
        ids = [
            jid for jid, wd in (line.split(" ", 1) for line in out.splitlines() if " " in line) if Path(wd) == self.root
        ]
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True)

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
    """config/config.yaml (the default workflow, without its curation) on a private copy of resources/, with a
    short run."""
    shutil.copytree(REPO / "resources", root / "resources")
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for source in cfg["sources"].values():  # curation's own incremental test is tests/test_curate_workflow.py
        source.pop("curate", None)
    for run in cfg["runs"].values():
        run["train"].update(
            steps=steps, save_interval=10, eval_interval=10, eval_iters=1, log_interval=5, warmup_steps=2
        )
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


# ---------------------------------------------------------------- the default workflow through sbatch

STEPS = 20
SRUN_LINE = "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --kill-on-bad-exit=1 snakellm train "


@pytest.fixture(scope="module")
def built(slurm_cluster, tmp_path_factory):
    """The default workflow (config/config.yaml, a 20-step run) built once through the Slurm profile."""
    ws = SlurmWorkspace(tmp_path_factory.mktemp("slurm-default"))
    ws.write_config(default_config(ws.root, steps=STEPS))
    t0 = time.monotonic()
    proc = ws.slurm()
    TIMINGS["default workflow via sbatch"] = time.monotonic() - t0
    return ws, proc


def test_default_workflow_runs_through_sbatch_to_the_trained_checkpoint(built):
    ws, proc = built
    jobs = ws.slurm_jobs()
    rules = sorted(rule for rule, _ in jobs.values())
    # every job of the default graph was its own sbatch job (only `all` runs locally)
    assert rules.count("chunk") == 4 and rules.count("pretrain") == 1, rules
    assert {"train_tokenizer", "tokenize", "blend"} <= set(rules), rules
    assert rules.count("tokenize") == 8, rules  # 4 chunks x 2 tokenizers

    summary = json.loads(ws.path("runs/tiny/train_summary.json").read_text())
    assert summary["status"] == "completed" and summary["iteration"] == STEPS
    assert summary["world_size"] == 2  # two ranks, started by the rule's srun
    assert ws.path(f"runs/tiny/checkpoints/iter_{STEPS:07d}").is_dir()
    assert ws.path("runs/tiny/checkpoints/latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)

    (pretrain_id,) = [jid for jid, (rule, _) in jobs.items() if rule == "pretrain"]
    records = {r["JobID"]: r for r in sacct(pretrain_id)}
    job, step = records[pretrain_id], records[f"{pretrain_id}.0"]
    assert job["State"] == "COMPLETED", records
    assert "gres/gpu=2" in job["AllocTRES"], job  # the gpu=2 request, served by the fake GRES
    assert step["NTasks"] == "2" and step["State"] == "COMPLETED", step  # one srun step, 2 tasks
    assert SRUN_LINE in ws.slurm_log(pretrain_id)  # the generated command, as the job ran it


def test_a_second_run_submits_nothing(built):
    ws, _ = built
    before = ws.slurm_jobs()
    proc = ws.slurm()
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert ws.slurm_jobs() == before


def test_changing_one_shard_resubmits_only_the_stale_jobs(built):
    ws, _ = built
    age(ws.root, 60, "data", "runs", "tokenizers")
    before = set(ws.slurm_jobs())
    # one more document in a shard of wikitext chunk-00001 (a bare touch is no change to
    # Snakemake 9, which compares the checksums of small inputs whose mtime moved)
    shard = ws.path("resources/corpus/wikitext/chunk1/example_train_7.jsonl.zst")
    text = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
    shard.write_bytes(zstandard.ZstdCompressor().compress(text + b'{"text": "One more document."}\n'))
    t0 = time.monotonic()
    ws.slurm()
    TIMINGS["one shard changed"] = time.monotonic() - t0
    new = sorted(v for k, v in ws.slurm_jobs().items() if k not in before)
    data_and_training = [
        (r, w) for r, w in new if r in ("download", "chunk", "train_tokenizer", "tokenize", "blend", "pretrain")
    ]
    assert data_and_training == [
        ("blend", "gpt2"),
        ("blend", "spm2k"),
        ("chunk", "wikitext_chunk-00001"),
        ("pretrain", "tiny"),
        ("tokenize", "gpt2_wikitext_chunk-00001"),
        ("tokenize", "spm2k_wikitext_chunk-00001"),
    ]
    # and what is built from the retrained run and the changed token counts: its artifacts, lm-eval and
    # samples, the token report figures (the other report rules run locally, not through sbatch)
    later = sorted({r for r, _ in new} - {r for r, _ in data_and_training})
    assert later == ["evaluate_lm", "export_hf", "export_nemo", "generate", "report_tokens"], new
    assert len(new) == len(data_and_training) + 4 + 2, new  # one run; two tokenizers' token reports


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
        ws.write_config(
            {
                "sources": {
                    "web": {
                        "kind": "http",
                        "url": srv.url("chunk{1..2}/example_train_{0..7}.jsonl.zst"),
                        "format": "jsonl.zst",
                        "shards_per_chunk": 8,
                    }
                },
                "download": {"retries": 0, "timeout_s": 10},
            }
        )
        srv.inject("chunk2/example_train_3.jsonl.zst", {"status": 503})
        t0 = time.monotonic()
        proc = ws.slurm("data/jsonl/web/chunk-00000.jsonl", "data/jsonl/web/chunk-00001.jsonl")
        TIMINGS["failed download retried"] = time.monotonic() - t0
        assert [s.status for s in srv.seen("chunk2/example_train_3.jsonl.zst")] == [503, 200]

    jobs = ws.slurm_jobs()
    downloads = sorted(
        (jid for jid, (rule, wc) in jobs.items() if rule == "download" and wc == "web_chunk-00001"), key=int
    )
    assert len(downloads) == 2, jobs  # the failed attempt and its resubmission, two sbatch jobs
    states = {r["JobID"]: r["State"] for r in sacct(*downloads)}
    assert states[downloads[0]] == "FAILED" and states[downloads[1]] == "COMPLETED", states
    assert "Error in rule download" in ws.slurm_log(downloads[0])
    assert "HTTP 503" in proc.stdout + proc.stderr  # show-failed-logs: the rule's log of the failed attempt
    other = [jid for jid, (rule, wc) in jobs.items() if rule == "download" and wc == "web_chunk-00000"]
    assert len(other) == 1  # the healthy chunk ran once
    assert ws.path("data/jsonl/web/chunk-00001.jsonl").stat().st_size > 0
    assert "Trying to restart job" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- training: requeue and time limit resume


def wait_for(what: str, cond, timeout: float = 300, proc=None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"snakemake ended ({proc.returncode}) while waiting for {what}:\n{proc.log_path.read_text()}"
            )
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def signal_ranks(job_id: str, sig: int) -> list[int]:
    """Send ``sig`` to every process of the job's srun steps (the ranks), not to its batch step."""
    out = subprocess.run(["scontrol", "listpids", job_id], capture_output=True, text=True).stdout
    pids = [int(f[0]) for f in (line.split() for line in out.splitlines()[1:]) if len(f) >= 3 and f[2].isdigit()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def pause_ranks(job_id: str) -> list[int]:
    """SIGSTOP the ranks: progress stops, the job's wall clock does not; Slurm sends SIGCONT
    with its own SIGTERM (time limit, requeue)."""
    pids = signal_ranks(job_id, signal.SIGSTOP)
    assert pids, f"no running ranks in job {job_id}"
    return pids


def test_training_job_requeued_signalled_and_stopped_by_its_time_limit_resumes_each_time(built):
    """One training job, interrupted three ways, never starts over:

    1. `scontrol requeue`: the same Slurm job starts again and resumes from the latest checkpoint;
    2. SIGUSR1 to the job's step, which is what the profile's `--signal=USR1@300` sends before
       the time limit: the ranks save a checkpoint at the current step and exit 75, and the
       next start resumes from exactly that step;
    3. the time limit itself (TIMEOUT): the profile resubmits the job, which resumes again and
       finishes.

    The ranks are paused (SIGSTOP) right after a checkpoint before 1 and 3, so that the
    requeue and the time limit fall mid-training however fast this machine trains; Slurm
    sends SIGCONT with its SIGTERM."""
    ws, _ = built
    steps = 40
    cfg = ws.read_config()
    cfg["runs"]["resume"] = {
        "tokenizer": "spm2k",
        "model": {"preset": "tiny"},
        "train": dict(cfg["runs"]["tiny"]["train"], steps=steps, save_interval=5, eval_interval=20, retries=2),
        "parallel": {"threads": 1},
    }
    ws.write_config(cfg)
    ckpts = ws.path("runs/resume/checkpoints")
    train_log = ws.path("logs/pretrain/resume.log")
    resumed_at = re.compile(r"resumed from \S+ \(iteration (\d+)")

    def latest() -> int:
        p = ckpts / "latest_checkpointed_iteration.txt"
        return int(p.read_text()) if p.exists() else 0

    def pretrain_jobs() -> list[str]:
        return sorted((j for j, (r, wc) in ws.slurm_jobs().items() if r == "pretrain" and wc == "resume"), key=int)

    def log_text() -> str:
        return train_log.read_text() if train_log.exists() else ""

    t0 = time.monotonic()
    proc = ws.slurm("runs/resume/train_summary.json", background=True)
    try:
        job = wait_for("the pretrain job", lambda: pretrain_jobs()[:1], proc=proc)[0]
        # 1. requeue
        first = wait_for("a first checkpoint", latest, proc=proc)
        assert first < steps
        pause_ranks(job)
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
        resumed = int(wait_for("the requeued job to resume", lambda: resumed_at.search(log_text()), proc=proc).group(1))
        # 2. SIGUSR1 to the ranks, as --signal=USR1@N does: queued while they are paused, then handled
        pause_ranks(job)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, capture_output=True)
        signal_ranks(job, signal.SIGCONT)
        m = wait_for(
            "the ranks to stop on SIGUSR1",
            lambda: re.search(r"stopped at iteration (\d+)|stopping before the first step", log_text()),
            proc=proc,
        )
        stop = int(m.group(1)) if m.group(1) else resumed
        assert stop < steps
        # the next start (in the same allocation or a resubmitted job: a fresh log) resumes from that step
        wait_for(
            f"a resume from iteration {stop}",
            lambda: (
                (t := log_text())
                and f"(iteration {stop}," in t
                and resumed_at.search(t)
                and "stopped at" not in t
                and "stopping before" not in t
            ),
            proc=proc,
        )
        # 3. the time limit
        current = pretrain_jobs()[-1]
        pause_ranks(current)
        assert latest() < steps
        # the limit falls at 1 min of the job's latest start, enforced within Slurm's 30 s check
        subprocess.run(["scontrol", "update", f"JobId={current}", "TimeLimit=1"], check=True, capture_output=True)
        assert proc.wait(timeout=600) == 0, proc.log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        ws.cancel_leftovers()
    TIMINGS["requeue + SIGUSR1 + time limit"] = time.monotonic() - t0
    out = proc.log_path.read_text()
    everything = out + "".join(ws.slurm_log(j) for j in pretrain_jobs()) + log_text()

    # the requeued job kept its id; the time limit ended a job; the profile's retry completed the run
    assert [r["State"] for r in sacct(job, duplicates=True) if r["JobID"] == job][0] == "REQUEUED"
    jobs = pretrain_jobs()
    states = {j: [r["State"] for r in sacct(j, duplicates=True) if r["JobID"] == j] for j in jobs}
    assert "TIMEOUT" in states[current] and states[jobs[-1]][-1] == "COMPLETED", states
    assert jobs[-1] != current and "Trying to restart job" in out, states  # resubmitted after the TIMEOUT
    assert "DUE TO TIME LIMIT" in ws.slurm_log(current)

    # every start after the first resumed, never from scratch: after the requeue from >= the
    # first checkpoint, after SIGUSR1 from exactly the step it stopped at, after the time limit
    # from at least that
    resumes = [int(m) for m in resumed_at.findall(everything)]
    assert resumes and min(resumes) >= first and resumed >= first, everything[-5000:]
    assert stop in resumes, (stop, resumes)
    assert [int(m) for m in resumed_at.findall(log_text())][0] >= stop  # the final job
    summary = json.loads(ws.path("runs/resume/train_summary.json").read_text())
    assert summary["iteration"] == steps and summary["world_size"] == 2
    metrics = [json.loads(line) for line in ws.path("runs/resume/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, steps + 1))  # one record per step


# ---------------------------------------------------------------- two nodes (network namespaces)

MULTI_TRAIN = {
    "steps": 6,
    "micro_batch_size": 2,
    "global_batch_size": 8,
    "save_interval": 3,
    "eval_interval": 3,
    "eval_iters": 1,
    "log_interval": 1,
    "warmup_steps": 1,
}


@pytest.fixture(scope="module")
def multi(built, slurm_cluster):
    """The built workspace, when the cluster has its two namespaced nodes (else skip, with the reason)."""
    if int(slurm_cluster.get("multi_nodes", 0)) < 2:
        pytest.skip(
            "no two-node partition: scripts/slurm-up.sh left it out: "
            + (slurm_cluster.get("multi_skip") or "?").replace("_", " ")
        )
    return built[0]


def multi_env(nodes: int, per_node: int) -> dict[str, str]:
    return {
        "SNAKELLM_SLURM_GPU_PARTITION": "multi",
        "SNAKELLM_TRAIN_NODES": str(nodes),
        "SNAKELLM_TRAIN_GPUS_PER_NODE": str(per_node),
        "SNAKELLM_TRAIN_MEM_MB": "2000",
    }


def train_losses(ws: SlurmWorkspace, run: str) -> list[float]:
    lines = ws.path(f"runs/{run}/metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def rank_pids(job_id: str) -> dict[int, int]:
    """SLURM_PROCID -> pid of the job's ranks (`snakellm train` processes of an srun step), on every node:
    the namespaced nodes share this machine's process table, which `scontrol listpids` (one node) does not see."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURM_STEP_ID", "").isdigit()
            and any(c.endswith(b"snakellm") for c in cmd[:2])
            and b"train" in cmd
        ):
            out[int(env["SLURM_PROCID"])] = int(proc.name)
    return out


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 2)], ids=["2x1", "2x2"])
def test_pretrain_on_two_nodes_is_bit_identical_to_one_node(multi, nodes, per_node):
    """`pretrain` with nodes=2 through sbatch + the rule's srun: ranks on both nodes (each in its own
    network namespace), rank 0's node as the rendezvous (first host of SLURM_JOB_NODELIST), local
    ranks 0..n-1 per node; losses and weights bit-identical to the same world size on one node."""
    ws = multi
    world = nodes * per_node
    run, ref = f"n{nodes}x{per_node}", f"one{world}"
    cfg = ws.read_config()
    for name in (run, ref):
        cfg["runs"][name] = {
            "tokenizer": "spm2k",
            "model": {"preset": "tiny"},
            "train": dict(cfg["runs"]["tiny"]["train"], **MULTI_TRAIN),
            "parallel": {"threads": 1},
        }
    # the run's allocation in its own config (the profile's SNAKELLM_TRAIN_* site defaults would apply to every
    # run of the workflow, and the default `tiny` run's batch does not split over 2 x 2 ranks)
    cfg["runs"][run]["resources"] = {"nodes": nodes, "gpus_per_node": per_node, "mem_mb": 2000, "partition": "multi"}
    ws.write_config(cfg)
    t0 = time.monotonic()
    ws.slurm(f"runs/{run}/train_summary.json", env={"SNAKELLM_SLURM_GPU_PARTITION": "multi"})
    TIMINGS[f"pretrain {nodes}x{per_node} via sbatch"] = time.monotonic() - t0
    t0 = time.monotonic()
    ws.run(f"runs/{ref}/train_summary.json", "--set-resources", f"pretrain:tasks={world}")
    TIMINGS[f"pretrain 1x{world} torchrun (reference)"] = time.monotonic() - t0

    (job,) = [j for j, (rule, wc) in ws.slurm_jobs().items() if rule == "pretrain" and wc == run]
    srun = (
        f"srun --nodes={nodes} --ntasks={world} --ntasks-per-node={per_node} --cpus-per-task=1 "
        "--kill-on-bad-exit=1 snakellm train "
    )
    assert srun in ws.slurm_log(job)
    records = {r["JobID"]: r for r in sacct(job)}
    assert records[job]["State"] == "COMPLETED" and records[f"{job}.0"]["NTasks"] == str(world), records
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", job, "--format=NodeList,NNodes"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["node[1-2]|2"], out
    log = ws.path(f"logs/pretrain/{run}.log").read_text()
    ranks = ", ".join(str(r) for r in range(per_node))
    expected = (
        f"ranks: node1: ranks {','.join(str(r) for r in range(per_node))} (local {ranks.replace(', ', ',')}); "
        f"node2: ranks {','.join(str(per_node + r) for r in range(per_node))} (local {ranks.replace(', ', ',')}); "
        "rendezvous node1:"
    )
    assert expected in log, log
    assert f"world {world} (srun)" in log

    a = json.loads(ws.path(f"runs/{run}/train_summary.json").read_text())
    b = json.loads(ws.path(f"runs/{ref}/train_summary.json").read_text())
    assert a["world_size"] == b["world_size"] == world and a["iteration"] == b["iteration"] == MULTI_TRAIN["steps"]
    assert train_losses(ws, run) == train_losses(ws, ref)  # exact float equality, every step
    assert a["replica_weight_digests"] == b["replica_weight_digests"]  # the final weights, bit for bit


def test_a_rank_hanging_on_the_second_node_is_named_and_the_retry_resumes(multi):
    """A rank on node2 stops (SIGSTOP: alive, silent, holding its GPU) mid-run: rank 0's watchdog names
    it within train.collective_timeout and exits 124, `srun --kill-on-bad-exit=1` ends the stopped
    rank and the step instead of leaving the allocation held until the time limit, and the retry
    (train.retries: a new `snakellm train` in the same allocation) resumes from the last checkpoint."""
    ws = multi
    run, timeout, steps = "hang", 8, 60
    cfg = ws.read_config()
    cfg["runs"][run] = {
        "tokenizer": "spm2k",
        "model": {"preset": "tiny"},
        "train": dict(
            cfg["runs"]["tiny"]["train"],
            **dict(MULTI_TRAIN, steps=steps, save_interval=4, eval_interval=1000, eval_iters=0, log_interval=5),
            collective_timeout=timeout,
            retries=1,
        ),
        "parallel": {"threads": 1},
    }
    ws.write_config(cfg)
    ckpts = ws.path(f"runs/{run}/checkpoints")
    record = ws.path(f"runs/{run}/watchdog.log")

    def latest() -> int:
        p = ckpts / "latest_checkpointed_iteration.txt"
        return int(p.read_text()) if p.exists() else 0

    def step0_state(job: str) -> str:
        return next((r["State"] for r in sacct(job) if r["JobID"] == f"{job}.0"), "PENDING")

    jobs = lambda: sorted((j for j, (r, wc) in ws.slurm_jobs().items() if r == "pretrain" and wc == run), key=int)  # noqa: E731
    t0 = time.monotonic()
    proc = ws.slurm(f"runs/{run}/train_summary.json", env=multi_env(2, 1), background=True)
    try:
        job = wait_for("the pretrain job", lambda: jobs()[:1], proc=proc)[0]
        pids = wait_for("both ranks", lambda: (p := rank_pids(job)) and len(p) == 2 and p, proc=proc)
        first = wait_for("a first checkpoint", latest, proc=proc)
        os.kill(pids[1], signal.SIGSTOP)
        t_stop = time.monotonic()
        assert latest() < steps, "the run finished before a rank could be stopped"
        wait_for("the watchdog's record", lambda: record.exists() and record.read_text(), timeout=120, proc=proc)
        named_after = time.monotonic() - t_stop
        wait_for(
            "the first step to end", lambda: step0_state(job) not in ("RUNNING", "PENDING"), timeout=120, proc=proc
        )
        ended_after = time.monotonic() - t_stop
        assert proc.wait(timeout=600) == 0, proc.log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        ws.cancel_leftovers()
    TIMINGS["rank hang on node2 + retry"] = time.monotonic() - t0
    text = record.read_text()
    assert "rank 0 made no progress for" in text and "hanging: rank 1 (host node2, local rank 0): last at step" in text
    assert timeout <= named_after < timeout + 30, named_after
    assert ended_after < timeout + 45, ended_after  # not held until the 10-minute time limit
    steps_ = {r["JobID"]: r for r in sacct(job)}
    assert steps_[f"{job}.0"]["ExitCode"] == "124:0", steps_  # the watchdog's exit, through srun
    assert steps_[f"{job}.1"]["State"] == "COMPLETED", steps_  # the retry, in the same allocation
    stat = Path(f"/proc/{pids[1]}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"  # the stopped rank was killed
    log = ws.path(f"logs/pretrain/{run}.log").read_text()  # the retry's
    m = re.search(r"resumed from \S+ \(iteration (\d+)", log)
    assert m and int(m.group(1)) >= first, log
    summary = json.loads(ws.path(f"runs/{run}/train_summary.json").read_text())
    assert summary["iteration"] == steps and summary["world_size"] == 2


def node_veth(node: str) -> str:
    """The host end of `node`'s veth pair, as slurm-up.sh listed it."""
    for line in (SLURM_DIR / "run" / "netns.list").read_text().splitlines()[1:]:
        ns, veth = line.split()
        if ns.endswith(f"-{node}"):
            return veth
    raise AssertionError(f"{node} not in {SLURM_DIR / 'run' / 'netns.list'}")


def node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout.strip()


def test_a_node_cut_off_mid_run_fails_the_job_and_the_next_attempt_resumes(multi):
    """node2's network goes away mid-run (its veth is taken down: the node is alive but unreachable,
    as when a switch port or a host dies). Rank 0 names rank 1 within the collective timeout and
    exits; Slurm finds node2 not responding and ends the job (NODE_FAIL); once the node is back
    the next attempt (Slurm's requeue or the profile's retry) resumes from the last checkpoint."""
    ws = multi
    run, timeout = "cut", 8
    cfg = ws.read_config()
    cfg["runs"][run] = {
        "tokenizer": "spm2k",
        "model": {"preset": "tiny"},
        "train": dict(
            cfg["runs"]["tiny"]["train"],
            **dict(MULTI_TRAIN, steps=60, save_interval=4, eval_interval=1000, eval_iters=0, log_interval=5),
            collective_timeout=timeout,
            retries=1,
        ),
        "parallel": {"threads": 1},
    }
    ws.write_config(cfg)
    ckpts = ws.path(f"runs/{run}/checkpoints")
    veth = node_veth("node2")

    def latest() -> int:
        p = ckpts / "latest_checkpointed_iteration.txt"
        return int(p.read_text()) if p.exists() else 0

    jobs = lambda: sorted((j for j, (r, wc) in ws.slurm_jobs().items() if r == "pretrain" and wc == run), key=int)  # noqa: E731
    t0 = time.monotonic()
    proc = ws.slurm(f"runs/{run}/train_summary.json", env=multi_env(2, 1), background=True)
    try:
        job = wait_for("the pretrain job", lambda: jobs()[:1], proc=proc)[0]
        first = wait_for("a first checkpoint", latest, proc=proc)
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        t_cut = time.monotonic()
        # Slurm declares the node dead after SlurmdTimeout (30 s) and ends the job with NODE_FAIL
        wait_for("node2 to be marked down", lambda: node_state("node2").startswith("down"), timeout=180, proc=proc)
        down_after = time.monotonic() - t_cut
        states = [r["State"] for r in sacct(job, duplicates=True) if r["JobID"] == job]
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        assert proc.wait(timeout=600) == 0, proc.log_path.read_text()
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], capture_output=True)
        if proc.poll() is None:
            proc.kill()
        ws.cancel_leftovers()
        wait_for("node2 back", lambda: node_state("node2") in ("idle", "mix", "alloc"), timeout=120)
    TIMINGS["node2 cut off + resume"] = time.monotonic() - t0
    assert "hanging: rank 1 (host node2, local rank 0)" in ws.path(f"runs/{run}/watchdog.log").read_text()
    all_states = [r["State"] for j in jobs() for r in sacct(j, duplicates=True) if r["JobID"] == j]
    assert "NODE_FAIL" in all_states or "FAILED" in all_states or "REQUEUED" in all_states, (states, all_states)
    assert down_after < 120
    log = ws.path(f"logs/pretrain/{run}.log").read_text()  # the last attempt's
    m = re.search(r"resumed from \S+ \(iteration (\d+)", log)
    assert m and int(m.group(1)) >= first, log
    summary = json.loads(ws.path(f"runs/{run}/train_summary.json").read_text())
    assert summary["iteration"] == 60 and summary["world_size"] == 2


# ---------------------------------------------------------------- resources from config: runs and fine-tunes

FT_EXAMPLE = REPO / "config" / "examples" / "tiny-squad-finetune.yaml"


def alloc(job_id: str) -> dict[str, str]:
    """The job's allocation as Slurm recorded it: AllocTRES (cpu, mem, gres/gpu), time limit, partition."""
    fmt = "AllocTRES,Timelimit,Partition,NNodes"
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", job_id, f"--format={fmt}"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    rec = dict(zip(fmt.split(","), out.split("|")))
    rec.update(kv.split("=", 1) for kv in rec.pop("AllocTRES").split(",") if "=" in kv)
    return rec


def test_two_runs_with_their_own_resources_get_their_own_allocations(built):
    """Two runs of one workflow, each with its own `resources:` (over the profile's site defaults):
    two different Slurm allocations, read back from sacct."""
    ws, _ = built
    cfg = ws.read_config()
    train = dict(cfg["runs"]["tiny"]["train"], steps=4, save_interval=4, eval_interval=4, eval_iters=1)
    cfg["runs"]["wide"] = {
        "tokenizer": "spm2k",
        "train": train,
        "parallel": {"threads": 1},
        "resources": {"gpus_per_node": 2, "cpus_per_gpu": 1, "mem_mb": 3000, "time_limit": 7},
    }
    cfg["runs"]["narrow"] = {
        "tokenizer": "spm2k",
        "train": train,
        "parallel": {"threads": 1},
        "resources": {"gpus_per_node": 1, "cpus_per_gpu": 1, "mem_mb": 2000, "time_limit": "0:09"},
    }
    ws.write_config(cfg)
    t0 = time.monotonic()
    ws.slurm("runs/wide/train_summary.json", "runs/narrow/train_summary.json")
    TIMINGS["two runs, two allocations"] = time.monotonic() - t0
    jobs = {wc: j for j, (rule, wc) in ws.slurm_jobs().items() if rule == "pretrain" and wc in ("wide", "narrow")}
    wide, narrow = alloc(jobs["wide"]), alloc(jobs["narrow"])
    assert (wide["gres/gpu"], wide["cpu"], wide["mem"], wide["Timelimit"]) == ("2", "2", "3000M", "00:07:00"), wide
    assert (narrow["gres/gpu"], narrow["cpu"], narrow["mem"], narrow["Timelimit"]) == ("1", "1", "2000M", "00:09:00")
    assert "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 " in ws.slurm_log(jobs["wide"])
    assert json.loads(ws.path("runs/wide/train_summary.json").read_text())["world_size"] == 2
    assert json.loads(ws.path("runs/narrow/train_summary.json").read_text())["world_size"] == 1


def finetune_config(ws: SlurmWorkspace, steps: int) -> dict:
    """The fine-tuning example (config/examples/tiny-squad-finetune.yaml) on the built run, sized for this
    2-CPU cluster: 2 ranks of 1 CPU (the example's 2 GPUs), evaluations of 1 CPU."""
    cfg = ws.read_config()
    example = yaml.safe_load(FT_EXAMPLE.read_text())
    ft = example["finetune"]["tiny-lora"]  # the SQuAD one (the workspace's resources/ is the default workflow's)
    cfg["sft_data"] = {ft["data"]: example["sft_data"][ft["data"]]}
    cfg["finetune"], cfg["resources"] = {"tiny-lora": ft}, example["resources"]
    ft["train"].update(steps=steps, eval_interval=5, patience=0)
    ft["parallel"] = {"threads": 1}
    cfg["resources"]["finetune"].update(cpus_per_gpu=1, mem_mb=4000)
    return cfg


def test_finetune_example_runs_on_two_ranks_and_is_evaluated_through_sbatch(built):
    """The fine-tuning example through the profile: `finetune` is a 2-GPU job whose rule starts 2 ranks
    with srun (data-parallel over gloo here), each evaluation a 1-GPU job."""
    ws, _ = built
    ws.write_config(finetune_config(ws, steps=20))
    t0 = time.monotonic()
    ws.slurm("runs/tiny/finetune/tiny-lora/finetune_summary.json", "runs/tiny/eval/tiny-lora/tuned/metrics.json")
    TIMINGS["finetune 2 ranks + evaluation"] = time.monotonic() - t0
    jobs = ws.slurm_jobs()
    (ft,) = [j for j, (rule, _) in jobs.items() if rule == "finetune"]
    records = {r["JobID"]: r for r in sacct(ft)}
    assert records[ft]["State"] == "COMPLETED" and "gres/gpu=2" in records[ft]["AllocTRES"], records
    assert records[f"{ft}.0"]["NTasks"] == "2", records  # the rule's srun step: 2 ranks
    assert (
        "srun --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --kill-on-bad-exit=1 snakellm finetune "
        in (ws.slurm_log(ft))
    )
    assert "world 2 = dp 2 x tp 1" in ws.path("logs/finetune/tiny/tiny-lora.log").read_text()
    summary = json.loads(ws.path("runs/tiny/finetune/tiny-lora/finetune_summary.json").read_text())
    assert summary["steps_run"] == 20 and summary["stopped_early"] is None
    evals = [j for j, (rule, _) in jobs.items() if rule.startswith("evaluate")]
    assert evals and all("gres/gpu=1" in alloc_tres for j in evals for alloc_tres in [sacct(j)[0]["AllocTRES"]])
    tuned = json.loads(ws.path("runs/tiny/eval/tiny-lora/tuned/metrics.json").read_text())
    assert tuned["examples"] == 16


def test_finetune_stopped_before_its_time_limit_and_requeued_resumes_each_time(built):
    """A fine-tune, as pretraining: SIGUSR1 to its ranks (what the job's `--signal=USR1@300` sends before
    the time limit) -> checkpoint at the current step, exit 75 -> the profile resubmits it and it resumes
    from exactly that step; `scontrol requeue` of that job -> the same job starts again and resumes."""
    ws, _ = built
    steps = 60
    cfg = finetune_config(ws, steps=steps)
    cfg["finetune"]["stop"] = dict(cfg["finetune"].pop("tiny-lora"))
    ws.write_config(cfg)
    d = ws.path("runs/tiny/finetune/stop")
    log = ws.path("logs/finetune/tiny/stop.log")
    resumed_at = re.compile(r"resumed from \S+ \(iteration (\d+)")

    def latest() -> int:
        p = d / "checkpoints" / "latest_checkpointed_iteration.txt"
        return int(p.read_text()) if p.exists() else 0

    def ft_jobs() -> list[str]:
        return sorted((j for j, (r, wc) in ws.slurm_jobs().items() if r == "finetune" and wc.endswith("stop")), key=int)

    def log_text() -> str:
        return log.read_text() if log.exists() else ""

    t0 = time.monotonic()
    proc = ws.slurm("runs/tiny/finetune/stop/finetune_summary.json", background=True)
    try:
        job = wait_for("the finetune job", lambda: ft_jobs()[:1], proc=proc)[0]
        first = wait_for("a first checkpoint", latest, proc=proc)
        # 1. SIGUSR1 to the ranks, as before the time limit: queued while they are paused, then handled
        pause_ranks(job)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, capture_output=True)
        signal_ranks(job, signal.SIGCONT)
        m = wait_for(
            "the ranks to stop on SIGUSR1", lambda: re.search(r"stopped at iteration (\d+)", log_text()), proc=proc
        )
        stop = int(m.group(1))
        assert first <= stop < steps
        second = wait_for("the resubmitted job", lambda: ft_jobs()[1:2], proc=proc)[0]
        wait_for(f"a resume from iteration {stop}", lambda: f"(iteration {stop}," in log_text(), proc=proc)
        # 2. requeue: the same job id starts again
        pause_ranks(second)
        subprocess.run(["scontrol", "requeue", second], check=True, capture_output=True)
        assert proc.wait(timeout=600) == 0, proc.log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        ws.cancel_leftovers()
    TIMINGS["finetune SIGUSR1 + requeue"] = time.monotonic() - t0
    states = {j: [r["State"] for r in sacct(j, duplicates=True) if r["JobID"] == j] for j in ft_jobs()}
    assert ft_jobs() == [job, second], states  # one resubmission after exit 75; the requeue kept its id
    assert states[job] == ["FAILED"] and states[second][0] == "REQUEUED" and states[second][-1] == "COMPLETED"
    # (the step's own exit code is 75 or, when the first rank's exit 75 made --kill-on-bad-exit end the other
    # after their collective save, a SIGTERM: the log's "stopped at iteration" above is the evidence)
    resumes = [int(m) for m in resumed_at.findall(log_text())]  # the last start's log
    assert resumes and resumes[0] >= stop, log_text()[-3000:]
    summary = json.loads((d / "finetune_summary.json").read_text())
    assert summary["steps_run"] == steps and summary["stopped_early"] is None
    assert "world 2 = dp 2 x tp 1" in log_text()


# ---------------------------------------------------------------- the same rule, locally


def test_the_same_rule_runs_locally_without_retraining_and_under_torchrun(built):
    """The local profile finds the Slurm-built runs up to date (the launch prefix is computed
    from resources, which Snakemake leaves out of its params rerun trigger), and the same
    pretrain rule with `--set-resources pretrain:tasks=2` starts its ranks with torchrun."""
    ws, _ = built
    cfg = ws.read_config()
    # the training runs the Slurm tests built (the later stages of runs added by other tests are not built)
    built_runs = [
        f"runs/{r}/train_summary.json" for r in cfg["runs"] if ws.path(f"runs/{r}/train_summary.json").exists()
    ]
    assert built_runs and ws.nothing_to_do(*built_runs)
    cfg["runs"]["local"] = {
        "tokenizer": "spm2k",
        "model": {"preset": "tiny"},
        "train": dict(cfg["runs"]["tiny"]["train"], steps=4, save_interval=2),
    }
    ws.write_config(cfg)
    proc = ws.run("runs/local/train_summary.json", "--set-resources", "pretrain:tasks=2", "-p")
    assert (
        "torchrun --standalone --nnodes=1 --nproc-per-node=2 --no-python snakellm train " in proc.stdout + proc.stderr
    )
    summary = json.loads(ws.path("runs/local/train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["iteration"] == 4
    assert "world 2 (torchrun)" in ws.path("logs/pretrain/local.log").read_text()


@pytest.fixture(scope="module", autouse=True)
def report_timings(request):
    yield
    if TIMINGS:
        lines = [f"  {k:<32} {v:6.1f} s" for k, v in TIMINGS.items()]
        if SLURM_DIR.is_dir():  # also kept for whoever reads the CI machine afterwards
            (SLURM_DIR / "test-timings.json").write_text(json.dumps(TIMINGS, indent=1) + "\n")
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("\nSlurm test timings:\n" + "\n".join(lines))
