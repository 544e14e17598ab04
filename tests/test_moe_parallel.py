"""Expert parallelism on the CPU: real ``snakellm train`` of a tiny Mixtral under torchrun (gloo).

Two ranks, data-parallel 2, with the experts replicated (``--ep 1``) or split over both ranks
(``--ep 2``: megatron-core's alltoall dispatcher sends each token to the rank holding its expert):
the same losses and gradient norms over 20 steps (fp32, 1e-5). A checkpoint written at EP 2 holds
every expert under its global number (megatron-core's ``dist_checkpointing`` layout), so a run at
EP 1 resumes from it and goes on exactly as the EP 2 run does. Router health (tokens per expert,
the load-balancing loss, dropped tokens) is in every step's record.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_venv
from test_train import BASE, make_blend

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--no-python"]
MOE = [*BASE[2:], "--preset", "tiny-mixtral", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
STEPS = ["--steps", "20", "--save-interval", "10", "--keep-last", "5"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("moe")
    make_blend(r)
    return r


def train(root: Path, run: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        *TORCHRUN,
        str(BIN / "snakellm"),
        "train",
        "--blend",
        "data/tokens/synth/blend.json",
        "--run-dir",
        f"runs/{run}",
        *MOE,
        *STEPS,
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=root, env=env_with_venv(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def records(root: Path, run: str) -> dict[int, dict]:
    recs = [json.loads(ln) for ln in (root / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


@pytest.mark.slow
def test_ep2_gives_the_losses_of_ep1_and_its_checkpoint_resumes_at_ep1(root):
    train(root, "ep1", "--ep", "1")
    train(root, "ep2", "--ep", "2")
    a, b = records(root, "ep1"), records(root, "ep2")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in a:
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-5 * abs(a[step]["loss"]), (step, a[step], b[step])
        assert abs(a[step]["grad_norm"] - b[step]["grad_norm"]) <= 1e-5 * a[step]["grad_norm"], step
        # router health: every routed token counted (dropless: none dropped), the balance loss of each step
        for r in (a[step], b[step]):
            assert sum(r["moe_tokens_per_expert"]) == 8 * 64 * 2 * 2  # batch x seq x top-2 x layers
            assert r["moe_dropped_tokens"] == 0
            assert r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0
        assert a[step]["moe_tokens_per_expert"] == b[step]["moe_tokens_per_expert"], step
    assert a[20]["loss"] < a[1]["loss"] - 0.5  # it learns

    # the EP 2 checkpoint of step 10, resumed at EP 1: steps 11..20 as the EP 2 run computed them
    shutil.copytree(root / "runs/ep2", root / "runs/ep2-to-ep1")
    (root / "runs/ep2-to-ep1/checkpoints/latest_checkpointed_iteration.txt").write_text("10\n")
    proc = train(root, "ep2-to-ep1", "--ep", "1")
    assert "resumed from runs/ep2-to-ep1/checkpoints/iter_0000010" in proc.stderr
    c = records(root, "ep2-to-ep1")
    for step in range(11, 21):
        assert abs(c[step]["loss"] - b[step]["loss"]) <= 1e-5 * abs(b[step]["loss"]), (step, c[step], b[step])
    # and the weights it loaded are the EP 2 run's, bit for bit: the first step after the resume computes
    # its loss on them at EP 1 and gets the EP 2 run's, exactly
    assert c[11]["loss"] == b[11]["loss"]


def test_ep_checks_name_the_setting(root):
    from snakellm.models import architecture, moe, resolve

    mixtral = resolve("tiny-mixtral")
    assert moe.check_ep(mixtral, 3) == "num_experts 4 is not divisible by ep 3"
    assert "expert parallelism needs a mixture-of-experts model" in moe.check_ep(resolve("tiny"), 2)
    assert "ep 4 must divide the data-parallel size (world 2" in moe.check_ep(mixtral, 4, world=2)
    why = architecture.parallel_conflict({"ep": 2, "distributed_optimizer": True})
    assert why is not None and why[0] == "ep"


@pytest.mark.slow
def test_pipeline_stages_of_a_moe_model_give_one_process_losses_and_router_health(root):
    """pp 2 (megatron-core's schedule, each stage with its layer's router) against one process: the same losses,
    gradient norms and router records (counts and losses gathered over the stages)."""
    base = [str(BIN / "snakellm"), "train", "--blend", "data/tokens/synth/blend.json", *MOE, "--steps", "4"]
    base += ["--warmup-steps", "2"]
    env = env_with_venv()
    for run, launch in (("pp2", [*TORCHRUN, *base, "--pp", "2"]), ("pp1", base)):
        proc = subprocess.run(
            [*launch, "--run-dir", f"runs/{run}", "--no-checkpoints"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = records(root, "pp2"), records(root, "pp1")
    for step in (1, 2, 3, 4):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(b[step][key]), (step, key, a[step], b[step])
        assert a[step]["moe_tokens_per_expert"] == b[step]["moe_tokens_per_expert"]
