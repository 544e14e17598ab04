"""scripts/bench_train_8b_gpu.py's 8-GPU cases (issues 48 and 49): which run, and how its bars are judged.

The runs themselves need 8 GPUs of one host; its CPU smoke (tests/test_bench_smoke.py) runs the first dense case
and the test below the mixture-of-experts cases (expert parallelism over 2 gloo ranks), each through the
real `snakellm train`; scripts/check_moe_ep_gpu.py's smoke (EP 2 against EP 1, EP 2 -> EP 1) runs here too.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, env_with_venv

sys.path.insert(0, str(REPO / "scripts"))
import bench_train_8b_gpu as bench


def _result(case: str, tps: float) -> dict:
    c = bench.CASES[case]
    return {"case": case, "model": c.model, "seq": c.seq, "flags": c.flags, "tokens_per_s_per_gpu": tps, "mfu": 0.5}


def test_every_listed_case_exists_and_moe_cases_split_the_experts_evenly():
    from snakellm import models

    for name in [*bench.DEFAULT, *bench.DEFAULT_8, *bench.MOE]:
        assert name in bench.CASES
    for name in bench.MOE:
        c = bench.CASES[name]
        ep = int(c.flags[c.flags.index("--ep") + 1])
        assert models.resolve(c.model, {})["num_experts"] % ep == 0


def test_bars_at_8_gpus_are_judged_on_the_best_case_of_each_kind():
    args = argparse.Namespace(nproc=8, smoke=False)
    results = [
        _result("llama8k-fsdp-compile-bf16rs", 11_000),
        _result("llama8k-fsdp-fp8ag-compile-bf16rs", 12_500),
        _result("qwen3moe-ep8", 12_100),
        _result("qwen3moe-ep8-fp8", 13_000),
    ]
    rows = bench.bar_verdicts(results, args)
    assert rows == [
        "llama3-8b seq 8192 bf16: 11,000 tokens/s/GPU (llama8k-fsdp-compile-bf16rs, MFU 50.0%) against 10,682 (PASS)",
        "llama3-8b seq 8192 FP8: 12,500 tokens/s/GPU (llama8k-fsdp-fp8ag-compile-bf16rs, MFU 50.0%) against 13,000 (FAIL)",
        "qwen3-30b-a3b seq 4096 bf16: 12,100 tokens/s/GPU (qwen3moe-ep8, MFU 50.0%) against 12,040 (PASS)",
    ]
    names = [n for n, _ in bench.anchors_of(results, args)]
    assert names[0].startswith("NeMo 25.02, 8 x H100") and any("AutoModel" in n for n in names)
    # a mixture of experts' FP8 bar is "faster than bf16 in the same layout"
    assert bench.fp8_ratios(results[2:], bar=1.0) == ["qwen3moe-ep8-fp8 / qwen3moe-ep8: 1.074x (bar 1.0x: PASS)"]
    assert bench.bar_verdicts(results, argparse.Namespace(nproc=4, smoke=False)) == []


@pytest.mark.slow  # two torchrun runs of the real `snakellm train` over 2 ranks (~25 s alone)
def test_the_moe_cases_smoke_runs_expert_parallelism_over_two_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_train_8b_gpu.py"), "--smoke", "--cases", "moe", "--breakdown"],
        cwd=tmp_path,
        env={**env_with_venv(), "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for case in bench.MOE:
        m = re.search(rf"^{case}: ([\d,]+) tokens/s/GPU, MFU [\d.]+%, .* loss ([\d.]+) -> ([\d.]+)", proc.stdout, re.M)
        assert m, (case, proc.stdout[-3000:])
        assert float(m[2]) > 0 and float(m[3]) > 0
    assert "NeMo AutoModel, 8 x H100, Qwen3-30B-A3B" in proc.stdout  # its anchors beside it
    # --breakdown (the default at --nproc 8): each case's profiled step split into its parts, below its line
    assert proc.stdout.count("step breakdown (CPU, mean of 1 profiled step):") == len(bench.MOE), proc.stdout[-3000:]
    assert re.search(r"^ +exposed communication +[\d.]+ ms", proc.stdout, re.M)


@pytest.fixture(scope="module")
def moe_ep_check(tmp_path_factory):
    """`scripts/check_moe_ep_gpu.py --smoke` (three 2-rank torchrun launches of `snakellm train`, ~80 s of CPU:
    a shared fixture, outside one test's budget)."""
    out = tmp_path_factory.mktemp("moe-ep-check")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_moe_ep_gpu.py"), "--smoke", "--workdir", str(out / "work")],
        cwd=out,
        env={**env_with_venv(), "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc, out


@pytest.mark.slow
def test_the_ep_check_script_smoke_gives_ep1s_steps_at_ep2_and_after_a_resume_at_ep1(moe_ep_check):
    """Issue 49's fourth point on the CPU: EP 2 against EP 1 from the same weights and batches, and the EP 2
    checkpoint resumed at EP 1, through the real `snakellm train` (fp32: the bars are 1e-5)."""
    proc, out = moe_ep_check
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EP 2 = EP 1 and EP 2 -> EP 1: PASS" in proc.stdout
    result = json.loads((out / "moe_ep_check.json").read_text())
    assert result["pass"] and result["first_step"] <= 1e-5
    first, resumed = result["checks"]
    assert [r[0] for r in first["rows"]] == [1, 2, 3, 4] and [r[0] for r in resumed["rows"]] == [3, 4]
    assert first["max_rel_loss"] <= 1e-5 and resumed["max_rel_loss"] <= 1e-5
