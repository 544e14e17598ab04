#!/usr/bin/env python3
"""8B pretraining throughput of `snakellm train` on 4 GPUs: Llama 3.1 8B's shape and the seed's GPT 8B.

One unattended run (about 8 minutes on 4 H100s) of the real command (``torchrun ... snakellm train``:
the same model build, data pipeline, optimizer and loop as the workflow) on random token ids of the
model's vocabulary, bf16, no checkpoints, no evaluation, once per case. A case is a model, a sequence
length and a layout (the ``snakellm train`` flags). Each case's figures are printed the moment it ends
(tokens/s per GPU, MFU, peak memory, first and last loss), a failed case (out of memory, a crash, its
timeout) is reported and the next one runs, the cases stop when the time budget would be exceeded, and
a table with the anchors closes the run. ``$OUT/bench_8b.json`` is rewritten after every case.

MFU = tokens/s per GPU x (6 N + 12 L h s) / 989.4e12 (N with the padded vocabulary; dense bf16 peak of
an H100/H200 SXM). Bars (issue 29): Llama 3.1 8B at sequence 8192 >= 50% on 4 x 80 GB; GPT 8B at
TP 4 >= 40%.

    python scripts/bench_train_8b_gpu.py                         # the default cases, 4 GPUs
    python scripts/bench_train_8b_gpu.py --cases llama8k-fsdp,gpt8b-tp4
    python scripts/bench_train_8b_gpu.py --case 'mine=llama3-8b:8192:--fsdp --micro-batch-size 1'
    python scripts/bench_train_8b_gpu.py --list
    python scripts/bench_train_8b_gpu.py --nproc 8               # issue 48's cases on 8 GPUs (its bars)
    python scripts/bench_train_8b_gpu.py --nproc 8 --cases moe   # issue 49: Qwen3-30B-A3B at EP 8
    python scripts/bench_train_8b_gpu.py --smoke                 # CPU, tiny models, seconds: the same path

A mixture of experts' MFU counts its active parameters (the router's top-k experts), as
``snakellm.models.counts.flops_per_token`` does for the training's own MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

warnings.filterwarnings("ignore")  # megatron-core's "Transformer Engine and Apex are not installed" on import

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
PEAK_TFLOPS = 989.4
GPT8B_YAML = REPO / "config" / "examples" / "slimpajama-gpt-8b.yaml"

# published anchors (Transformer Engine, seq 8192, tokens/s per GPU, bf16) and the bars of issue 29
ANCHORS = [
    ("NeMo 25.02, 8 x H100, Llama 3.1 8B, TP1 PP1 CP2 (TE)", 10_682),
    ("torchtitan, 8 x H100 (500 W), Llama 3.1 8B, FSDP + compile", 6_667),
    ("bar: Llama 3.1 8B seq 8192, 50% MFU on 4 x 80 GB", None),
    ("bar: GPT 8B (slimpajama-gpt-8b.yaml) TP 4, 40% MFU", None),
]


# issue 48 (8 GPUs, Llama 3.1 8B at sequence 8192, tokens/s per GPU) and issue 49 (Qwen3-30B-A3B, sequence 4096)
ANCHORS_8 = [
    ("NeMo 25.02, 8 x H100, Llama 3.1 8B, bf16 (TE)", 10_682),
    ("Megatron-Bridge 25.11, 8 x H100, FSDP 8, FP8 current scaling", 14_451),
    ("torchtitan, 8 x H100, bf16 / Float8", 6_667),
]
BARS_8 = [("llama3-8b", 8192, False, 10_682), ("llama3-8b", 8192, True, 13_000)]  # model, seq, fp8, tokens/s/GPU
ANCHORS_MOE = [
    ("NeMo AutoModel, 8 x H100, Qwen3-30B-A3B, bf16, EP 8, seq 4096", 12_040),
    ("Megatron-Bridge 26.06, 16 x H100, FP8, EP 16, seq 4096", 8_826),
]
BARS_MOE = [("qwen3-30b-a3b", 4096, False, 12_040)]


@dataclass
class Case:
    name: str
    model: str  # a preset name, or "gpt-8b" (the model section of slimpajama-gpt-8b.yaml)
    seq: int
    flags: list[str]
    note: str = ""
    if_oom: str | None = None  # the case run next when this one runs out of memory
    gbs: int | None = None  # sequences per step (default: --tokens-per-gpu per data-parallel rank)
    timeout: float | None = None  # seconds before it is killed, where start-up is longer (compilation)


# the layouts worth measuring at 8B on 80 GB cards, most important first: a partial run still has the bars
RC8 = ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "8"]
FSDP1 = ["--fsdp", "--micro-batch-size", "1", "--loss", "compiled"]  # FSDP2 over the ranks, micro batch 1
EP8 = ["--ep", "8", "--micro-batch-size", "1", "--loss", "compiled", "--compile"]  # experts over 8 ranks, compiled
CASES = {
    c.name: c
    for c in [
        Case(
            "llama8k-fsdp-rc8",
            "llama3-8b",
            8192,
            [*FSDP1, *RC8],
            "FSDP2 over 4 ranks, the first 8 of 32 layers recomputed (megatron-core's full/block): fits 80 GB",
            if_oom="llama8k-fsdp-rc12",
        ),
        Case(
            "llama8k-fsdp-rc12",
            "llama3-8b",
            8192,
            [*FSDP1, *RC8[:-1], "12"],
            "the same with 12 of 32 layers recomputed (run when 8 runs out of memory)",
        ),
        Case(
            "llama8k-fsdp-rc8-compile",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", *RC8],
            "the same + torch.compile of every layer",
            timeout=200,
        ),
        Case(
            "llama8k-fsdp",
            "llama3-8b",
            8192,
            FSDP1,
            "FSDP2 (ZeRO-3) over 4 ranks, no recomputation (about 84 GB: an H200's size)",
        ),
        Case(
            "gpt8b-tp4",
            "gpt-8b",
            2048,
            ["--tp", "4", "--sequence-parallel", "--micro-batch-size", "1", "--loss", "compiled"],
            "the recipe's TP 4 + sequence parallel, vocabulary-parallel fused loss",
        ),
        Case(
            "gpt8b-tp4-mbs8",
            "gpt-8b",
            2048,
            ["--tp", "4", "--sequence-parallel", "--micro-batch-size", "8", "--loss", "compiled"],
            "TP 4 + SP with micro batch 8: 8x larger GEMMs and collectives per launch (micro batch 1 peaked at "
            "31.9 GiB, 29 of them model states)",
        ),
        Case(
            "gpt8b-tp4-mbs8-gbs32",
            "gpt-8b",
            2048,
            ["--tp", "4", "--sequence-parallel", "--micro-batch-size", "8", "--loss", "compiled"],
            "the same with 4 micro-batches a step (the recipe's global batch is 512 sequences): the optimizer "
            "step and the gradient norm are paid once per 64K tokens instead of per 16K",
            gbs=32,
        ),
        Case(
            "llama8k-fsdp-rc8-fp8",
            "llama3-8b",
            8192,
            [*FSDP1, *RC8, "--precision", "fp8", "--profile-steps", "4:4"],
            "llama8k-fsdp-rc8 with float8 matmuls in the block linears (torchao, tensorwise; issue 30's 1.25x bar)",
            timeout=170,
        ),
        Case(
            "llama8k-fsdp-rc8-fp8-compile",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", *RC8, "--precision", "fp8"],
            "the same + torch.compile of every layer (fuses torchao's casts, as torchtitan runs float8)",
            timeout=200,
        ),
        Case(
            "llama8k-fsdp-rc8-fp8rw-compile",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", *RC8, "--precision", "fp8", "--fp8-recipe", "rowwise"],
            "the same with torchao's rowwise recipe (a scale per row, e4m3 throughout)",
            timeout=200,
        ),
        Case(
            "llama8k-fsdp-rc8-fp8ag-compile",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", *RC8, "--precision", "fp8", "--fp8-all-gather"],
            "llama8k-fsdp-rc8-fp8-compile with the weights all-gathered in float8 (each rank casts its shard; "
            "torchtitan's float8 all-gather)",
            timeout=200,
        ),
        Case(
            "llama8k-fsdp-rc8-compile-bf16rs",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", *RC8, "--grad-reduce-dtype", "bf16"],
            "llama8k-fsdp-rc8-compile with the gradients reduce-scattered in bf16 (NeMo's performance recipes' "
            "grad_reduce_in_fp32 false; accumulated into the fp32 shards): the bf16 side of issue 30's bar in that "
            "setting",
            timeout=200,
        ),
        Case(
            "llama8k-fsdp-rc8-fp8ag-compile-bf16rs",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", *RC8, "--precision", "fp8", "--fp8-all-gather", "--grad-reduce-dtype", "bf16"],
            "llama8k-fsdp-rc8-fp8ag-compile with the gradients reduce-scattered in bf16 (its FP8 side)",
            timeout=200,
        ),
        Case(
            "llama2k-fsdp",
            "llama3-8b",
            2048,
            ["--fsdp", "--micro-batch-size", "2", "--loss", "compiled"],
            "FSDP2 over 4 ranks, micro batch 2",
        ),
        Case(
            "llama8k-fsdp-compile",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile"],
            "FSDP2 + torch.compile of every layer",
        ),
        Case(
            "gpt8b-fsdp",
            "gpt-8b",
            2048,
            ["--fsdp", "--micro-batch-size", "2", "--loss", "compiled"],
            "the GPT 8B at FSDP2 instead of TP 4",
        ),
        Case(
            "llama8k-tp2-fsdp",
            "llama3-8b",
            8192,
            ["--tp", "2", "--sequence-parallel", "--fsdp", "--micro-batch-size", "1", "--loss", "compiled"],
            "TP 2 + SP inside, FSDP2 over 2",
        ),
        Case(
            "gpt8b-tp4-compile",
            "gpt-8b",
            2048,
            ["--tp", "4", "--sequence-parallel", "--micro-batch-size", "1", "--loss", "compiled", "--compile"],
            "TP 4 + SP + torch.compile of every layer",
        ),
        Case(
            "gpt8b-tp4-megatron-loss",
            "gpt-8b",
            2048,
            ["--tp", "4", "--micro-batch-size", "1", "--loss", "megatron"],
            "issue 29's measured TP 4 layout (megatron-core's unfused loss), for comparison",
        ),
        Case(
            "llama2k-tp2-distopt",
            "llama3-8b",
            2048,
            ["--tp", "2", "--sequence-parallel", "--distributed-optimizer", "--micro-batch-size", "1"],
            "issue 29's TP 2 x DP 2 + distributed optimizer (29.3% on H200s)",
        ),
        # issue 48: 8 GPUs (an H200's 141 GB holds FSDP 8's ~16 GB of states a rank and the activations unrecomputed)
        Case(
            "llama8k-fsdp-compile-bf16rs",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", "--grad-reduce-dtype", "bf16"],
            "FSDP2 over the ranks without recomputation, compiled, gradients reduce-scattered in bf16",
            if_oom="llama8k-fsdp-rc8-compile-bf16rs",
            timeout=200,
        ),
        Case(
            "llama8k-fsdp-fp8ag-compile-bf16rs",
            "llama3-8b",
            8192,
            [*FSDP1, "--compile", "--precision", "fp8", "--fp8-all-gather", "--grad-reduce-dtype", "bf16"],
            "the same in FP8 (float8 all-gather of the weights)",
            if_oom="llama8k-fsdp-rc8-fp8ag-compile-bf16rs",
            timeout=200,
        ),
        # issue 49: mixtures of experts with expert parallelism (dropless routing, megatron-core's alltoall dispatcher)
        Case(
            "qwen3moe-ep8",
            "qwen3-30b-a3b",
            4096,
            EP8,
            "Qwen3-30B-A3B, 16 of 128 experts a rank, the dense part replicated over the 8 ranks",
            if_oom="qwen3moe-ep8-rc",
            timeout=240,
        ),
        Case(
            "qwen3moe-ep8-rc",
            "qwen3-30b-a3b",
            4096,
            [*EP8, "--distributed-optimizer", "--recompute", "selective"],
            "the same with megatron-core's selective recomputation and the dense part's Adam states sharded over "
            "the 8 ranks (the experts' stay whole: one rank a set of experts, expert data-parallel size 1)",
            timeout=240,
        ),
        Case(
            "qwen3moe-ep8-fp8",
            "qwen3-30b-a3b",
            4096,
            [*EP8, "--precision", "fp8"],
            "qwen3moe-ep8 with float8 matmuls (torchao, tensorwise): issue 49's FP8 faster than bf16",
            if_oom="qwen3moe-ep8-rc-fp8",
            timeout=240,
        ),
        Case(
            "qwen3moe-ep8-rc-fp8",
            "qwen3-30b-a3b",
            4096,
            [*EP8, "--distributed-optimizer", "--recompute", "selective", "--precision", "fp8"],
            "qwen3moe-ep8-rc in FP8",
            timeout=240,
        ),
        # issue 49's third point: Mixtral 8x7B at EP 8, one expert of each layer a rank (~7.2B parameters: 5.6B of
        # experts, 1.6B dense). snakellm.models.memory at sequence 4096, micro batch 1: 154 GiB with the optimizer
        # replicated and the layers' activations kept, 138 GiB with the dense part's Adam states sharded (the
        # distributed optimizer), 108.5 GiB with full recomputation too: the one layout of the three that fits
        # an H200's 141 GB
        Case(
            "mixtral-ep8-do-rc",
            "mixtral-8x7b",
            4096,
            [*EP8, "--distributed-optimizer", "--recompute", "full"],
            "Mixtral 8x7B, one expert of each layer a rank, the dense part's Adam states sharded, every layer "
            "recomputed",
            timeout=300,
        ),
    ]
}
# measured 2026-11-26/27 on 4 H200s (docs/benchmarks.md): llama8k-fsdp 55.2% MFU at 86.2 GiB (too much for 80 GB),
# llama8k-fsdp-rc8 51.1% at 74.0 GiB, gpt8b-tp4 11.9%; gpt8b-tp4-compile did not reach its first step in 110 s.
# On 4 H100s (2026-11-27): llama8k-fsdp-rc8 ran out of memory (71 GiB allocated by torch + ~7 GiB of context and
# NCCL buffers on a 79.2 GiB card), gpt8b-tp4-mbs8 38.9%, gpt8b-fsdp 41.3%. With the fused SwiGLU (same day, H100s):
# llama8k-fsdp-rc8 52.3% at 63.5 GiB, gpt8b-tp4-mbs8-gbs32 41.9%, llama8k-fsdp-rc8-fp8-compile 65.5% (1.252x bf16),
# llama8k-fsdp-rc8-fp8 30.0% with eager casts, 62.8% (1.201x) with the casts compiled. Fifth session, 4 H200s, one
# call: llama8k-fsdp-rc8-compile 55.7%, -fp8-compile 68.2% (1.224x), -fp8rw-compile 61.6% (1.106x). Sixth session,
# 4 H200s, one call: -compile 55.6%, -fp8-compile 68.0% (1.222x), -fp8ag-compile 69.1% (1.244x: the bar is 1.25x).
# Seventh session, 4 H200s: -bf16rs cases (gradients reduced in bf16) +2.0-2.3% in both arms, ratio 1.246x; then the
# pre-all-gather cast fused (one compiled kernel): -compile 56.6%, -fp8ag-compile 72.2% (1.276x: PASS), -compile-bf16rs
# 57.7%, -fp8ag-compile-bf16rs 73.9% (1.280x).
# The default run (about 9 minutes): the two bars in 80 GB layouts (the Llama shape with 8 layers recomputed, which
# fits an H100 since the GPU runs megatron-core's fused SwiGLU, 5 GiB less; TP 4 with micro batch 8 and 4 micro-batches
# a step), then FP8 in the Llama layout (eager, with the kernel table of step 4, and compiled) and bf16 compiled
# issue 48's run on 8 GPUs (--nproc 8 without --cases): its two bars first, then the GPT 8B's two layouts
DEFAULT_8 = [
    "llama8k-fsdp-compile-bf16rs",
    "llama8k-fsdp-fp8ag-compile-bf16rs",
    "gpt8b-tp4-mbs8-gbs32",  # at 8 ranks: TP 4 x DP 2
    "gpt8b-fsdp",
]
# --cases moe: issue 49's (the OOM fallbacks run only when needed), Mixtral 8x7B's shape last
MOE = ["qwen3moe-ep8", "qwen3moe-ep8-fp8", "mixtral-ep8-do-rc"]
DEFAULT = [
    "llama8k-fsdp-rc8",
    "gpt8b-tp4-mbs8-gbs32",
    "llama8k-fsdp-rc8-fp8-compile",
    "llama8k-fsdp-rc8-fp8",
    "llama8k-fsdp-rc8-compile",
]

# --smoke: the same cases on CPU (gloo, fp32), tiny models, 2 ranks
SMOKE_MODELS = {
    "llama3-8b": "tiny-llama",
    "gpt-8b": "tiny-llama",
    "qwen3-30b-a3b": "tiny-qwen3-moe",
    "mixtral-8x7b": "tiny-mixtral",
}


def gpt8b_model_flags() -> list[str]:
    """The model section of slimpajama-gpt-8b.yaml as `snakellm train` flags (the file is the one source)."""
    import yaml

    model = yaml.safe_load(GPT8B_YAML.read_text())["runs"]["gpt-8b"]["model"]
    flags = []
    for k, v in model.items():
        if k == "seq_length":
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            flags.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            flags += [flag, str(v)]
    return flags


def model_flags(model: str, smoke: bool) -> list[str]:
    if smoke:
        return ["--preset", SMOKE_MODELS.get(model, model)]
    if model == "gpt-8b":
        return ["--preset", "tiny-llama", *gpt8b_model_flags()]
    return ["--preset", model]


def vocab_of(model: str, smoke: bool) -> int:
    from snakellm import models

    if smoke:
        return 256
    if model == "gpt-8b":
        return 50257  # the recipe's GPT-2 BPE tokenizer
    if model.startswith("llama3"):
        return 128256
    return models.resolve(model, {}).get("vocab_size") or {"qwen3-30b-a3b": 151936, "mixtral-8x7b": 32000}.get(
        model, 50257
    )


def run_case(c: Case, args, out: Path) -> dict:
    from bench_train_gpu import make_data

    nproc, steps = args.nproc, args.warmup + args.steps
    seq = args.smoke_seq if args.smoke else c.seq
    # tensor-parallel ranks work on the same sequences: tp times fewer per step (a TP step stays short)
    tp = int(c.flags[c.flags.index("--tp") + 1]) if "--tp" in c.flags and not args.smoke else 1
    gbs = (
        args.global_batch_size or (None if args.smoke else c.gbs) or (nproc // tp) * max(1, args.tokens_per_gpu // seq)
    )
    vocab = vocab_of(c.model, args.smoke)
    tokens = int(steps * gbs * (seq + 1) * 1.05)
    blend = make_data(Path(args.workdir) / f"data-{vocab}-{seq}", tokens, vocab=vocab)
    run_dir = Path(args.workdir) / "runs" / c.name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    flags = list(c.flags)
    if args.smoke:  # CPU: no compiled code (no compiler needed, seconds), fp32 (no FP8 on a CPU: its bf16 layout)
        flags = [f for f in bf16_flags(flags) if f != "--compile"]
        flags = [("eager" if f == "compiled" else f) for f in flags]
        flags = [(str(min(int(f), nproc)) if prev in ("--tp", "--ep") else f) for prev, f in zip(["", *flags], flags)]
        flags = [
            (str(min(int(f), 2)) if prev in ("--recompute-num-layers", "--micro-batch-size") else f)
            for prev, f in zip(["", *flags], flags)
        ]
    if args.breakdown and "--profile-steps" not in flags:  # one measured step profiled: where its time goes
        flags += ["--profile-steps", f"{args.warmup + 2}:{args.warmup + 2}"]
    train = [
        "train",
        "--blend",
        str(blend),
        "--run-dir",
        str(run_dir),
        *model_flags(c.model, args.smoke),
        "--seq-length",
        str(seq),
        "--steps",
        str(steps),
        "--global-batch-size",
        str(gbs),
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--no-checkpoints",
        "--no-tensorboard",
        "--no-progress",
        "--lr",
        "1e-4",
        "--warmup-steps",
        "2",
        "--split",
        "100,0,0",
        "--precision",
        "fp32" if args.smoke else "bf16",
        *(["--device", "cpu", "--threads", "1"] if args.smoke else []),
        *flags,
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    launch += ["-m", "snakellm.cli", *train]
    log = out / f"{c.name}.log"
    res: dict = {"case": c.name, "gbs": gbs, "model": c.model, "seq": seq, "flags": c.flags, "nproc": nproc}
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        with open(log, "w") as fh:
            fh.write(shlex.join(launch) + "\n")
            fh.flush()
            proc = subprocess.run(
                launch, stdout=fh, stderr=subprocess.STDOUT, timeout=args.case_timeout, env=env, cwd=REPO
            )
        res["rc"] = proc.returncode
    except subprocess.TimeoutExpired:
        res["rc"] = "timeout"
    res["wall_s"] = round(time.time() - t0, 1)
    if (run_dir / "profile.txt").exists():  # --profile-steps: the kernel table beside the log
        (out / f"{c.name}.profile.txt").write_text((run_dir / "profile.txt").read_text())
    if (run_dir / "profile-breakdown.json").exists():  # and the step's time split (snakellm.train.step_breakdown)
        res["breakdown"] = json.loads((run_dir / "profile-breakdown.json").read_text())
    res.update(read_metrics(run_dir, args, seq, gbs))
    if res["rc"] != 0:
        text = log.read_text(errors="replace")
        res["error"] = ("OUT OF MEMORY: " if "OutOfMemoryError" in text or "out of memory" in text else "") + text[
            -2500:
        ]
    return res


def read_metrics(run_dir: Path, args, seq: int, gbs: int) -> dict:
    """Steady-state figures from the live metrics (kept even when the run died later)."""
    live = run_dir / "checkpoints" / "metrics.live.jsonl"
    path = run_dir / "metrics.jsonl" if (run_dir / "metrics.jsonl").exists() else live
    if not path.exists():
        return {}
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    train = [r for r in recs if "loss" in r]
    if not train:
        return {}
    steady = [r for r in train if r["step"] > args.warmup and r.get("tokens_per_s")]
    tps = statistics.median(r["tokens_per_s"] for r in steady) if steady else None
    out = {
        "steps_done": train[-1]["step"],
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "tokens_per_s": tps,
    }
    summary = run_dir / "train_summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        out["flops_per_token"] = s["flops_per_token"]
        out["params"] = s["params"]
        out["peak_gib"] = s.get("peak_gpu_memory_gib")
    if tps and "flops_per_token" in out:
        per_gpu = tps / args.nproc
        out["tokens_per_s_per_gpu"] = per_gpu
        out["mfu"] = per_gpu * out["flops_per_token"] / (args.peak_tflops * 1e12)
        out["step_s"] = gbs * seq / tps
    return out


def breakdown_lines(r: dict) -> list[str]:
    """Rank 0's profiled step of the case (``--breakdown``), as snakellm.train.step_breakdown prints it."""
    from snakellm.train.step_breakdown import Breakdown

    b = dict(r["breakdown"])
    b.pop("idle_s", None)
    return [f"  {ln}" for ln in Breakdown(**b).lines()]


