"""``--profile-steps``' step breakdown (snakellm.train.step_breakdown): compute, exposed communication, optimizer,
recomputation and idle time of a profiled step, from the profiler's Chrome trace.

Fast: the interval arithmetic, and a GPU-shaped trace (kernels on two streams, NCCL under and beside compute,
launches from inside a recomputation's backward) with its exact figures. Slow: the real ``snakellm train`` on
two gloo ranks with ``--profile-steps``: the kernel table, the timeline and the breakdown land in the run
directory, and the breakdown's parts add up to the step.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_venv
from test_train import make_blend

from snakellm.train import step_breakdown as sb

BIN = Path(sys.executable).parent


def test_interval_arithmetic():
    assert sb.union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    a = [(0, 10), (20, 30)]
    b = [(2, 3), (5, 25)]
    assert sb.minus(a, b) == [(0, 2), (3, 5), (25, 30)]
    assert sb.within(a, b) == [(2, 3), (5, 10), (20, 25)]
    assert sb.length(sb.minus(a, b)) + sb.length(sb.within(a, b)) == sb.length(a)
    assert sb.minus(a, []) == a and sb.within(a, []) == []


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 7, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_a_gpu_trace_splits_into_its_parts():
    """One step of 1,000 us (the phases' span): compute kernels 0-300 and 400-700 on stream 7, an all-gather 200-500
    on stream 9 (exposed 300-400 only), a reduce-scatter 800-900 with nothing beside it (exposed); two optimizer
    kernels 720-780 and 950-1000 inside the optimizer range; a kernel 100-150 on stream 8 launched from inside
    CheckpointFunctionBackward (its launch's correlation id): recomputation, hidden under the first gemm; one
    150-250 launched from the nested backward inside that window: backward, not recomputation."""
    ev = [
        _x("forward", "gpu_user_annotation", 0, 400),
        _x("backward", "gpu_user_annotation", 400, 300),
        _x("optimizer", "gpu_user_annotation", 700, 300),
        _x("sm90_gemm", "kernel", 0, 300, correlation=1),
        _x("sm90_gemm", "kernel", 400, 300, correlation=2),
        _x("ncclDevKernel_AllGather_RING", "kernel", 200, 300, tid=9, correlation=3),
        _x("ncclDevKernel_ReduceScatter_RING", "kernel", 800, 100, tid=9, correlation=4),
        _x("multi_tensor_apply_kernel", "kernel", 720, 60, correlation=5),
        _x("multi_tensor_apply_kernel", "kernel", 950, 50, correlation=6),
        _x("flash_fwd_kernel", "kernel", 100, 50, tid=8, correlation=7),
        _x("sm90_gemm_bwd", "kernel", 150, 100, tid=8, correlation=8),
        _x("autograd::engine::evaluate_function: CheckpointFunctionBackward", "cpu_op", 9_990, 120, tid=1),
        _x("CheckpointFunctionBackward", "cpu_op", 10_000, 100, tid=1),
        # the nested backward of the recomputed layers: its kernel is backward, not recomputation
        _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 10_060, 30, tid=1),
        *(_x("cudaLaunchKernel", "cuda_runtime", t, 1, tid=1, correlation=c) for c, t in [(1, 0), (2, 5), (8, 10_070)]),
        # cuBLAS and Triton launch through the driver (on an H200: 500 of a step's 2,200 launches)
        _x("cuLaunchKernelEx", "cuda_driver", 10_050, 1, tid=1, correlation=7),
    ]
    b = sb.breakdown({"traceEvents": ev}, steps=1)
    assert b is not None and b.device == "GPU"
    ms = {k: round(v * 1e6) for k, v in b.as_dict().items() if k.endswith("_s")}  # in microseconds
    assert ms == {
        "step_s": 1000,
        "compute_s": 300 + 300 + 60 + 50,
        "communication_s": 300 + 100,
        "exposed_communication_s": 100 + 100,
        "optimizer_s": 60 + 50,
        "recomputation_s": 50,
        "idle_s": 1000 - 710 - 200,
    }
    text = "\n".join(b.lines())
    assert "exposed communication" in text and "50% of it hidden under compute" in text


def test_a_trace_without_the_step_phases_has_no_breakdown():
    assert sb.breakdown({"traceEvents": [_x("sm90_gemm", "kernel", 0, 10)]}, steps=1) is None


@pytest.mark.slow  # a torchrun of 2 gloo ranks of the real `snakellm train` (~20 s)
def test_profile_steps_write_the_table_the_timeline_and_the_breakdown(tmp_path):
    make_blend(tmp_path)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--no-python", str(BIN / "snakellm")]
    cmd += ["train", "--blend", "data/tokens/synth/blend.json", "--run-dir", "runs/p", "--preset", "tiny"]
    cmd += ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--steps", "4"]
    cmd += ["--device", "cpu", "--threads", "1", "--no-progress", "--profile-steps", "3:3", "--distributed-optimizer"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_with_venv(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "p"
    table = (run / "profile.txt").read_text()
    assert table.startswith("torch.profiler over 1 steps, sorted by self_cpu_time_total")
    assert "step breakdown (CPU, mean of 1 profiled step):" in table
    assert proc.stderr.count("step breakdown (CPU") == 1  # rank 0's
    trace = json.loads(gzip.open(run / "profile-trace.json.gz").read())
    assert {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"} >= set(sb.PHASES)
    b = json.loads((run / "profile-breakdown.json").read_text())
    assert b == sb.breakdown(trace, 1).as_dict()  # type: ignore[union-attr]
    assert b["device"] == "CPU" and b["step_s"] > 0
    # gloo's all-reduce of the gradient norm, reduce-scatter of the gradients and all-gather of the weights
    assert 0 < b["exposed_communication_s"] <= b["communication_s"]
    assert 0 < b["optimizer_s"] < b["compute_s"] < b["step_s"]
    assert b["compute_s"] + b["exposed_communication_s"] + b["idle_s"] == pytest.approx(b["step_s"])
