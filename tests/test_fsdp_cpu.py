"""Parameters, gradients and optimizer states sharded (``--fsdp``: FSDP2, snakellm.train.fsdp) on the CPU.

Real `snakellm train` under torchrun (gloo, fp32, 2 ranks) against one process:
the same losses and gradient norms at every step, half the parameters held on
each rank, and checkpoints in the layout of every other run: one written with
FSDP on 2 ranks resumes in one process without FSDP, and one written by one
process resumes with FSDP on 2 ranks (a change of the data-parallel size both
ways), each continuing with the uninterrupted run's losses.

About 2 minutes on 2 cores (four training launches of 2 processes each, each
paying megatron-core's import): marked slow.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_parallel_cpu import assert_close, records, root, train  # noqa: F401  (root: the shared blend fixture)

STEPS = ["--preset", "tiny-llama", "--steps", "12", "--save-interval", "4", "--keep-last", "3"]


@pytest.mark.slow
def test_fsdp_matches_one_process_and_resumes_across_data_parallel_sizes(root):  # noqa: F811
    train(root, "fsdp-one", 1, *STEPS)
    proc = train(root, "fsdp", 2, *STEPS, "--fsdp")
    assert "sharded over 2 ranks (FSDP2)" in proc.stderr
    held, total = (
        int(x.replace(",", ""))
        for x in proc.stderr.split("FSDP: rank 0 holds ", 1)[1].split(" parameters")[0].split(" of ")
    )
    assert abs(held - total / 2) <= 64 * 20  # half, give or take the rows of odd-sized tensors
    ref = records(root, "fsdp-one")
    assert_close(records(root, "fsdp"), ref, loss_rtol=1e-6, norm_rtol=1e-5)
    summary = json.loads((root / "runs/fsdp/train_summary.json").read_text())
    assert len(set(summary["replica_weight_digests"])) == 1
    # megatron-core's own recomputation (a reentrant checkpoint around FSDP's units) changes no loss
    train(root, "fsdp-recompute", 2, *STEPS, "--fsdp", "--recompute", "full", "--recompute-method", "block")
    assert_close(records(root, "fsdp-recompute"), ref, loss_rtol=1e-6, norm_rtol=1e-5)
    # the checkpoint carries Megatron-LM's args (its pretrain_gpt.py resumes the data position from them)
    from snakellm.io.checkpoint import load_common

    lm = load_common(root / "runs/fsdp/checkpoints", 8)["args"]
    assert (lm.num_layers, lm.consumed_train_samples, lm.swiglu, lm.add_position_embedding) == (2, 64, True, False)
    for src, dst, nproc, flag in (("fsdp", "fsdp-to-one", 1, ()), ("fsdp-one", "one-to-fsdp", 2, ("--fsdp",))):
        shutil.copytree(root / "runs" / src, root / "runs" / dst)
        (root / "runs" / dst / "checkpoints/latest_checkpointed_iteration.txt").write_text("8\n")
        proc = train(root, dst, nproc, *STEPS, *flag)
        assert f"resumed from runs/{dst}/checkpoints/iter_0000008" in proc.stderr
        assert_close(records(root, dst), ref, loss_rtol=1e-6, norm_rtol=1e-5)


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
