"""Every scripts/bench_*.py runs: ``python scripts/bench_X.py --smoke`` (a CPU run of seconds, a tiny model,
the same code path as the real benchmark) exits 0 and prints its figures, each parsable and positive.

The scripts are found by glob: a new benchmark without ``--smoke`` fails here (argparse rejects the flag),
and one without an entry in FIGURES must still print a figure. The training benchmarks (TRAINING) run in
tests/test_bench_smoke_training.py, the rest here. A module's smokes start together in a pool of two threads
(module fixture; under pytest-xdist a module is one group, on one worker), and the fixture waits for all of
them: on 2 cores that overlaps one script's imports with another's work. Every
smoke is marked slow: each starts processes of their own (2-30 s of CPU apiece, ~30 s for the five lightest
together), which the fast tier's 90 s budget has no room for. SLOW lists the heaviest, started first.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import pytest
from conftest import REPO, env_with_venv

ALL_SCRIPTS = sorted(p.stem for p in (REPO / "scripts").glob("bench_*.py"))
# the training benchmarks' smokes (~340 s of CPU together) run in tests/test_bench_smoke_training.py, a module
# of their own: xdist gives it to the other worker beside this one's (~380 s: fp8's numerics, finetune's six
# runs), and each module's shared fixture stays well inside its budget (one fixture for all: 530-620 s)
TRAINING = [
    "bench_convert",
    "bench_dpo_gpu",
    "bench_moe_gpu",
    "bench_parallel_gpu",
    "bench_pipeline_gpu",
    "bench_train_8b_gpu",
    "bench_train_gpu",
]
SCRIPTS = [s for s in ALL_SCRIPTS if s not in TRAINING]

NUM = r"([\d,]+(?:\.\d+)?)"
# script -> patterns that must each match a line of its output; every group is a figure (> 0)
FIGURES: dict[str, list[str]] = {
    "bench_chunk": [
        rf"zstd -dc > /dev/null\s+{NUM} MB/s",
        rf"snakellm chunk -t1\s+{NUM} MB/s",
        rf"snakellm chunk -t2\s+{NUM} MB/s\s+\({NUM} s, {NUM} documents validated, {NUM}x zstd's time\)",
        rf"pyarrow text column -> str\s+{NUM} MB/s per core",
        rf"snakellm chunk -t1\s+{NUM} MB/s per core .*; {NUM}x pyarrow's read, {NUM}x datatrove; C writer\)",
        rf"snakellm chunk, orjson path\s+{NUM} MB/s per core .*; the C writer is {NUM}x it\)",
        rf"datatrove Parquet->Jsonl\s+{NUM} MB/s per core",
        rf"snakellm chunk -t1\s+{NUM} documents/s\s+\({NUM} in {NUM} s, {NUM}x datatrove\)",
        rf"datatrove Warc\+Trafilatura\s+{NUM} documents/s",
    ],
    "bench_plan": [
        rf"http: snakemake -n\s+{NUM} s \(\s*{NUM} s CPU\)\s+{NUM} MB peak",
        rf"local: snakemake -n\s+{NUM} s",
        rf"local source jobs: \{{'chunk': {NUM},",
        rf"parquet plan, cold \(every footer read\)\s+{NUM} s",
        rf"parquet plan, warm \(nothing changed\)\s+{NUM} s",
    ],
    "bench_curate": [
        rf"recall: {NUM}% of {NUM} pairs at Jaccard >= 0.85 found",
        rf"agreement \(Jaccard of the sets\) {NUM}%",
        rf"whole dedup: ours {NUM}, datatrove {NUM} docs/s per core: {NUM}x",
        rf"whole dedup, ours with datatrove's scheme: {NUM} docs/s per core: {NUM}x datatrove's",
        rf"rensa\s+{NUM} docs/s",
    ],
    "bench_convert": [
        rf"^{step}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$" for step in ("import-hf", "export-hf", "export-nemo")
    ],
    "bench_serve_cpu": [
        rf"engine: 4 requests x 4 tokens: sequential {NUM} req/s, 2 parallel clients {NUM} req/s = {NUM}x",
        rf"single_worker: 4 requests x 4 tokens: sequential {NUM} req/s",
    ],
    "bench_generate_gpu": [
        rf"batch   1 tokens/s: engine {NUM} \| engine_unfused {NUM} \| eager {NUM} \| transformers {NUM}",
        rf"batch   4 tokens/s: engine {NUM}",
        rf"batch 4, the whole call's roofline .*: nan tokens/s; the engine {NUM} = nan% of it; 5x transformers = {NUM}",
        rf"engine, 4 streaming clients: concurrent {NUM} req/s vs sequential {NUM} req/s",
        rf"evaluation-shaped, 8 prompts .*: engine {NUM} examples/s",
    ],
    "bench_fp8_gpu": [
        rf"^snakellm train fp8 \(tensorwise\)\s+{NUM}",
        rf"^hand-written Llama torchao fp8 \(tensorwise\)\s+{NUM}",
        rf"final loss \(mean of the last 10 steps\): bf16 {NUM}, fp8 {NUM}",
        rf"loss at step 8 \(issue 30's bar: within 1% of bf16 at step 300\): bf16 {NUM}, fp8 {NUM}",
        r"first resumed step's loss identical .*; every step identical",
        r"bf16 again \(the same command, GPU visible\): step 8 [\d.]+, \+0\.000% from the first bf16 run",
        r"fp8 again \(the same command, GPU visible\): step 8 [\d.]+, \+0\.000% from the first fp8 run",
        r"text data: the repository's English text, 1,748,647 GPT-2 \(its first 1,024 merges\) tokens",
        r"two runs a side, their means: step 8 bf16 [\d.]+, fp8 [\d.]+, [-+][\d.]+%; final loss .*: PASS; "
        r"the four cross pairs: step 8 ",
        r"^pooled numerics: 1 result files, 2 bf16 and 2 fp8 runs$",
        r"^loss at step 8: bf16 [\d.]+ \(runs spread 0\.00%\), fp8 [\d.]+ \(0\.00%\): fp8 [-+][\d.]+% .*: PASS$",
    ],
    "bench_moe_gpu": [
        rf"^snakellm train\s+{NUM} tokens/s  MFU \(active\)",
        rf"^hand-written compiled MoE\s+{NUM} tokens/s",
        rf"^snakellm / hand-written: {NUM}x",
        rf"^grouped experts / megatron-core's SequentialMLP: {NUM}x",
    ],
    "bench_train_8b_gpu": [rf"^\S+: {NUM} tokens/s/GPU, MFU [\d.]+%, peak \S+, {NUM} s/step, loss {NUM} -> {NUM}"],
    "bench_train_gpu": [rf"tiny megatron-loss: {NUM} tokens/s", rf"^megatron-loss\s+16\s+{NUM}\s+{NUM}"],
    "bench_finetune_gpu": [
        *(rf'"method": "{m}", "tp": 1, "tokens_per_s": {NUM},' for m in ("lora", "full")),
        # FSDP over 2 gloo ranks, with the one-process run's losses
        rf'^full fsdp 2: {NUM} tokens/s/GPU; MFU .*"fsdp": 2, "tokens_per_s": {NUM},.*"losses_match": true',
        # conversations (ChatML, packed, replies trained) beside the SQuAD-style run, in the same run
        *(
            rf"^chat {m} \(dense\): {NUM} tokens/s \(all positions; real {NUM}, trained {NUM}\) vs SQuAD {NUM}: [\d.]+x"
            for m in ("lora", "full")
        ),
    ],
    "bench_dpo_gpu": [
        rf"^ours: snakellm finetune --method dpo \(LoRA\): {NUM} tokens/s \({NUM} s/step, {NUM} tokens a step",
        rf"^TRL DPOTrainer \+ peft LoRA: {NUM} tokens/s \({NUM} s/step, {NUM} tokens a step",
        rf"^ours / TRL: {NUM}x \(bar 1.5x\)",
    ],
    "bench_parallel_gpu": [rf"\| tiny \| 1 GPU \| 1 \| {NUM} \|", rf"\| tiny \| DP=2 \| 2 \| {NUM} \| {NUM} \| {NUM}%"],
    "bench_pipeline_gpu": [
        rf"^  pp1\s+1\s+\S+\s+{NUM}\s+{NUM}",
        rf"^  pp2-interleaved-recompute-full\s+2\s+\S+\s+{NUM}\s+{NUM}",
        r"^parity: PASS$",
        rf"pp2-interleaved-recompute-full: estimate {NUM} GiB",
    ],
    "bench_tokenize": [
        rf"{title}.*?: {NUM}M tokens(?:.|\n)*?snakellm tokenize, 2 threads \(step\)\s+{NUM}M"
        for title in ("GPT-2 BPE", "SentencePiece", "tokenizer.json")
    ],
}
# smokes of more than ~10 s on 2 cores (measured): 3 to 5 processes that import torch and megatron-core
SLOW = {
    "bench_fp8_gpu",
    "bench_moe_gpu",
    "bench_pipeline_gpu",
    "bench_train_8b_gpu",
    "bench_convert",
    "bench_chunk",  # datatrove's ParquetReader and WarcReader + Trafilatura (its extractor's child process) beside ours
    "bench_curate",  # datatrove's four-stage pipeline in its own processes beside ours: ~7 s of CPU
    "bench_generate_gpu",
    "bench_train_gpu",
    "bench_finetune_gpu",
    "bench_parallel_gpu",
    "bench_dpo_gpu",  # reference-logprobs, finetune and TRL's trainer: three processes importing torch
}


def run_smoke(script: str) -> tuple[subprocess.CompletedProcess, float]:
    """The script's smoke, run from a temp directory that is also its $OUT: nothing lands in the checkout."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"snakellm-{script}-") as tmp:
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / f"{script}.py"), "--smoke"],
            cwd=tmp,
            env={**env_with_venv(), "OUT": tmp},
            capture_output=True,
            text=True,
            timeout=900,
        )
    return proc, time.monotonic() - t0