def line(r: dict) -> str:
    if r.get("tokens_per_s_per_gpu"):
        peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "n/a"
        return (
            f"{r['case']}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {r['mfu']:.1%}, peak {peak}, "
            f"{r['step_s']:.2f} s/step, loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} [{r['wall_s']}s]"
        )
    return f"{r['case']}: FAILED rc={r.get('rc')} after {r.get('steps_done', 0)} steps [{r.get('wall_s')}s]"


def table(results: list[dict], args) -> str:
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke)"
    rows = [
        f"\n{args.nproc} x {dev}, torch {torch.__version__}, bf16, {args.tokens_per_gpu} tokens per GPU and step, "
        f"{args.steps} measured steps after {args.warmup}; MFU = tokens/s/GPU x (6N + 12 L h s) / {args.peak_tflops}e12",
        f"{'case':28s} {'model':13s} {'seq':>5s} {'tok/s/GPU':>10s} {'MFU':>6s} {'peak GiB':>9s} "
        f"{'loss first':>10s} {'last':>8s}  layout",
    ]
    moe = any(r["model"] in MOE_MODELS for r in results)
    for name, tps in anchors_of(results, args):
        seq = 4096 if "seq 4096" in name else 8192
        rows.append(f"{'[anchor] ' + name:28s}" if tps is None else f"{'[anchor]':28s} {'':13s} {seq:>5d} {tps:>10,d}")
        if tps is not None:
            rows[-1] += f" {'':>6s} {'':>9s} {'':>10s} {'':>8s}  {name}"
        else:
            rows[-1] = f"{'[bar]':28s} {name[5:]}"
    for r in results:
        layout = " ".join(r["flags"])
        if r.get("tokens_per_s_per_gpu"):
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
            rows.append(
                f"{r['case']:28s} {r['model']:13s} {r['seq']:>5d} {r['tokens_per_s_per_gpu']:>10,.0f} "
                f"{r['mfu']:>6.1%} {peak:>9s} {r['first_loss']:>10.4f} {r['last_loss']:>8.4f}  {layout}"
            )
        else:
            why = "OOM" if str(r.get("error", "")).startswith("OUT OF MEMORY") else f"rc={r.get('rc')}"
            rows.append(f"{r['case']:28s} {r['model']:13s} {r['seq']:>5d} {'failed':>10s} {why:>6s}  {layout}")
    ratios = fp8_ratios(results, bar=1.0 if moe else 1.25)
    if ratios:
        rows += ["FP8 against bf16 in the same layout, this run:", *("  " + x for x in ratios)]
    verdicts = bar_verdicts(results, args)
    if verdicts:
        rows += [f"bars at {args.nproc} GPUs, this run:", *("  " + x for x in verdicts)]
    return "\n".join(rows)


