"""Expert, tensor and pipeline parallelism of a MoE model on the CPU: real ``snakellm train`` of a tiny
Mixtral under torchrun (gloo), fp32.

Two ranks, data-parallel 2, with the experts replicated (``--ep 1``) or split over both ranks
(``--ep 2``: megatron-core's alltoall dispatcher sends each token to the rank holding its expert):
the same losses and gradient norms over 20 steps (fp32, 1e-5). A checkpoint written at EP 2 holds
every expert under its global number (megatron-core's ``dist_checkpointing`` layout), so a run at
EP 1 resumes from it and goes on exactly as the EP 2 run does. Router health (tokens per expert,
the load-balancing loss, dropped tokens) is in every step's record.

Tensor parallelism splits each expert over the ranks (megatron-core's expert tensor parallelism,
``expert_tensor_parallel_size`` = tp, without Transformer Engine) and needs sequence parallelism: tp 2
gives the losses of tp 1 (loss 1e-5, gradient norm 1e-4, as tests/test_parallel_cpu.py's tp 2 against one
process), its checkpoint loads in one process bit for bit (tests/reshard_probe.py) and resumes there on the
same losses, and the EP 2 checkpoint resumes at tp 2 x ep 1. A pipeline-parallel (pp 2) checkpoint resumes
in one process. The two ``ep`` runs are a module fixture the layout tests reuse as their references.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_venv, run_probe
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


def train(root: Path, run: str, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [
        *(TORCHRUN if nproc == 2 else []),
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


def resume_at(
    root: Path, src: str, run: str, iteration: int, *extra: str, nproc: int = 2
) -> tuple[dict[int, dict], str]:
    """``runs/SRC``'s checkpoint of ``iteration`` resumed as ``runs/RUN`` with ``extra``: its records and log."""
    shutil.copytree(root / "runs" / src, root / "runs" / run)
    (root / "runs" / run / "checkpoints/latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    proc = train(root, run, *extra, nproc=nproc)
    assert f"resumed from runs/{run}/checkpoints/iter_{iteration:07d}" in proc.stderr
    return records(root, run), proc.stderr


def assert_same(run: dict[int, dict], ref: dict[int, dict], steps: range, norm_rtol: float = 1e-5) -> None:
    for step in steps:
        a, b = run[step], ref[step]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (step, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= norm_rtol * b["grad_norm"], (step, a, b)


@pytest.fixture(scope="module")
def ep_runs(root) -> Path:
    """``runs/ep1`` and ``runs/ep2``: 20 steps on two ranks, checkpoints at steps 10 and 20."""
    train(root, "ep1", "--ep", "1")
    train(root, "ep2", "--ep", "2")
    return root


@pytest.mark.slow
def test_ep2_gives_the_losses_of_ep1_and_its_checkpoint_resumes_at_ep1(ep_runs):
    root = ep_runs
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
    c, _ = resume_at(root, "ep2", "ep2-to-ep1", 10, "--ep", "1")
    for step in range(11, 21):
        assert abs(c[step]["loss"] - b[step]["loss"]) <= 1e-5 * abs(b[step]["loss"]), (step, c[step], b[step])
    # and the weights it loaded are the EP 2 run's, bit for bit: the first step after the resume computes
    # its loss on them at EP 1 and gets the EP 2 run's, exactly
    assert c[11]["loss"] == b[11]["loss"]


@pytest.mark.slow
def test_ep2_with_the_distributed_optimizer_gives_the_losses_of_ep1_and_resumes_without_it(ep_runs):
    """``--ep 2 --distributed-optimizer`` on 2 ranks (the dense weights' Adam states split over both, each rank's
    experts' whole on it: expert data-parallel size 1): the EP 1 run's losses and gradient norms; its checkpoint
    of step 10 resumes at EP 1 with the replicated optimizer on the same steps, the first one exactly."""
    root = ep_runs
    proc = train(root, "ep2-do", "--ep", "2", "--distributed-optimizer")
    held = [int(n.replace(",", "")) for n in re.findall(r"holds the Adam states of ([\d,]+) of", proc.stderr)]
    total = int(re.search(r"holds the Adam states of [\d,]+ of ([\d,]+) parameters", proc.stderr)[1].replace(",", ""))
    assert held and all(n < total for n in held), proc.stderr[-2000:]
    b = records(root, "ep2-do")
    assert_same(b, records(root, "ep1"), range(1, 21))
    c, _ = resume_at(root, "ep2-do", "ep2-do-to-ep1", 10, "--ep", "1")
    assert c[11]["loss"] == b[11]["loss"]
    assert_same(c, b, range(11, 21))


@pytest.mark.slow
def test_ep2_of_4_ranks_shards_the_experts_adam_states_over_their_2_expert_data_parallel_ranks(ep_runs):
    """4 ranks at ``--ep 2 --distributed-optimizer`` (micro batch 2: one a rank): each expert on 2 ranks, its
    Adam states split between them. Its first loss is the EP 1 run's (the same weights and batch); its checkpoint
    of step 10 resumes at EP 2 on 4 ranks with the replicated optimizer and gives the same steps 11..20, the
    first one exactly."""
    root = ep_runs

    def four(run: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [*TORCHRUN[:2], "--nproc-per-node=4", *TORCHRUN[3:], str(BIN / "snakellm"), "train"]
        cmd += ["--blend", "data/tokens/synth/blend.json", "--run-dir", f"runs/{run}", *MOE, *STEPS]
        cmd += ["--micro-batch-size", "2", "--ep", "2", *extra]
        proc = subprocess.run(cmd, cwd=root, env=env_with_venv(), capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    proc = four("ep2-do4", "--distributed-optimizer")
    held = [int(n.replace(",", "")) for n in re.findall(r"holds the Adam states of ([\d,]+) of", proc.stderr)]
    assert held, proc.stderr[-2000:]
    b = records(root, "ep2-do4")
    assert sorted(b) == list(range(1, 21))
    ref = records(root, "ep1")[1]
    assert abs(b[1]["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (b[1], ref)
    shutil.copytree(root / "runs" / "ep2-do4", root / "runs" / "ep2-do4-to-replicated")
    (root / "runs" / "ep2-do4-to-replicated" / "checkpoints/latest_checkpointed_iteration.txt").write_text("10\n")
    err = four("ep2-do4-to-replicated").stderr
    assert "resumed from runs/ep2-do4-to-replicated/checkpoints/iter_0000010" in err
    c = records(root, "ep2-do4-to-replicated")
    assert c[11]["loss"] == b[11]["loss"]
    assert_same(c, b, range(11, 21))


@pytest.mark.slow
def test_tp2_gives_the_losses_of_tp1_and_its_checkpoint_loads_and_resumes_at_tp1(ep_runs):
    """tp 2 (each expert split over both ranks, the sequence too) against the tp 1 run (ep1: tp 1 x dp 2)."""
    root = ep_runs
    proc = train(root, "tp2", "--tp", "2", "--sequence-parallel")
    assert "= dp 1 x tp 2 x pp 1;" in proc.stderr and "; sequence parallel" in proc.stderr
    a, ref = records(root, "tp2"), records(root, "ep1")
    assert sorted(a) == list(range(1, 21))
    assert_same(a, ref, range(1, 21), norm_rtol=1e-4)
    for step in a:  # router health over the sequence's slices: the tp 1 run's counts and losses
        assert a[step]["moe_tokens_per_expert"] == ref[step]["moe_tokens_per_expert"], step
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert abs(a[step][key] - ref[step][key]) <= 1e-5 * ref[step][key], (step, key, a[step], ref[step])
    # its checkpoint of step 10 in one process: every weight and Adam state the bytes the two ranks wrote
    script = [sys.executable, str(Path(__file__).parent / "reshard_probe.py"), "10"]
    res = run_probe([*script, "--blend", "data/tokens/synth/blend.json", "--run-dir", "runs/tp2", *MOE, *STEPS], root)
    assert res["differ"] == [] and res["compared"] >= 3 * 20  # model, exp_avg, exp_avg_sq: 20+ tensors each
    # and training goes on from it at tp 1 on the uninterrupted tp 1 run's losses
    c, err = resume_at(root, "tp2", "tp2-to-tp1", 10, nproc=1)
    assert "was written at tp 2 x pp 1, this job runs tp 1 x pp 1" in err
    assert_same(c, ref, range(11, 21), norm_rtol=1e-4)


@pytest.mark.slow
def test_an_ep2_checkpoint_resumes_at_tp2(ep_runs):
    """ep 2 x tp 1 (each rank two whole experts) -> tp 2 x ep 1 (each rank half of every expert)."""
    c, err = resume_at(ep_runs, "ep2", "ep2-to-tp2", 10, "--tp", "2", "--sequence-parallel")
    assert "was written at tp 1 x pp 1, this job runs tp 2 x pp 1" in err
    assert_same(c, records(ep_runs, "ep2"), range(11, 21), norm_rtol=1e-4)


def test_ep_checks_name_the_setting(root):
    from snakellm.models import architecture, moe, resolve

    mixtral = resolve("tiny-mixtral")
    assert moe.check_ep(mixtral, 3) == "num_experts 4 is not divisible by ep 3"
    assert "expert parallelism needs a mixture-of-experts model" in moe.check_ep(resolve("tiny"), 2)
    assert "ep 4 must divide the data-parallel size (world 2" in moe.check_ep(mixtral, 4, world=2)
    assert architecture.parallel_conflict({"ep": 2, "distributed_optimizer": True}) is None  # composed
    why = architecture.parallel_conflict({"ep": 2, "fsdp": True})
    assert why is not None and why[0] == "ep" and "not composed with fsdp" in why[1]


def test_the_distributed_optimizer_shards_the_experts_over_the_expert_data_parallel_ranks():
    """The memory estimate: at ep 2 of dp 4 the experts' Adam states are split over 2 ranks, the rest over 4."""
    from snakellm.models import memory, moe, resolve

    arch = resolve("mixtral-8x7b")
    kw = dict(tp=1, pp=1, micro_batch_size=1, num_micro_batches=1, sequence_parallel=False)
    experts = arch["num_layers"] * arch["num_experts"] // 2 * moe.expert_params(arch)  # on one rank at ep 2
    plain = memory.estimate(arch, 32000, dp=4, ep=2, distributed_optimizer=False, **kw)
    sharded = memory.estimate(arch, 32000, dp=4, ep=2, distributed_optimizer=True, **kw)
    assert plain.optimizer == plain.params * 12
    assert sharded.optimizer == pytest.approx((plain.params - experts) * 12 / 4 + experts * 12 / 2)
    lines = memory.report(arch, 32000, dp=4, ep=2, distributed_optimizer=False, **kw)
    assert any("parallel.distributed_optimizer: true would make it" in ln for ln in lines), lines


def test_a_moe_model_at_tp2_needs_sequence_parallelism_and_says_so(tmp_path):
    from snakellm.config.resolve import resolve_run
    from snakellm.errors import ConfigError
    from snakellm.models import ModelConfigError, check_parallel, moe, resolve
    from snakellm.steps.train import build_parser
    from snakellm.train.request import RequestError, make_request

    mixtral = resolve("tiny-mixtral")
    run = {"tokenizer": "t", "model": {"preset": "tiny-mixtral"}, "parallel": {"tp": 2}}
    with pytest.raises(ConfigError) as e:
        resolve_run("m", run, {"t": {}})
    assert str(e.value) == (
        "config key runs.m.parallel.sequence_parallel: a mixture-of-experts model at parallel.tp 2 needs sequence "
        "parallelism: megatron-core's MoE layer trains at tp > 1 only with the sequence split over the "
        "tensor-parallel ranks: set parallel.sequence_parallel"
    )
    assert resolve_run("m", {**run, "parallel": {"tp": 2, "sequence_parallel": True}}, {"t": {}}) == mixtral
    # snakellm train names its flags; a fine-tune (no sequence parallelism) is told to use tp 1; dense models pass
    argv = ["--blend", "x.json", "--run-dir", str(tmp_path), "--steps", "1", "--preset", "tiny-mixtral", "--tp", "2"]
    argv += ["--micro-batch-size", "1", "--global-batch-size", "1"]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(RequestError, match="at --tp 2 needs sequence parallelism: .*: set --sequence-parallel$"):
        make_request(build_parser().parse_args(argv), env=env)
    assert moe.check_tp(mixtral, 2, None, lambda k: f"--{k}").endswith(", which this step does not run: use --tp 1")
    assert moe.check_tp(resolve("tiny"), 2, False) is None and moe.check_tp(mixtral, 1, False) is None
    # the config check of a fine-tune whose base run is a mixture of experts
    from snakellm.config.checks import check_finetunes

    ft = {"run": "b", "data": "d", "method": "lora", "train": {"global_batch_size": 8, "micro_batch_size": 4}}
    config = {"runs": {"b": {}}, "sft_data": {"d": {"path": "x.json"}}, "finetune": {"t": ft}}
    check_finetunes(config, {"b": mixtral})
    ft["parallel"] = {"tp": 2}
    check_finetunes(config, {"b": resolve("tiny")})
    with pytest.raises(
        ConfigError, match=r"^config key finetune.t.parallel.tp: base run b: a mixture-of-experts model "
    ):
        check_finetunes(config, {"b": mixtral})
    # each expert splits over the tensor-parallel ranks: its ffn must divide
    with pytest.raises(
        ModelConfigError, match="model moe_ffn_hidden_size 95 is not divisible by tensor parallel size 2"
    ):
        check_parallel(resolve("tiny-mixtral", {"moe_ffn_hidden_size": 95}), 2, 1)


@pytest.mark.slow
def test_pipeline_stages_of_a_moe_model_give_one_process_losses_and_router_health(root):
    """pp 2 (megatron-core's schedule, each stage with its layer's router) against one process: the same losses,
    gradient norms and router records (counts and losses gathered over the stages); the pp 2 checkpoint of step 2
    (each stage's layer, its router and experts under their global layer number) resumes in one process."""
    base = [str(BIN / "snakellm"), "train", "--blend", "data/tokens/synth/blend.json", *MOE, "--steps", "4"]
    base += ["--warmup-steps", "2", "--save-interval", "2", "--keep-last", "2"]
    env = env_with_venv()
    for run, launch in (("pp2", [*TORCHRUN, *base, "--pp", "2"]), ("pp1", [*base, "--no-checkpoints"])):
        proc = subprocess.run(
            [*launch, "--run-dir", f"runs/{run}"],
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
    shutil.copytree(root / "runs/pp2", root / "runs/pp2-to-pp1")
    (root / "runs/pp2-to-pp1/checkpoints/latest_checkpointed_iteration.txt").write_text("2\n")
    proc = subprocess.run(
        [*base, "--run-dir", "runs/pp2-to-pp1"], cwd=root, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "was written at tp 1 x pp 2, this job runs tp 1 x pp 1" in proc.stderr
    assert "resumed from runs/pp2-to-pp1/checkpoints/iter_0000002" in proc.stderr
    assert_same(records(root, "pp2-to-pp1"), b, range(3, 5))
