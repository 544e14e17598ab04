"""`snakellm train` on CPU: real runs of the command on a tiny model and synthetic data.

The token files are written with megatron-core's own IndexedDatasetBuilder (a
sparse bigram chain over 256 ids, so there is something to learn), with a
blend.json of the tokenization stage's shape. Every training run is a real
`snakellm train` subprocess (gloo, fp32); kills and stops use real signals.
Checks that need no training (batch/parallelism arithmetic, resume
preconditions) call `main()` in-process: they fail before torch is imported.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, env_with_venv

BIN = Path(sys.executable).parent
VOCAB = 256

# The tiny model at test size: every run is a few seconds, most of it `import megatron.core`.
BASE = [
    "--preset",
    "tiny",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--warmup-steps",
    "5",
    "--eval-iters",
    "2",
    "--eval-interval",
    "10",
    "--log-interval",
    "1",
    "--split",
    "90,10,0",
    "--threads",
    "1",
    "--no-progress",
    "--no-tensorboard",
]


def make_blend(root: Path, docs: int = 240, seed: int = 0) -> Path:
    """data/tokens/synth/{a,b}/chunk-00000_text_document.{bin,idx} + blend.json, paths relative to ``root``."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    succ = rng.integers(1, VOCAB, size=(VOCAB, 3))
    prefixes = []
    for name in ("a", "b"):
        prefix = f"data/tokens/synth/{name}/chunk-00000_text_document"
        (root / prefix).parent.mkdir(parents=True, exist_ok=True)
        builder = IndexedDatasetBuilder(str(root / f"{prefix}.bin"), dtype=np.uint16)
        for _ in range(docs // 2):
            toks = [int(rng.integers(1, VOCAB))]
            for _ in range(int(rng.integers(40, 300))):
                toks.append(int(succ[toks[-1], rng.integers(0, 3)]))
            toks.append(0)  # end of document
            builder.add_document(torch.tensor(toks), [len(toks)])
        builder.finalize(str(root / f"{prefix}.idx"))
        prefixes.append(prefix)
    blend = root / "data/tokens/synth/blend.json"
    blend.write_text(
        json.dumps(
            {
                "data_prefix": [0.6, prefixes[0], 0.4, prefixes[1]],
                "tokenizer": {"name": "synth", "kind": "synthetic", "vocab_size": VOCAB, "eod_id": 0},
            }
        )
    )
    return blend


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synth")
    make_blend(root)
    return root


def train_cmd(run: str, *extra: str) -> list[str]:
    return [
        str(BIN / "snakellm"),
        "train",
        "--blend",
        "data/tokens/synth/blend.json",
        "--run-dir",
        f"runs/{run}",
        *BASE,
        *extra,
    ]


def train(root: Path, run: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        train_cmd(run, *extra), cwd=root, env=env_with_venv(), capture_output=True, text=True, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakellm train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def live_steps(root: Path, run: str) -> list[int]:
    p = root / "runs" / run / "checkpoints" / "metrics.live.jsonl"
    if not p.exists():
        return []
    steps = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            steps.append(rec["step"])
    return steps


def start_and_signal(root: Path, run: str, at_step: int, sig: int, *extra: str) -> tuple[int, str, int]:
    """Start a run, send ``sig`` once it has logged step >= ``at_step``; (exit status, stderr, last logged step)."""
    log = root / f"{run}.{time.time_ns()}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(train_cmd(run, *extra), cwd=root, env=env_with_venv(), stdout=fh, stderr=fh)
    deadline = time.time() + 240
    try:
        while True:
            steps = live_steps(root, run)
            if steps and steps[-1] >= at_step:
                break
            if proc.poll() is not None:
                raise AssertionError(
                    f"the run ended (status {proc.returncode}) before step {at_step}:\n{log.read_text()[-3000:]}"
                )
            if time.time() > deadline:
                raise AssertionError(f"no step {at_step} within 240 s")
            time.sleep(0.02)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, log.read_text(), live_steps(root, run)[-1]


def losses(root: Path, run: str) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def latest(root: Path, run: str) -> int:
    return int((root / "runs" / run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


RESUME = ["--steps", "40", "--save-interval", "5", "--keep-last", "2"]


@pytest.fixture(scope="module")
def reference(synth) -> dict[int, float]:
    """The uninterrupted run every interrupted one must reproduce exactly."""
    train(synth, "ref", *RESUME)
    return losses(synth, "ref")


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.slow
def test_sigkill_then_two_reruns_match_an_uninterrupted_run(synth, reference):
    """Killed with SIGKILL, rerun and killed again, rerun to the end: the same losses, bit for bit."""
    rc, _, seen = start_and_signal(synth, "kill", 12, signal.SIGKILL, *RESUME)
    assert rc == -signal.SIGKILL
    first = latest(synth, "kill")
    assert 5 <= first < 40 and not (synth / "runs/kill/train_summary.json").exists()
    # the second attempt resumes and is killed too (a resume that only works once is what failed before)
    rc, _, seen2 = start_and_signal(synth, "kill", first + 8, signal.SIGKILL, *RESUME)
    assert rc == -signal.SIGKILL
    second = latest(synth, "kill")
    assert second > first
    proc = train(synth, "kill", *RESUME)
    assert f"resumed from runs/kill/checkpoints/iter_{second:07d}" in proc.stderr
    assert losses(synth, "kill") == reference  # exact: model, optimizer, schedule, RNG and data position
    # each resumed session is marked in the metrics, and the report shows three sessions
    recs = [json.loads(line) for line in (synth / "runs/kill/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("resumed")] == [first, second]
    from snakellm.report import train as report_train

    assert report_train.segments(recs) == [(1, first), (first + 1, second), (second + 1, 40)]
    summary = json.loads((synth / "runs/kill/train_summary.json").read_text())
    assert summary["iteration"] == 40 and summary["checkpoint"].endswith("iter_0000040")
    ckpts = sorted(p.name for p in (synth / "runs/kill/checkpoints").glob("iter_*"))
    assert "iter_0000040" in ckpts and len(ckpts) <= 3  # keep_last 2 + the best
    assert not list((synth / "runs/kill/checkpoints").glob(".iter_*"))  # no partial save left behind


@pytest.mark.slow
def test_sigterm_and_sigusr1_stop_cleanly_with_a_checkpoint_and_resume_exactly(synth, reference):
    for sig, at in ((signal.SIGTERM, 6), (signal.SIGUSR1, 0)):
        at = at or latest(synth, "stop") + 6
        rc, err, last = start_and_signal(synth, "stop", at, sig, *RESUME)
        assert rc == 75, err[-3000:]
        assert f"received {signal.Signals(sig).name}" in err
        stopped = latest(synth, "stop")
        assert stopped == last  # the checkpoint is at the step it stopped at, not at the last interval
        assert (synth / f"runs/stop/checkpoints/iter_{stopped:07d}/metadata.json").is_file()
        assert not (synth / "runs/stop/train_summary.json").exists()
    train(synth, "stop", *RESUME)
    assert losses(synth, "stop") == reference


@pytest.mark.slow
def test_max_time_stops_cleanly_with_a_checkpoint(synth):
    proc = train(
        synth,
        "maxtime",
        "--steps",
        "100000",
        "--save-interval",
        "100000",
        "--max-time",
        "12",
        "--eval-iters",
        "0",
        check=False,
    )
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "max time 12" in proc.stderr
    it = latest(synth, "maxtime")
    assert it == live_steps(synth, "maxtime")[-1] > 0


# ----------------------------------------------------------------------------- settings and checkpoints


@pytest.mark.slow
def test_changed_settings_fail_clearly_or_archive_the_old_checkpoints(synth):
    train(synth, "change", "--steps", "4", "--warmup-steps", "1", "--save-interval", "2")
    # operational settings (intervals, logging, keep_last, max_time) are compatible: resume at the end
    proc = train(synth, "change", "--steps", "4", "--warmup-steps", "1", "--save-interval", "3", "--log-interval", "2")
    assert "resumed from runs/change/checkpoints/iter_0000004" in proc.stderr
    proc = train(
        synth,
        "change",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--save-interval",
        "2",
        "--hidden-size",
        "32",
        "--on-config-change",
        "error",
        check=False,
    )
    assert proc.returncode == 2
    assert "model.hidden_size: 64 -> 32" in proc.stderr and "--on-config-change archive" in proc.stderr
    proc = train(
        synth,
        "change",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--save-interval",
        "2",
        "--hidden-size",
        "32",
        "--on-config-change",
        "archive",
    )
    archived = list((synth / "runs").glob("change/checkpoints.old-*"))
    assert len(archived) == 1 and (archived[0] / "iter_0000004").is_dir()
    assert "checkpoints moved aside" in proc.stderr and "resumed" not in proc.stderr
    cfg = json.loads((synth / "runs/change/checkpoints/run_config.json").read_text())
    assert cfg["config"]["model"]["hidden_size"] == 32


def test_resume_required_but_missing_is_an_error(synth, tmp_path, capsys, monkeypatch):
    from snakellm.steps.train import main

    monkeypatch.chdir(synth)  # the blend's token paths are relative to the working directory
    blend = "data/tokens/synth/blend.json"
    for setup, why in (("missing", "directory missing"), ("empty", "no latest_checkpointed_iteration.txt")):
        run = tmp_path / setup
        if setup == "empty":
            (run / "checkpoints").mkdir(parents=True)
        rc = main(["--blend", blend, "--run-dir", str(run), *BASE, "--steps", "10", "--resume", "require"])
        err = capsys.readouterr().err
        assert rc == 2 and "--resume require: no checkpoint to resume from" in err and why in err
        assert not (run / "checkpoints" / "run_config.json").exists()
    # a tracker naming a checkpoint that is not there is an error in every mode, never a fresh start
    run = tmp_path / "dangling"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints/latest_checkpointed_iteration.txt").write_text("20\n")
    rc = main(["--blend", blend, "--run-dir", str(run), *BASE, "--steps", "10"])
    assert rc == 2 and "names iteration 20 but" in capsys.readouterr().err
    # so are complete checkpoints without a tracker
    (run / "checkpoints/latest_checkpointed_iteration.txt").unlink()
    (run / "checkpoints/iter_0000020").mkdir()
    for f in ("metadata.json", "common.pt"):
        (run / "checkpoints/iter_0000020" / f).write_text("{}")
    rc = main(["--blend", blend, "--run-dir", str(run), *BASE, "--steps", "10"])
    assert rc == 2 and "no latest_checkpointed_iteration.txt" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env, extra, expected",
    [
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            ["--global-batch-size", "12"],
            "global batch size 12 is not divisible by micro batch size 4 x data-parallel size 2 (= 8",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0"},
            ["--tp", "2"],
            "world size 3 is not divisible by tensor parallel size 2 x pipeline parallel size 1 (= 2)",
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            ["--tp", "2", "--global-batch-size", "4"],
            "global batch size 4 is not divisible by micro batch size 4 x data-parallel size 2 (= 8; data-parallel "
            "size = world size 4 / (tp 2 x pp 1))",
        ),
        ({}, ["--tp", "3"], "num_attention_heads 4 is not divisible by tensor parallel size 3"),
        ({}, ["--pp", "3"], "num_layers 2 is not divisible by pp 3 x virtual_pp 1"),
        ({}, ["--virtual-pp", "2"], "virtual_pp 2: virtual pipeline stages need pp > 1"),
        (
            {"RANK": "0", "WORLD_SIZE": "4"},
            ["--pp", "2", "--virtual-pp", "2", "--num-layers", "4", "--distributed-optimizer"],
            "--distributed-optimizer shards one model chunk's gradient buffers: it needs --virtual-pp 1 (got 2)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            ["--pp", "2", "--virtual-pp", "2", "--num-layers", "4", "--global-batch-size", "12"],
            "--global-batch-size 12: virtual_pp 2 (interleaved schedule) needs the micro batches per step and "
            "data-parallel rank (3 = global_batch_size / (micro_batch_size x data-parallel size)) to be a multiple "
            "of pp 2",
        ),
        (
            {},
            ["--recompute", "full", "--recompute-num-layers", "3"],
            "recompute_num_layers 3 (recompute full, uniform) must be between 1 and the layers of one pipeline stage",
        ),
        ({}, ["--hidden-size", "66"], "hidden_size 66 is not divisible by num_attention_heads 4"),
        ({}, ["--split", "100,0,0"], "leave none for validation with split '100,0,0'"),
        (
            {},
            ["--overlap-param-gather"],
            "--overlap-param-gather overlaps the distributed optimizer's all-gather of the updated weights: it needs "
            "--distributed-optimizer",
        ),
        (
            {},
            ["--fsdp", "--distributed-optimizer"],
            "--fsdp already shards the optimizer states (and the parameters and gradients): drop "
            "--distributed-optimizer",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            ["--fsdp", "--pp", "2"],
            "--fsdp shards over the data-parallel ranks of one pipeline stage: it needs --pp 1 (got 2)",
        ),
        (
            {},
            ["--sequence-parallel"],
            "--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp > 1",
        ),
    ],
)
def test_batch_and_parallelism_mismatches_name_the_numbers(synth, monkeypatch, capsys, env, extra, expected):
    from snakellm.steps.train import main

    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_STEP_ID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(synth)
    rc = main(["--blend", "data/tokens/synth/blend.json", "--run-dir", "runs/never", *BASE, "--steps", "10", *extra])
    assert rc == 2
    assert expected in capsys.readouterr().err
    assert not (synth / "runs/never").exists()


@pytest.mark.slow  # 0.9 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_a_real_launch_reports_a_mismatch_with_exit_status_2_before_importing_torch(synth):
    env = {**env_with_venv(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    proc = subprocess.run(
        train_cmd("never", "--steps", "4", "--global-batch-size", "6"),
        cwd=synth,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "global batch size 6 is not divisible by micro batch size 4 x data-parallel size 2" in proc.stderr
    probe = (
        "import sys; from snakellm.steps.train import main; rc = main(sys.argv[1:]); "
        "print(rc, 'torch' in sys.modules, 'megatron' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *train_cmd("never", "--steps", "4", "--global-batch-size", "6")[2:]],
        cwd=synth,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert out.split() == ["2", "False", "False"]


def test_tensor_parallelism_with_dropout_on_the_cpu_is_refused_before_anything_starts(synth, monkeypatch, capsys):
    """megatron-core's CUDA RNG tracker gives each tensor-parallel rank its dropout stream; the CPU has none."""
    from snakellm.steps.train import main

    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(synth)
    args = ["--blend", "data/tokens/synth/blend.json", "--run-dir", "runs/never", *BASE, "--steps", "10"]
    rc = main([*args, "--tp", "2", "--hidden-dropout", "0.1", "--device", "cpu"])
    assert rc == 2
    assert "tensor parallel size 2 with dropout needs GPUs" in capsys.readouterr().err
    assert not (synth / "runs/never").exists()


def test_help_lists_every_setting():
    out = subprocess.run([str(BIN / "snakellm"), "train", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in (
        "--global-batch-size",
        "--max-time",
        "--resume",
        "--on-config-change",
        "--tp",
        "--sequence-parallel",
        "--distributed-optimizer",
        "--dry-run",
        "exit status",
    ):
        assert flag in out


# ----------------------------------------------------------------------------- the default run learns


@pytest.mark.slow
def test_default_tiny_settings_learn(default_workflow):
    """config/config.yaml's tiny run, as the default workflow trains it on the shipped corpus: the loss falls.

    (The session's default-workflow build: a training run of its own here cost ~100 s of CPU for the same
    settings on a synthetic blend.)"""
    run = yaml.safe_load((REPO / "config/config.yaml").read_text())["runs"]["tiny"]
    assert run["model"] == {"preset": "tiny"}
    t = run["train"]
    ws = default_workflow
    s = json.loads(ws.path("runs/tiny/train_summary.json").read_text())
    assert s["iteration"] == t["steps"] and s["precision"] == "fp32"
    assert s["final_loss"] < s["first_loss"] - 1.0, s
    recs = [json.loads(ln) for ln in ws.path("runs/tiny/metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) == t["steps"] // t["eval_interval"] and vals[-1] < vals[0] - 0.5
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(recs[-1])
    assert s["model_parameters"] == s["params"]  # the MFU formula's N is the model's real parameter count
    ckpts = ws.path("runs/tiny/checkpoints")
    assert (ckpts / f"iter_{t['steps']:07d}").is_dir()
    best = json.loads((ckpts / "best.json").read_text())  # kept besides the last K
    assert best == s["best"] and (ckpts / f"iter_{best['iteration']:07d}").is_dir()
    assert best["val_loss"] == min(
        vals[i] for i, r in enumerate([r for r in recs if "val_loss" in r]) if r["step"] % t["save_interval"] == 0
    )
    assert list(ws.path("runs/tiny/tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_llama_style_model_trains_and_counts_its_parameters(synth):
    train(
        synth,
        "llama",
        "--preset",
        "tiny-llama",
        "--seq-length",
        "64",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--save-interval",
        "3",
    )
    s = json.loads((synth / "runs/llama/train_summary.json").read_text())
    assert s["model"]["position_embedding"] == "rope" and s["model"]["num_query_groups"] == 2
    assert s["model_parameters"] == s["params"]