MOE_MODELS = ("qwen3-30b-a3b",)


def anchors_of(results: list[dict], args) -> list[tuple[str, int | None]]:
    """The anchors beside what ran: issue 49's for a mixture of experts, issue 48's at 8 GPUs, else issue 29's."""
    moe = any(r["model"] in MOE_MODELS for r in results)
    dense = any(r["model"] not in MOE_MODELS for r in results)
    out: list[tuple[str, int | None]] = []
    if dense:
        out += ANCHORS_8 if args.nproc >= 8 else ANCHORS
    if moe:
        out += ANCHORS_MOE
    return out


def bar_verdicts(results: list[dict], args) -> list[str]:
    """Issue 48's and 49's bars (tokens/s per GPU, at 8 GPUs) against the best case of each kind that ran."""
    if args.nproc < 8 or args.smoke:
        return []
    rows = []
    for model, seq, fp8, bar in [*BARS_8, *BARS_MOE]:
        done = [
            r
            for r in results
            if r.get("tokens_per_s_per_gpu")
            and r["model"] == model
            and r["seq"] == seq
            and ("fp8" in r["flags"]) == fp8
        ]
        if not done:
            continue
        best = max(done, key=lambda r: r["tokens_per_s_per_gpu"])
        x = best["tokens_per_s_per_gpu"]
        verdict = "PASS" if x >= bar else "FAIL"
        rows.append(
            f"{model} seq {seq} {'FP8' if fp8 else 'bf16'}: {x:,.0f} tokens/s/GPU ({best['case']}, MFU {best['mfu']:.1%})"
            f" against {bar:,} ({verdict})"
        )
    return rows


