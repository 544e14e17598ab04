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