def run_smokes(request: pytest.FixtureRequest):
    """The smokes of the requesting module's tests this session, started together (two at a time, slowest
    first), all of them waited for here, in the shared fixture's setup (its own time budget): a test that
    waited in its call would carry the smokes queued before its own (118 s of wall time for bench_chunk's once)."""
    wanted = {
        item.callspec.params["script"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "script" in item.callspec.params
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures: dict[str, Future] = {s: pool.submit(run_smoke, s) for s in sorted(wanted, key=lambda s: s not in SLOW)}
        wait(futures.values())
        yield futures


def check_smoke(script: str, smokes: dict[str, Future]) -> None:
    proc, seconds = smokes[script].result() if script in smokes else run_smoke(script)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --smoke: exit {proc.returncode}\n{out[-4000:]}"
    patterns = FIGURES.get(script) or [rf"{NUM}"]
    for pattern in patterns:
        m = re.search(pattern, out, re.M)
        assert m, f"{script} --smoke printed no figure for {pattern!r}:\n{out[-4000:]}"
        for g in m.groups():
            assert float(g.replace(",", "")) > 0, (script, pattern, m.group(0))
    print(f"{script} --smoke: {seconds:.1f} s")


@pytest.fixture(scope="module")
def smokes(request: pytest.FixtureRequest):
    yield from run_smokes(request)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_smoke_prints_its_figures(script: str, smokes: dict[str, Future]):
    check_smoke(script, smokes)


def test_every_bench_script_is_covered():
    """The glob finds the scripts FIGURES knows (a renamed script's entry would silently go unused)."""
    assert len(ALL_SCRIPTS) >= 9 and set(FIGURES) <= set(ALL_SCRIPTS), set(FIGURES) - set(ALL_SCRIPTS)
    assert set(TRAINING) <= set(ALL_SCRIPTS), set(TRAINING) - set(ALL_SCRIPTS)


@pytest.mark.slow  # ~30 s: two bench_finetune_gpu smokes and a bench_generate_gpu smoke behind the wrapper
def test_the_gpu_8b_wrapper_smoke(tmp_path):
    """`SMOKE=1 bash scripts/gpu_8b.sh` (issue 31's unattended 8B figures on the CPU): every stage exits 0 and the
    summary prints each figure against its bar."""
    import os

    env = env_with_venv()
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env |= {"SMOKE": "1", "OUT": str(tmp_path / "out"), "W": str(tmp_path / "work")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_8b.sh")], capture_output=True, text=True, env=env, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    stages = sorted(re.findall(r"=== (\S+): exit (\d+)", out))  # B runs beside A: either may end first
    assert stages == [("A-lora-1gpu", "0"), ("B-generate", "0"), ("D-full-fsdp2", "0")], stages
    summary = out.split("=== summary", 1)[1]
    for line in (
        rf"LoRA, one GPU: {NUM} tokens/s/GPU, .*bar 12,500",
        rf"full SFT, FSDP: {NUM} tokens/s/GPU, .*bar 50%",
        rf"generation batch 4: {NUM} tokens/s, {NUM}x transformers",
        rf"evaluation-shaped prompts through the engine: {NUM} examples/s",
    ):
        assert re.search(line, summary), (line, summary)


def test_fp8_numerics_lanes_give_each_run_a_gpu_where_there_are_enough():
    """bench_fp8_gpu's lanes: a GPU per kind of run while they last; else a precision's second run follows
    its first on that GPU (the FP8 resume always stays with the FP8 run: one kind)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_fp8_gpu import plan_lanes

    numerics = ["numerics-fp8", "numerics-bf16", "bf16-again", "fp8-again"]
    assert plan_lanes(numerics, 4) == {"numerics-fp8": 0, "numerics-bf16": 1, "bf16-again": 2, "fp8-again": 3}
    assert plan_lanes(numerics, 2) == {"numerics-fp8": 1, "numerics-bf16": 0, "bf16-again": 0, "fp8-again": 1}
    assert set(plan_lanes(numerics, 1).values()) == {0}
    every = ["ours", "reference", *numerics[:3]]
    assert plan_lanes(every, 4) == {"ours": 0, "reference": 1, "numerics-fp8": 2, "numerics-bf16": 3, "bf16-again": 3}
    assert plan_lanes(every[:4], 3) == {"ours": 0, "reference": 1, "numerics-fp8": 2, "numerics-bf16": 1}
