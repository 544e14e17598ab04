"""Pipeline parallelism and activation recomputation on the CPU: real `snakellm train` under torchrun (gloo).

The bars of issue 29, in fp32 on a 4-layer GPT (hidden 64, tied embeddings), 20 steps of 4 micro-batches:
pipeline parallel size 2 with megatron-core's 1F1B schedule, its interleaved schedule (2 virtual stages,
one layer a chunk), and pp 2 x tp 2 with sequence parallelism give the losses of one process within 1e-5
(the weights are initialised the same at every layout: snakellm.models.build.init_weights); activation
recomputation (full in the 1F1B run, selective in the interleaved one) changes nothing; and a checkpoint
written at tp 2 x pp 2 (and one written by the interleaved run, two chunks a rank) loads at tp 1 x pp 1 bit
for bit (every weight and Adam state compared with the bytes written) and resumes there on the same losses.

Each run pays megatron-core's import and a rendezvous (10-25 s on 2 cores), so the runs are few and shared
through module fixtures; the whole file takes about 3 minutes, hence `slow`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_venv, run_probe
from test_train import make_blend

BIN = Path(sys.executable).parent
STEPS = 20
ARGS = [
    "--preset",
    "tiny",
    "--num-layers",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--warmup-steps",
    "5",
    "--steps",
    str(STEPS),
    "--save-interval",
    "10",
    "--keep-last",
    "10",
    "--eval-iters",
    "3",
    "--eval-interval",
    "10",
    "--log-interval",
    "1",
    "--split",
    "90,10,0",
    "--loss",
    "megatron",
    "--threads",
    "1",
    "--no-progress",
    "--no-tensorboard",
    "--precision",
    "fp32",
]

pytestmark = pytest.mark.slow


def train(root: Path, run: str, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    launch = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "--no-python"] if nproc > 1 else []
    cmd = [
        *launch,
        str(BIN / "snakellm"),
        "train",
        "--blend",
        "data/tokens/synth/blend.json",
        "--run-dir",
        f"runs/{run}",
    ]
    proc = subprocess.run(
        [*cmd, *ARGS, *extra], cwd=root, env=env_with_venv(), capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def records(root: Path, run: str) -> tuple[dict[int, dict], dict[int, float]]:
    """(training records by step, validation losses by step)."""
    recs = [json.loads(ln) for ln in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}, {
        r["step"]: r["val_loss"] for r in recs if r.get("val_loss") is not None
    }


def assert_same_losses(run: dict[int, dict], ref: dict[int, dict], steps: range) -> None:
    assert sorted(run) == list(steps)
    for step in steps:
        a, b = run[step], ref[step]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (step, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), (step, a, b)


def probe(root: Path, run: str, iteration: int) -> dict:
    """tests/reshard_probe.py in one process (tp 1 x pp 1) on ``runs/RUN``'s ``iter_ITERATION``."""
    script = Path(__file__).parent / "reshard_probe.py"
    cmd = [sys.executable, str(script), str(iteration), "--blend", "data/tokens/synth/blend.json"]
    return run_probe([*cmd, "--run-dir", f"runs/{run}", *ARGS], root)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("pipeline")
    make_blend(r)
    train(r, "pp1", 1)
    return r


@pytest.fixture(scope="module")
def pp2_tp2(root) -> Path:
    proc = train(root, "pp2-tp2", 4, "--pp", "2", "--tp", "2", "--sequence-parallel")
    assert "= dp 1 x tp 2 x pp 2;" in proc.stderr
    return root


def test_1f1b_pp2_with_full_recomputation_gives_the_losses_of_one_process(root):
    proc = train(root, "pp2", 2, "--pp", "2", "--recompute", "full", "--recompute-num-layers", "1")
    assert "= dp 1 x tp 1 x pp 2;" in proc.stderr and "; recompute full" in proc.stderr
    (run, val), (ref, ref_val) = records(root, "pp2"), records(root, "pp1")
    assert_same_losses(run, ref, range(1, STEPS + 1))
    assert val.keys() == ref_val.keys() == {10, 20}
    assert all(abs(val[k] - ref_val[k]) <= 1e-5 * ref_val[k] for k in val)
    assert ref[STEPS]["loss"] < ref[1]["loss"] - 0.3  # it learns: the comparison is not of two flat lines


def test_interleaved_pp2_with_selective_recomputation_gives_the_losses_of_one_process(root):
    proc = train(root, "vpp2", 2, "--pp", "2", "--virtual-pp", "2", "--recompute", "selective")
    assert "interleaved schedule over 2 virtual stages" in proc.stderr and "; recompute selective" in proc.stderr
    (run, val), (ref, ref_val) = records(root, "vpp2"), records(root, "pp1")
    assert_same_losses(run, ref, range(1, STEPS + 1))
    assert all(abs(val[k] - ref_val[k]) <= 1e-5 * ref_val[k] for k in ref_val)
    # its checkpoint (two chunks a rank) loads in one process bit for bit
    assert probe(root, "vpp2", 20)["differ"] == []


def test_pp2_tp2_sequence_parallel_gives_the_losses_of_one_process(pp2_tp2):
    assert_same_losses(records(pp2_tp2, "pp2-tp2")[0], records(pp2_tp2, "pp1")[0], range(1, STEPS + 1))


def test_a_tp2_pp2_checkpoint_loads_bit_exactly_and_resumes_at_tp1_pp1(pp2_tp2):
    root = pp2_tp2
    shutil.copytree(root / "runs/pp2-tp2", root / "runs/to-tp1")
    (root / "runs/to-tp1/checkpoints/latest_checkpointed_iteration.txt").write_text("10\n")
    # every weight and Adam state that one process loads from the 4 ranks' checkpoint is the bytes they wrote
    res = probe(root, "to-tp1", 10)
    assert res["differ"] == [] and res["compared"] >= 3 * 16  # model, exp_avg, exp_avg_sq of 16+ tensors each
    # and training goes on from it in one process
    proc = train(root, "to-tp1", 1)
    assert "was written at tp 2 x pp 2, this job runs tp 1 x pp 1" in proc.stderr
    assert "resumed from runs/to-tp1/checkpoints/iter_0000010" in proc.stderr
    resumed, ref = records(root, "to-tp1")[0], records(root, "pp2-tp2")[0]
    assert_same_losses({k: v for k, v in resumed.items() if k > 10}, ref, range(11, STEPS + 1))