FP8_FLAGS = {"--precision": 2, "--fp8-recipe": 2, "--fp8-all-gather": 1, "--profile-steps": 2}


def bf16_flags(flags: list[str]) -> list[str]:
    """A case's flags without its FP8 settings (and profiling): the layout of its bf16 counterpart."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in FP8_FLAGS:
            i += FP8_FLAGS[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def fp8_ratios(results: list[dict], bar: float = 1.25) -> list[str]:
    """Each measured FP8 case against the bf16 case of the same layout in this run (issue 30's bar: 1.25x; a
    mixture of experts, issue 49's: faster than bf16)."""
    done = [r for r in results if r.get("tokens_per_s_per_gpu")]
    rows = []
    for r in done:
        if "fp8" not in r["flags"]:
            continue
        base = [b for b in done if "fp8" not in b["flags"] and b["model"] == r["model"] and b["seq"] == r["seq"]]
        base = [b for b in base if bf16_flags(b["flags"]) == bf16_flags(r["flags"])]
        if base:
            x = r["tokens_per_s_per_gpu"] / base[0]["tokens_per_s_per_gpu"]
            verdict = "PASS" if x >= bar else "FAIL"
            rows.append(f"{r['case']} / {base[0]['case']}: {x:.3f}x (bar {bar}x: {verdict})")
    return rows


def parse_case(text: str) -> Case:
    """NAME=MODEL:SEQ:FLAGS (flags as one shell-quoted string)."""
    name, _, rest = text.partition("=")
    model, seq, flags = rest.split(":", 2)
    return Case(name, model, int(seq), shlex.split(flags), "from --case")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated case names (see --list), or 'moe' for {','.join(MOE)}; default {','.join(DEFAULT)} "
        f"(--nproc 8: {','.join(DEFAULT_8)}; --smoke: {DEFAULT[0]})",
    )
    p.add_argument("--case", action="append", default=[], help="an extra case NAME=MODEL:SEQ:FLAGS (repeatable)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--nproc", type=int, default=4, help="GPUs (torchrun processes)")
    p.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: --tokens-per-gpu)")
    p.add_argument(
        "--tokens-per-gpu",
        type=int,
        default=16384,
        help="sequence tokens per step and data-parallel rank (seq 8192: 2 sequences)",
    )
    p.add_argument("--steps", type=int, default=12, help="measured steps (after the warm-up ones)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (compilation, allocator)")
    p.add_argument(
        "--budget-s", type=float, default=250, help="the run's length: no case starts that would end after it"
    )
    p.add_argument("--min-case-s", type=float, default=80, help="a case's expected length (start-up + steps)")
    p.add_argument(
        "--case-timeout", type=float, default=150, help="seconds before a case is killed (at most 30 s past the budget)"
    )
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="per-GPU dense bf16 peak for MFU")
    p.add_argument("--workdir", default="/tmp/snakellm-bench-8b")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="profile one measured step of each case and print where its time goes (compute, exposed "
        "communication, optimizer, recomputation, idle; default: on at --nproc 8, issue 48's breakdown)",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, 2 ranks, 3 steps: the same code path")
    p.add_argument("--smoke-seq", type=int, default=64, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.breakdown is None:
        args.breakdown = args.nproc >= 8 and not args.smoke
    cases = dict(CASES)
    for text in args.case:
        c = parse_case(text)
        cases[c.name] = c
    if args.list:
        for c in cases.values():
            print(f"{c.name:28s} {c.model:10s} seq {c.seq:5d}  {' '.join(c.flags)}   # {c.note}")
        return 0
    if args.cases is None:  # --smoke: the first case (FSDP's path; --cases moe --smoke: expert parallelism's)
        args.cases = DEFAULT[0] if args.smoke else ",".join(DEFAULT_8 if args.nproc >= 8 else DEFAULT)
    names = [n for part in args.cases.split(",") if part for n in (MOE if part == "moe" else [part])]
    names += [parse_case(t).name for t in args.case]
    unknown = [n for n in names if n not in cases]
    if unknown:
        p.error(f"unknown case(s) {unknown}; --list shows them")
    if args.smoke:
        args.nproc, args.steps, args.warmup = 2, 2, 1
        args.global_batch_size = args.global_batch_size or 4
        args.workdir = args.workdir + "-smoke"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, results = time.time(), []
    queue = list(dict.fromkeys(names))
    while queue:
        name = queue.pop(0)
        left = args.budget_s - (time.time() - t0)
        limit = cases[name].timeout or args.case_timeout
        # a case starts only if it can end: its usual length, and most of its own limit (compiled cases)
        if (left < args.min_case_s or left < 0.6 * limit) and not args.smoke:
            print(f"{name}: skipped ({left:.0f}s of the budget left, its limit {limit:.0f}s)", flush=True)
            c = cases[name]
            results.append({"case": name, "model": c.model, "seq": c.seq, "flags": c.flags, "rc": "skipped"})
            continue
        case_args = argparse.Namespace(**{**vars(args), "case_timeout": min(limit, left + 30)})
        r = run_case(cases[name], case_args, out)
        results.append(r)
        print(line(r), flush=True)
        if r.get("breakdown"):
            print("\n".join(breakdown_lines(r)), flush=True)
        if r.get("error"):
            print("  " + r["error"][-1200:].replace("\n", "\n  "), flush=True)
        (out / "bench_8b.json").write_text(json.dumps(results, indent=2))
        fallback = cases[name].if_oom
        if str(r.get("error", "")).startswith("OUT OF MEMORY") and fallback and fallback not in queue:
            queue.insert(0, fallback)
    text = table(results, args)
    print(text, flush=True)
    (out / "bench_8b.txt").write_text(text + "\n")
    return 0 if all(r.get("tokens_per_s") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
