#!/usr/bin/env python3
"""GPU training throughput of `snakellm train`: GPT-2 124M, sequence 1024, bf16.

Runs the real command (``python -m snakellm.cli train``: the same model build,
data pipeline, optimizer and loop as the workflow) on a synthetic blend of
uniformly random GPT-2 token ids, once per variant, with no checkpoints and no
evaluation, and reads the throughput it logs to metrics.jsonl: tokens/s per
logging window, the median over the windows after the warm-up ones (which
hold torch.compile's compilation). MFU = tokens/s x (6 N + 12 L h s) / (GPUs x
peak), N = 124.5M parameters (GPT-2 with the vocabulary padded to 50304, as
llm.c counts it), peak 989.4 TFLOP/s dense bf16 per H100/H200 SXM.

    python scripts/bench_train_gpu.py                       # the default variants on 1 GPU
    python scripts/bench_train_gpu.py --variants fused --nproc 2
    python scripts/bench_train_gpu.py --list
    python scripts/bench_train_gpu.py --smoke    # seconds on the CPU: tiny, 6 steps (tests/test_bench_smoke.py)

Reference (README): llm.c ~475K tokens/s per H100 (~38% MFU); bar >= 40% MFU.

Other presets train on random ids of their own vocabulary size (llama3-1b: Llama 3's 128,256,
qwen2.5-0.5b: Qwen2's 151,936; the others GPT-2's), so N and the output layer's cost are the
real model's; ``--preset`` takes a comma-separated list (one table each):

    python scripts/bench_train_gpu.py --preset llama-1b,llama3-1b,qwen2.5-0.5b --seq-length 2048 \
        --variants fused-mbs4 --global-batch-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQ = 1024
VOCAB = 50257
# the real vocabulary of the presets whose tokenizer is not GPT-2's
PRESET_VOCAB = {"llama3-1b": 128256, "qwen2.5-0.5b": 151936}
REFERENCE = {
    "llm.c (H100)": (475_000, 0.38),
    "megatron-core local spec (measured)": (121_000, 0.106),
    "local spec + SDPA core attention (measured)": (308_000, 0.268),
}

# name -> extra `snakellm train` arguments (on top of the common ones below)
VARIANTS: dict[str, list[str]] = {
    "megatron-loss": ["--micro-batch-size", "16", "--loss", "megatron"],
    "fused": ["--micro-batch-size", "16", "--loss", "compiled"],
    "fused-mbs32": ["--micro-batch-size", "32", "--loss", "compiled"],
    "fused-compile": ["--micro-batch-size", "16", "--loss", "compiled", "--compile"],
    "fused-compile-mbs32": ["--micro-batch-size", "32", "--loss", "compiled", "--compile"],
    "fused-mbs64": ["--micro-batch-size", "64", "--loss", "compiled"],
    "fused-mbs4": ["--micro-batch-size", "4", "--loss", "compiled"],
    "fused-mbs8": ["--micro-batch-size", "8", "--loss", "compiled"],
    "fused-compile-mbs64": ["--micro-batch-size", "64", "--loss", "compiled", "--compile"],
    "fused-flash-mbs32": ["--micro-batch-size", "32", "--loss", "compiled", "--attention-backend", "flash"],
    "fused-cudnn": ["--micro-batch-size", "16", "--loss", "compiled", "--attention-backend", "cudnn"],
    "fused-compile-cudnn-mbs32": [
        "--micro-batch-size",
        "32",
        "--loss",
        "compiled",
        "--compile",
        "--attention-backend",
        "cudnn",
    ],
}
DEFAULT = ["megatron-loss", "fused", "fused-mbs32", "fused-mbs64", "fused-compile-mbs64"]


def make_data(root: Path, tokens: int, seed: int = 0, vocab: int = VOCAB) -> Path:
    """A blend.json over one MMIDIDX file of uniformly random ids below ``vocab`` (documents of 2048 tokens)."""
    blend = root / "blend.json"
    prefix = root / "random_text_document"
    if blend.exists() and json.loads(blend.read_text()).get("tokens", 0) >= tokens:
        return blend
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16 if vocab < 65500 else np.int32)
    doc = 2048
    for _ in range(tokens // doc + 1):
        ids = rng.integers(0, vocab - 1, size=doc, dtype=np.int64)
        ids[-1] = vocab - 1  # the end-of-document id
        builder.add_document(torch.from_numpy(ids), [doc])
    builder.finalize(f"{prefix}.idx")
    blend.write_text(
        json.dumps(
            {
                "data_prefix": [1.0, str(prefix)],
                "tokenizer": {"name": "gpt2", "kind": "gpt2-bpe", "vocab_size": vocab, "eod_id": vocab - 1},
                "tokens": tokens,
            }
        )
    )
    return blend


def run_variant(name: str, extra: list[str], args, blend: Path, out: Path) -> dict:
    run_dir = Path(args.workdir) / "runs" / f"{args.preset}-{name}-np{args.nproc}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    mbs = int(extra[extra.index("--micro-batch-size") + 1])
    gbs = args.global_batch_size
    cmd = [
        "snakellm",
        "train",
        "--blend",
        str(blend),
        "--run-dir",
        str(run_dir),
        "--preset",
        args.preset,
        "--seq-length",
        str(args.seq_length),
        "--steps",
        str(args.steps),
        "--global-batch-size",
        str(gbs),
        "--log-interval",
        str(args.log_interval),
        "--eval-iters",
        "0",
        "--no-checkpoints",
        "--no-tensorboard",
        "--no-progress",
        "--lr",
        "6e-4",
        "--warmup-steps",
        "2",
        "--split",
        "100,0,0",
        "--precision",
        "bf16",
        *extra,
    ]
    if args.profile and name == args.profile:
        cmd += ["--profile-steps", f"{args.steps}:{args.steps}"]
    if args.nproc > 1:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            "-m",
            "snakellm.cli",
        ] + cmd[1:]
    else:
        launch = [sys.executable, "-m", "snakellm.cli"] + cmd[1:]
    log = out / f"{args.preset}-{name}-np{args.nproc}.log"
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(
            launch,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=args.timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    wall = time.time() - t0
    res = {
        "variant": name,
        "nproc": args.nproc,
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
        "args": extra,
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        "log": str(log),
    }
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        res["error"] = log.read_text()[-3000:]
        return res
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    windows: dict[float, list[int]] = {}
    for r in recs:
        if "tokens_per_s" in r:
            windows.setdefault(r["tokens_per_s"], []).append(r["step"])
    per_window = [(min(steps), tps) for tps, steps in windows.items()]
    per_window.sort()
    skip_to = args.warmup_steps
    steady = [
        tps
        for first, tps in per_window
        if first > skip_to and not (args.profile == name and first + args.log_interval > args.steps)
    ]
    tps = statistics.median(steady) if steady else None
    summary = json.loads((run_dir / "train_summary.json").read_text())
    flops = summary["flops_per_token"]
    res.update(
        tokens_per_s=tps,
        windows=[round(t) for t in steady],
        mfu=tps * flops / (args.peak_tflops * 1e12 * args.nproc) if tps else None,
        step_s=gbs * args.seq_length / tps if tps else None,
        params=summary["params"],
        flops_per_token=flops,
        final_loss=summary["final_loss"],
    )
    prof = run_dir / "profile.txt"
    if prof.exists():
        (out / f"profile-{name}.txt").write_text(prof.read_text())
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--variants", default=",".join(DEFAULT), help="comma-separated names (see --list)")
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes); global batch scales with it")
    p.add_argument(
        "--preset", default="gpt2-124m", help="model preset(s), comma-separated (tiny: a CPU smoke test of this script)"
    )
    p.add_argument("--seq-length", type=int, default=SEQ)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--log-interval", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=6, help="steps left out of the median (compilation)")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="sequences per step (default 256 per GPU: 262K tokens, llm.c uses 512)",
    )
    p.add_argument("--peak-tflops", type=float, default=989.4, help="per-GPU dense bf16 peak for MFU")
    p.add_argument("--profile", default=None, help="variant whose last step is profiled (kernel table saved)")
    p.add_argument("--workdir", default="/tmp/snakellm-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--vocab", type=int, default=None, help="ids of the data (default: the preset's vocabulary)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds on the CPU: tiny, seq 64, 6 steps of 16, megatron-loss, a 1,024-id vocabulary, temp dirs",
    )
    args = p.parse_args(argv)
    if args.smoke:
        import tempfile

        args.preset, args.seq_length, args.steps, args.warmup_steps = "tiny", 64, 6, 2
        args.variants, args.global_batch_size, args.nproc = "megatron-loss", 16, 1
        # GPT-2's vocabulary in bf16 was most of the smoke's time (this CPU has no bf16 matrix units): 69 -> 16 s
        args.vocab = args.vocab or 1024
        args.workdir = tempfile.mkdtemp(prefix="snakellm-bench-train-smoke-")
        args.out = f"{args.workdir}/out"
    if args.list:
        for k, v in VARIANTS.items():
            print(f"{k:28s} {' '.join(v)}")
        return 0
    args.global_batch_size = args.global_batch_size or 256 * args.nproc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    ok = True
    everything: list[dict] = []
    for preset in args.preset.split(","):
        args.preset = preset
        results = bench_preset(args, out)
        everything += [{"preset": preset, **r} for r in results]
        (out / "bench.json").write_text(json.dumps(everything, indent=2))
        print_table(args, results)
        ok = ok and all(r.get("tokens_per_s") for r in results)
    if args.smoke:
        import shutil

        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if ok else 1


def bench_preset(args, out: Path) -> list[dict]:
    """Every variant of ``--variants`` for ``args.preset``, on random ids of the preset's vocabulary."""
    vocab = args.vocab or PRESET_VOCAB.get(args.preset, VOCAB)
    t0 = time.time()
    blend = make_data(
        Path(args.workdir) / f"data-{vocab}",
        int(args.steps * args.global_batch_size * (args.seq_length + 1) * 1.05),
        vocab=vocab,
    )
    print(f"data ready in {time.time() - t0:.1f}s", flush=True)
    results = []
    for name in args.variants.split(","):
        r = run_variant(name, VARIANTS[name], args, blend, out)
        results.append(r)
        msg = (
            f"{args.preset} {name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, "
            f"{r['step_s'] * 1e3:.0f} ms/step (windows {r['windows']})"
            if r.get("tokens_per_s")
            else f"{args.preset} {name}: FAILED rc={r['rc']}\n{r.get('error', '')}"
        )
        print(msg + f" [{r['wall_s']}s]", flush=True)
    return results


def print_table(args, results: list[dict]) -> None:
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(
        f"\n{args.preset}, seq {args.seq_length}, bf16, {args.nproc} x {dev}, torch {torch.__version__}, "
        f"global batch {args.global_batch_size} x {args.seq_length} tokens"
    )
    print(f"{'variant':34s} {'mbs':>4s} {'tokens/s':>12s} {'per GPU':>10s} {'MFU':>7s}")
    if args.preset == "gpt2-124m":
        for name, (tps, mfu) in REFERENCE.items():
            print(f"{'[ref] ' + name:34s} {'':>4s} {tps:>12,.0f} {tps:>10,.0f} {mfu:>7.1%}")
    for r in results:
        if r.get("tokens_per_s"):
            print(
                f"{r['variant']:34s} {r['micro_batch_size']:>4d} {r['tokens_per_s']:>12,.0f} "
                f"{r['tokens_per_s'] / args.nproc:>10,.0f} {r['mfu']:>7.1%}"
            )
        else:
            print(f"{r['variant']:34s} {r['micro_batch_size']:>4d} {'failed':>12s}")


if __name__ == "__main__":
    sys.exit(main())
