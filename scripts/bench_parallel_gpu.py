#!/usr/bin/env python3
"""Data and tensor parallelism on the GPUs at hand: one table, from real `snakellm train` runs.

For each preset: one GPU, data parallel over 2 (DP=2), tensor parallel over 2 (TP=2), tensor
parallel with megatron-core's sequence parallelism (TP=2+SP) and data parallel with the
optimizer sharded over the two ranks (DP=2+distopt), every run the same global batch of the
same sequences (same seed, same data order), so that

* tokens/s per GPU (the median over the run's logging windows, the first excluded) and the
  scaling efficiency against the one-GPU run of the same session are comparable, and
* the loss curves must agree: every layout against one GPU within bf16 tolerance. TP=2 is not
  the same model bit for bit on GPUs (the vocabulary is padded to a multiple of 128 x TP, and
  each TP rank draws its shard of the initial weights from its own RNG stream, as Megatron
  does), so the criterion is the mean loss of the last 10 steps (``--rtol``); the largest
  step-by-step difference is shown too (early steps, where the loss falls by whole units,
  dominate it).

Each configuration is one `snakellm train` under `torchrun --standalone` (NCCL on GPUs, gloo on
the CPU), writing runs/<preset>-<layout>/ as usual; this script only starts them and reads their
metrics.jsonl. On the CPU (no GPU, or --device cpu) the toy preset proves the script end to end
(tensor parallelism runs there too: the presets have no dropout):

    python scripts/bench_parallel_gpu.py --blend data/tokens/gpt2/blend.json --device cpu \\
        --presets tiny --steps 12 --micro-batch-size 2 --log-interval 3

`--smoke` does that in seconds on random GPT-2 ids (scripts/bench_train_gpu.py's data), one GPU's
layout and DP=2, in a temp directory (tests/test_bench_smoke.py runs it).

On 2 GPUs (the README's table):

    python scripts/bench_parallel_gpu.py --blend data/tokens/gpt2/blend.json --out bench.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {  # name -> (processes, tp, extra `snakellm train` flags)
    "1 GPU": (1, 1, ()),
    "DP=2": (2, 1, ()),
    "TP=2": (2, 2, ()),
    "TP=2+SP": (2, 2, ("--sequence-parallel",)),
    "DP=2+distopt": (2, 1, ("--distributed-optimizer",)),
}


def run_one(args, preset: str, layout: str, nproc: int, tp: int, extra: tuple[str, ...], workdir: Path) -> dict:
    run_dir = workdir / f"{preset}-{layout.replace(' ', '').replace('=', '').replace('+', '-')}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    seq = {"gpt2-124m": 1024, "llama-1b": 2048}.get(preset)
    mbs = args.micro_batch_size or {"gpt2-124m": 16, "llama-1b": 4}.get(preset, 2)
    gbs = mbs * 2  # the same global batch in every layout: 2 accumulation steps on 1 GPU and under TP=2
    cmd = [
        "snakellm",
        "train",
        "--blend",
        args.blend,
        "--run-dir",
        str(run_dir),
        "--preset",
        preset,
        "--steps",
        str(args.steps),
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--lr",
        "3e-4",
        "--min-lr",
        "3e-5",
        "--warmup-steps",
        "5",
        "--eval-iters",
        "0",
        "--log-interval",
        str(args.log_interval),
        "--no-checkpoints",
        "--no-tensorboard",
        "--no-progress",
        "--tp",
        str(tp),
        "--device",
        args.device,
        "--loss",
        "megatron",
        "--split",
        "100,0,0",
        "--seed",
        "1234",
    ]
    cmd += list(extra)
    if seq:
        cmd += ["--seq-length", str(seq)]
    if args.device == "cpu":
        cmd += ["--threads", "1"]
    if nproc > 1:
        cmd = ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", "--no-python", *cmd]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    log = run_dir.parent / f"{run_dir.name}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"{preset} {layout}: FAILED ({proc.returncode}), see {log}\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"preset": preset, "layout": layout, "failed": True}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    windows = sorted({r["step"]: r["tokens_per_s"] for r in train}.items())
    # one tokens_per_s per logging window (every record of a window carries it); the first window has warm-up
    per_window = [tps for step, tps in windows if step % args.log_interval == 0][1:] or [windows[-1][1]]
    tps = statistics.median(per_window)
    # MFU of the same windows (per window it is tokens/s x FLOPs per token / the GPUs' peak: proportional)
    last = train[-1]
    mfu = tps * last["mfu"] / last["tokens_per_s"] if last.get("mfu") and last.get("tokens_per_s") else None
    summary = json.loads((run_dir / "train_summary.json").read_text())
    return {
        "preset": preset,
        "layout": layout,
        "gpus": nproc,
        "tp": tp,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / nproc,
        "mfu": mfu,
        "losses": [r["loss"] for r in train],
        "wall_s": wall,
        "params": summary.get("parameters") or summary.get("params"),
        "peak_gib": summary.get("peak_gpu_memory_gib"),
    }


def render(a, results: list[dict]) -> tuple[str, bool, list[str]]:
    """The markdown table, whether every loss curve is within tolerance, and the failed runs."""
    lines = [
        "| model | layout | GPUs | tokens/s | tokens/s per GPU | scaling efficiency | MFU | "
        "last-10-step mean loss (vs 1 GPU) | largest step difference | peak memory (rank 0) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for preset in dict.fromkeys(r["preset"] for r in results):
        rs = {r["layout"]: r for r in results if r["preset"] == preset and not r.get("failed")}
        base = rs.get("1 GPU")
        for layout, r in rs.items():
            eff = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
            tail = statistics.fmean(r["losses"][-10:])
            if base and layout != "1 GPU":
                n = min(len(r["losses"]), len(base["losses"]))
                signed = (tail - statistics.fmean(base["losses"][-10:])) / statistics.fmean(base["losses"][-10:])
                rel = abs(signed)
                step = max(abs(x - y) / abs(y) for x, y in zip(r["losses"][:n], base["losses"][:n], strict=True))
                loss = (
                    f"{tail:.4f} ({signed * 100:+.2f}%: {'within' if rel <= a.rtol else 'OUTSIDE'} {a.rtol * 100:g}%)"
                )
                ok &= rel <= a.rtol
                worst = f"{step * 100:.1f}%"
            else:
                loss, worst = f"{tail:.4f}", "-"
            mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
            peak = f"{r['peak_gib']:.2f} GiB" if r.get("peak_gib") else "-"
            lines.append(
                f"| {preset} | {layout} | {r['gpus']} | {r['tokens_per_s']:,.0f} | "
                f"{r['tokens_per_s_per_gpu']:,.0f} | {eff * 100:.1f}% | {mfu} | {loss} | {worst} | {peak} |"
            )
    failed = [f"{r['preset']} {r['layout']}" for r in results if r.get("failed")]
    return "\n".join(lines), ok, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blend", help="blend.json of tokenized data (GPT-2 BPE for the presets' vocab); required")
    p.add_argument("--presets", default="gpt2-124m,llama-1b")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument(
        "--micro-batch-size", type=int, default=None, help="per GPU (default: 16 for gpt2-124m, 4 for llama-1b)"
    )
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--workdir", default="runs/bench-parallel")
    p.add_argument(
        "--rtol",
        type=float,
        default=0.02,
        help="bf16 tolerance on the last 10 steps' mean loss, relative to the one-GPU run's",
    )
    p.add_argument("--out", default=None, help="also write the markdown table (and a JSON with every loss) here")
    p.add_argument("--from-json", default=None, help="only print the table of an earlier run's --out JSON")
    p.add_argument("--smoke", action="store_true", help="seconds on the CPU: tiny, 1 GPU and DP=2, 6 steps, no --blend")
    a = p.parse_args(argv)
    if a.smoke:
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_train_gpu import make_data

        tmp = Path(tempfile.mkdtemp(prefix="snakellm-bench-parallel-smoke-"))
        a.presets, a.layouts, a.steps, a.micro_batch_size, a.log_interval = "tiny", "1 GPU,DP=2", 6, 2, 2
        a.device, a.workdir, a.out = "cpu", str(tmp / "runs"), None
        a.blend = str(make_data(tmp / "data", 6 * 4 * 257 * 2, vocab=1024))  # GPT-2's vocabulary: most of the CPU time
    elif not a.blend:
        p.error("the following arguments are required: --blend")
    if a.from_json:
        results = json.loads(Path(a.from_json).read_text())
        table, ok, failed = render(a, results)
        print(table)
        return 0 if ok and not failed else 1
    if a.device == "auto":
        try:
            import torch

            a.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
            gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
        except ImportError:
            a.device, gpu = "cpu", "CPU"
    else:
        gpu = a.device
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for preset in a.presets.split(","):
        for layout in a.layouts.split(","):
            nproc, tp, extra = LAYOUTS[layout]
            r = run_one(a, preset, layout, nproc, tp, extra, workdir)
            results.append(r)
            if a.out:  # after every run: a job killed at its time limit still leaves what it measured
                Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
            if not r.get("failed"):
                print(
                    f"{preset:10s} {layout:12s} {r['tokens_per_s']:>12,.0f} tokens/s ({r['tokens_per_s_per_gpu']:,.0f} per GPU) "
                    f"final loss {r['losses'][-1]:.4f}  [{r['wall_s']:.0f} s]",
                    file=sys.stderr,
                    flush=True,
                )

    table, ok, failed = render(a, results)
    header = f"{gpu}, {a.steps} steps per run, the same global batch and data order in every layout"
    print(f"\n{header}\n\n{table}")
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    if a.out:
        Path(a.out).write_text(f"{header}\n\n{table}\n")
        Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    if a.smoke:
        shutil.rmtree(Path(a.workdir).parent, ignore_errors=True)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
