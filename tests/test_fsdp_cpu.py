"""Parameters, gradients and optimizer states sharded (``--fsdp``: FSDP2, snakellm.train.fsdp) on the CPU.

Real `snakellm train` under torchrun (gloo, fp32, 2 ranks) against one process:
the same losses and gradient norms at every step, half the parameters held on
each rank, and checkpoints in the layout of every other run: one written with
FSDP on 2 ranks resumes in one process without FSDP, and one written by one
process resumes with FSDP on 2 ranks (a change of the data-parallel size both
ways, the second with full recomputation), each continuing with the uninterrupted
run's losses.

The two uninterrupted runs are a module fixture (two launches); each test after it
is one launch (the per-test budget): marked slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_parallel_cpu import assert_close, records, train
from test_train import make_blend

STEPS = ["--preset", "tiny-llama", "--steps", "12", "--save-interval", "4", "--keep-last", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, str]:
    """One process without FSDP and 2 ranks with it, the same 12 steps: (root, the FSDP run's stderr)."""
    root = tmp_path_factory.mktemp("fsdp")
    make_blend(root)
    train(root, "fsdp-one", 1, *STEPS)
    return root, train(root, "fsdp", 2, *STEPS, "--fsdp").stderr


@pytest.mark.slow
def test_fsdp_matches_one_process_and_holds_half_the_model(runs):
    root, stderr = runs
    assert "sharded over 2 ranks (FSDP2)" in stderr
    held, total = (
        int(x.replace(",", "")) for x in stderr.split("FSDP: rank 0 holds ", 1)[1].split(" parameters")[0].split(" of ")
    )
    assert abs(held - total / 2) <= 64 * 20  # half, give or take the rows of odd-sized tensors
    assert_close(records(root, "fsdp"), records(root, "fsdp-one"), loss_rtol=1e-6, norm_rtol=1e-5)
    summary = json.loads((root / "runs/fsdp/train_summary.json").read_text())
    assert len(set(summary["replica_weight_digests"])) == 1
    # the checkpoint carries Megatron-LM's args (its pretrain_gpt.py resumes the data position from them)
    from snakellm.io.checkpoint import load_common

    lm = load_common(root / "runs/fsdp/checkpoints", 8)["args"]
    assert (lm.num_layers, lm.consumed_train_samples, lm.swiglu, lm.add_position_embedding) == (2, 64, True, False)


# the second also recomputes (megatron-core's own, a reentrant checkpoint around FSDP's units): no loss changes
RECOMPUTE = ("--recompute", "full", "--recompute-method", "block")


@pytest.mark.slow
@pytest.mark.parametrize(
    "src, dst, nproc, flags",
    [("fsdp", "fsdp-to-one", 1, ()), ("fsdp-one", "one-to-fsdp", 2, ("--fsdp", *RECOMPUTE))],
    ids=["fsdp-2-ranks-to-one-process", "one-process-to-fsdp-2-ranks-recomputing"],
)
def test_fsdp_checkpoints_resume_across_data_parallel_sizes(runs, src, dst, nproc, flags):
    root, _ = runs
    shutil.copytree(root / "runs" / src, root / "runs" / dst)
    (root / "runs" / dst / "checkpoints/latest_checkpointed_iteration.txt").write_text("8\n")
    proc = train(root, dst, nproc, *STEPS, *flags)
    assert f"resumed from runs/{dst}/checkpoints/iter_0000008" in proc.stderr
    assert_close(records(root, dst), records(root, "fsdp-one"), loss_rtol=1e-6, norm_rtol=1e-5)


@pytest.mark.slow
def test_a_bf16_fsdp_run_resumes_with_its_fp32_masters(tmp_path):
    """bf16 (on the CPU here): FSDP's sharded parameters are the fp32 masters, and the checkpoint holds both the
    model's bf16 weights and the masters. Resumed at step 3 it continues with the uninterrupted run's losses:
    the saved masters used to be loaded in place into the parameters, where the bf16 weights then overwrote
    them with their rounding (the same forward, another update: steps 5 and 6 parted)."""
    make_blend(tmp_path)
    bf16 = ["--preset", "tiny-llama", "--steps", "6", "--save-interval", "3", "--keep-last", "2"]
    bf16 += ["--precision", "bf16", "--device", "cpu", "--fsdp"]
    train(tmp_path, "bf16", 2, *bf16)
    shutil.copytree(tmp_path / "runs/bf16", tmp_path / "runs/bf16-resumed")
    (tmp_path / "runs/bf16-resumed/checkpoints/latest_checkpointed_iteration.txt").write_text("3\n")
    proc = train(tmp_path, "bf16-resumed", 2, *bf16)
    assert "resumed from runs/bf16-resumed/checkpoints/iter_0000003" in proc.stderr
    whole, resumed = records(tmp_path, "bf16"), records(tmp_path, "bf16-resumed")
    assert [resumed[s]["loss"] for s in (4, 5, 6)] == [whole[s]["loss"] for s in (4, 5, 6)]


def test_fsdp_refuses_the_distributed_optimizer(tmp_path):
    from snakellm.steps.train import build_parser
    from snakellm.train.request import RequestError, make_request

    args = build_parser().parse_args(
        ["--blend", "x.json", "--run-dir", str(tmp_path), "--steps", "1", "--micro-batch-size", "1"]
        + ["--global-batch-size", "1", "--preset", "tiny", "--fsdp", "--distributed-optimizer"]
    )
    with pytest.raises(RequestError, match="drop --distributed-optimizer"):
        make_request(args, env={})


def test_fsdp_memory_is_16_bytes_a_parameter_over_dp_plus_the_gathered_units():
    from snakellm import models
    from snakellm.models import memory

    cfg = models.resolve("llama3-8b", {})
    n = models.param_count(cfg, 128256)
    e = memory.estimate(cfg, 128256, dp=4, micro_batch_size=1, seq_length=8192, fsdp=True)
    assert e.optimizer == n * 8 / 4
    gathered = e.weights - n * 4 / 4  # two layers and the output layer in bf16
    assert 1.5e9 < gathered < 3.5e9
    assert 30 * 2**30 < e.model_states < 37 * 2**30  # against 67 GiB with the distributed optimizer
    lines = memory.report(
        cfg, 128256, tp=1, pp=1, dp=4, micro_batch_size=1, num_micro_batches=2, sequence_parallel=False,
        distributed_optimizer=True, gpu_gib=80,
    )  # fmt: skip
    assert any("parallel.fsdp: true would make it" in ln for ln in lines)
    fs = memory.report(
        cfg, 128256, tp=1, pp=1, dp=4, micro_batch_size=1, num_micro_batches=2, sequence_parallel=False,
        distributed_optimizer=False, fsdp=True,
    )  # fmt: skip
    assert "FSDP" in fs[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", [("--fsdp",), (), ("--distributed-optimizer",)], ids=["fsdp", "megatron-ddp", "distributed-optimizer"]
)
def test_gradients_reduced_in_bf16_train_as_fp32_reductions_do_within_bf16_rounding(tmp_path, layout):
    """``--grad-reduce-dtype bf16`` (NeMo's performance recipes' grad_reduce_in_fp32 false) on 2 ranks, bf16
    weights: FSDP reduce-scatters bf16 gradients into its fp32 shards, megatron-core DDP keeps bf16 gradient
    buffers (reduce-scattered into the distributed optimizer's slices, all-reduced otherwise). The first step's loss is the fp32 reduction's (the same forward), later ones part by bf16's
    rounding only: within 1% over 6 steps, and not equal (the setting took effect)."""
    make_blend(tmp_path)
    bf16 = ["--preset", "tiny-llama", "--steps", "6", "--save-interval", "6", "--precision", "bf16"]
    bf16 += ["--device", "cpu", *layout]
    train(tmp_path, "fp32-reduce", 2, *bf16)
    proc = train(tmp_path, "bf16-reduce", 2, *bf16, "--grad-reduce-dtype", "bf16")
    assert "gradients reduced in bf16" in proc.stderr
    fp32, half = records(tmp_path, "fp32-reduce"), records(tmp_path, "bf16-reduce")
    assert half[1]["loss"] == fp32[1]["loss"]
    assert_close(half, fp32, loss_rtol=1e-2, norm_rtol=5e-2)
    assert [half[s]["loss"] for s in (4, 5, 6)] != [fp32[s]["loss"] for s in (4, 5, 6)]


def test_gradients_reduced_in_bf16_are_refused_with_fp32_weights_naming_the_setting(tmp_path):
    from snakellm.steps.train import build_parser
    from snakellm.train.request import RequestError, make_request

    args = build_parser().parse_args(
        ["--blend", "x.json", "--run-dir", str(tmp_path), "--steps", "1", "--micro-batch-size", "1"]
        + ["--global-batch-size", "1", "--preset", "tiny", "--precision", "fp32", "--grad-reduce-dtype", "bf16"]
    )
    with pytest.raises(RequestError, match=r"--grad-reduce-dtype bf16 .*needs precision bf16 or fp8 \(got fp32\)"):
        make_request(args, env={})


def test_gradients_reduced_in_bf16_are_refused_with_fp32_weights_by_finetune_and_the_config_check(tmp_path, capsys):
    from snakellm.config.checks import check_grad_reduce
    from snakellm.errors import ConfigError
    from snakellm.steps.finetune import main

    argv = ["--base", str(tmp_path / "nothing"), "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "ft")]
    assert main([*argv, "--method", "full", "--steps", "2", "--precision", "fp32", "--grad-reduce-dtype", "bf16"]) == 2
    assert "--grad-reduce-dtype bf16 reduces the gradients of bf16 weights in bf16" in capsys.readouterr().err
    job = {"parallel": {"grad_reduce_dtype": "bf16"}, "train": {"precision": "fp32"}}
    for section in ("runs", "finetune"):
        with pytest.raises(
            ConfigError, match=rf"config key {section}.j.parallel.grad_reduce_dtype: bf16 .*\(got fp32\)"
        ):
            check_grad_reduce({section: {"j": job}})
    check_grad_reduce({"runs": {"j": {**job, "train": {"precision": "bf16"}}}})


def test_megatron_ddp_gradient_buffers_halve_with_bf16_reductions():
    from snakellm import models
    from snakellm.models import memory

    cfg = models.resolve("llama-1b", {})
    n = models.param_count(cfg, 50304)
    fp32 = memory.estimate(cfg, 50304, micro_batch_size=1)
    half = memory.estimate(cfg, 50304, micro_batch_size=1, grad_reduce_in_fp32=False)
    assert (fp32.grads, half.grads) == (n * 4, n * 2)
    kw = dict(tp=1, pp=1, dp=1, micro_batch_size=1, num_micro_batches=1, sequence_parallel=False)
    reports = [
        memory.report(cfg, 50304, **kw, distributed_optimizer=False, grad_reduce_in_fp32=f) for f in (True, False)
    ]
    grads = [next(ln for ln in lines if ln.strip().startswith("gradients")) for lines in reports]
    assert [g.split()[1] for g in grads] == [f"{n * 4 / 2**30:.2f}", f"{n * 2 / 2**30:.2f}"]
