#!/usr/bin/env python3
"""Pipeline parallelism and activation recomputation on GPUs: loss parity, and the memory estimate at 8B.

Runs the real ``snakellm train`` (torchrun, NCCL, bf16, megatron-core's schedules) on a blend of uniformly
random token ids of Llama 3's vocabulary (128,256), no checkpoints, no evaluation.

``--part parity`` (llama3-1b's shape, sequence 2048, micro batch 1, global batch 8, 10 steps): one GPU,
then pp 2 with the 1F1B schedule, pp 2 interleaved (2 virtual stages), pp 4 interleaved with full
recomputation, pp 2 x tp 2 with sequence parallelism. Every run starts from the same weights
(snakellm.models.build.init_weights) and reads the same batches: each step's loss beside the one-GPU
run's, the largest relative difference against the bf16 bar (1e-2), tokens/s and MFU
(6 N + 12 L h s, 989.4 TFLOP/s).

``--part memory`` (llama3-8b's shape = Llama 3.1 8B, sequence 8192, micro batch 1, global batch 8,
4 steps, the compiled fused loss a real run uses): layouts that fit 4 x 80 GB with recomputation; the peak of torch's allocator on every rank
beside ``snakellm.models.memory``'s estimate for the fullest stage (what `snakellm plan` and
`snakellm train --dry-run` print; bar: within 10%).

    python scripts/bench_pipeline_gpu.py --part parity      # ~4 min on 4 GPUs
    python scripts/bench_pipeline_gpu.py --part memory      # ~4 min on 4 GPUs
    python scripts/bench_pipeline_gpu.py --smoke            # CPU, gloo, a tiny model: the same code path

Writes a log per run and results.json to --out ($OUT if set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_train_gpu import make_data  # noqa: E402

VOCAB = 128256
PEAK_TFLOPS = 989.4
PARITY_BAR = 1e-2  # relative loss difference against one GPU, bf16
MEMORY_BAR = 0.10  # estimate against the measured peak

# name -> (GPUs, extra arguments); runs of one wave share the machine (disjoint GPUs)
PARITY = {
    "pp1": (1, []),
    "pp2-1f1b": (2, ["--pp", "2"]),
    "pp2-interleaved": (2, ["--pp", "2", "--virtual-pp", "2"]),
    "pp4-interleaved-recompute-full": (4, ["--pp", "4", "--virtual-pp", "2", "--recompute", "full"]),
    "pp2-tp2-sp": (4, ["--pp", "2", "--tp", "2", "--sequence-parallel"]),
}
PARITY_WAVES = [["pp1", "pp2-1f1b"], ["pp2-interleaved"], ["pp4-interleaved-recompute-full"], ["pp2-tp2-sp"]]
MEMORY = {
    "8b-pp4-recompute-full": (4, ["--pp", "4", "--recompute", "full", "--recompute-num-layers", "1"]),
    "8b-tp2-pp2-sp-recompute-full-block4": (
        4,
        ["--tp", "2", "--pp", "2", "--sequence-parallel", "--recompute", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", "4"],
    ),
}
MEMORY_WAVES = [["8b-pp4-recompute-full"], ["8b-tp2-pp2-sp-recompute-full-block4"]]


def flag(extra: list[str], name: str, default):
    return type(default)(extra[extra.index(name) + 1]) if name in extra else default


def launch(name: str, nproc: int, extra: list[str], common: list[str], args, blend: Path, gpus: list[int]):
    """Start one `snakellm train` run on ``gpus`` (CPU: gloo, whatever the list)."""
    run_dir = Path(args.workdir) / "runs" / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = ["train", "--blend", str(blend), "--run-dir", str(run_dir), *common, *extra]
    py = [sys.executable, "-m"]
    if nproc > 1:
        cmd = [*py, "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "snakellm.cli", *cmd]
    else:
        cmd = [*py, "snakellm.cli", *cmd]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    if not args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    log = Path(args.out) / f"{name}.log"
    fh = open(log, "w")
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env), fh, run_dir, log, time.time()


def run_waves(table: dict, waves: list[list[str]], common: list[str], args, blend: Path) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for wave in waves:
        started, next_gpu = [], 0
        for name in wave:
            nproc, extra = table[name]
            gpus = list(range(next_gpu, next_gpu + nproc))
            next_gpu += nproc
            started.append((name, nproc, extra, launch(name, nproc, extra, common, args, blend, gpus)))
        for name, nproc, extra, (proc, fh, run_dir, log, t0) in started:
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = -9
            fh.close()
            res: dict = {"run": name, "gpus": nproc, "args": extra, "rc": rc, "wall_s": round(time.time() - t0, 1)}
            summary = run_dir / "train_summary.json"
            if rc != 0 or not summary.exists():
                res["error"] = log.read_text()[-2500:]
            else:
                recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
                s = json.loads(summary.read_text())
                tps = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s")]
                tps_med = sorted(tps[1:] or tps)[len(tps[1:] or tps) // 2] if tps else None
                res.update(
                    losses={r["step"]: r["loss"] for r in recs if "loss" in r},
                    peaks_gib=s.get("peak_gpu_memory_gib_ranks"),
                    tokens_per_s_per_gpu=tps_med / nproc if tps_med else None,
                    mfu=tps_med * s["flops_per_token"] / (PEAK_TFLOPS * 1e12 * nproc) if tps_med else None,
                )
            results[name] = res
            print(f"  {name}: rc {rc}, {res['wall_s']} s", flush=True)
    return results


def common_args(preset: str, seq: int, steps: int, smoke: bool, loss: str = "megatron") -> list[str]:
    return [
        "--preset",
        preset,
        "--seq-length",
        str(seq),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--steps",
        str(steps),
        "--lr",
        "3e-4",
        "--min-lr",
        "3e-5",
        "--warmup-steps",
        "2",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--split",
        "100,0,0",
        "--loss",
        loss,
        "--no-checkpoints",
        "--no-tensorboard",
        "--no-progress",
        "--precision",
        "fp32" if smoke else "bf16",
        "--threads",
        "1",
    ] + (["--num-layers", "4", "--device", "cpu"] if smoke else [])


def report_parity(results: dict[str, dict], bar: float) -> bool:
    ref = results["pp1"].get("losses")
    ok = ref is not None
    print(f"\nloss parity against one GPU (bar: relative difference <= {bar:g}):")
    print(
        f"  {'run':34s} {'GPUs':>4s} {'max rel diff':>13s} {'loss step 1':>12s} {'last loss':>10s} {'tok/s/GPU':>10s} {'MFU':>6s}"
    )
    for name, r in results.items():
        if "error" in r or ref is None:
            print(f"  {name:34s} FAILED (rc {r['rc']}): see {name}.log")
            ok = False
            continue
        diff = max(abs(r["losses"][k] - ref[k]) / abs(ref[k]) for k in ref)
        ok &= diff <= bar and r["losses"].keys() == ref.keys()
        last = max(ref)
        tps = f"{r['tokens_per_s_per_gpu']:,.0f}" if r.get("tokens_per_s_per_gpu") else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(
            f"  {name:34s} {r['gpus']:>4d} {diff:>13.2e} {r['losses'][1]:>12.5f} {r['losses'][last]:>10.5f} {tps:>10s} {mfu:>6s}"
        )
    print(f"parity: {'PASS' if ok else 'FAIL'}")
    return ok


def report_memory(results: dict[str, dict], table: dict, preset: str, seq: int, layers: int | None = None) -> bool:
    from snakellm import models
    from snakellm.models import memory

    arch = models.resolve(preset, {"seq_length": seq, **({"num_layers": layers} if layers else {})})
    ok = True
    print(
        f"\nmemory per GPU, {preset} at sequence {seq} (estimate: snakellm.models.memory, the fullest stage; bar +-{MEMORY_BAR:.0%}):"
    )
    for name, r in results.items():
        nproc, extra = table[name]
        tp, pp = flag(extra, "--tp", 1), flag(extra, "--pp", 1)
        dp = nproc // (tp * pp)
        est = memory.estimate(
            arch,
            models.padded_vocab_size(VOCAB, arch, tp),
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batch_size=1,
            num_micro_batches=8 // dp,
            seq_length=seq,
            sequence_parallel="--sequence-parallel" in extra,
            recompute=flag(extra, "--recompute", "none"),
            recompute_method=flag(extra, "--recompute-method", "uniform"),
            recompute_num_layers=flag(extra, "--recompute-num-layers", 1),
            virtual_pp=flag(extra, "--virtual-pp", 1),
        )
        line = (
            f"  {name}: estimate {est.total / memory.GiB:.2f} GiB (weights {est.weights / memory.GiB:.2f}, grads "
            f"{est.grads / memory.GiB:.2f}, optimizer {est.optimizer / memory.GiB:.2f}, activations "
            f"{est.activations / memory.GiB:.2f})"
        )
        if "error" in r or not r.get("peaks_gib"):
            print(
                line + f"; run FAILED (rc {r['rc']}): see {name}.log" if "error" in r else line + "; no GPU peak (CPU)"
            )
            ok &= "error" not in r
            continue
        peak = max(r["peaks_gib"])
        ratio = est.total / memory.GiB / peak
        ok &= abs(ratio - 1) <= MEMORY_BAR
        tps = f"{r['tokens_per_s_per_gpu']:,.0f}" if r.get("tokens_per_s_per_gpu") else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(
            line + f"; measured peak {peak:.2f} GiB (ranks: {', '.join(f'{p:.1f}' for p in r['peaks_gib'])}); "
            f"estimate / peak {ratio:.3f}; {tps} tokens/s/GPU, MFU {mfu}"
        )
    print(f"memory: {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--part", choices=("parity", "memory", "all"), default="all")
    p.add_argument("--smoke", action="store_true", help="CPU (gloo), a 4-layer tiny-llama, 2 steps: the same code path")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: parity 10, memory 4, smoke 2)")
    p.add_argument(
        "--workdir", default=None, help="runs and data (default: /tmp/snakellm-bench-pp; smoke: a new temp dir)"
    )
    p.add_argument("--out", default=None, help="logs and results.json (default: $OUT, else WORKDIR/out)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = p.parse_args(argv)
    if args.workdir is None:
        import tempfile

        args.workdir = tempfile.mkdtemp(prefix="snakellm-bench-pp-") if args.smoke else "/tmp/snakellm-bench-pp"
    args.out = args.out or os.environ.get("OUT") or str(Path(args.workdir) / "out")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    print(
        f"git {subprocess.run(['git', 'log', '--oneline', '-1'], cwd=REPO, capture_output=True, text=True).stdout.strip()}"
    )
    ok, out = True, {}
    if args.smoke:
        blend = make_data(Path(args.workdir) / "data-smoke", 8 * 64 * 4, vocab=256)
        table = {
            "pp1": (1, []),
            "pp2-interleaved-recompute-full": (2, ["--pp", "2", "--virtual-pp", "2", "--recompute", "full"]),
        }
        res = run_waves(table, [list(table)], common_args("tiny-llama", 64, args.steps or 2, True), args, blend)
        ok = report_parity(res, 1e-5) and report_memory(res, table, "tiny-llama", 64, layers=4)
        out["smoke"] = res
    if not args.smoke and args.part in ("parity", "all"):
        steps = args.steps or 10
        blend = make_data(Path(args.workdir) / "data", 8 * 2048 * (steps + 2), vocab=VOCAB)
        res = run_waves(PARITY, PARITY_WAVES, common_args("llama3-1b", 2048, steps, False), args, blend)
        ok &= report_parity(res, PARITY_BAR)
        out["parity"] = res
    if not args.smoke and args.part in ("memory", "all"):
        steps = args.steps or 4
        blend = make_data(Path(args.workdir) / "data", 8 * 8192 * (steps + 2), vocab=VOCAB)
        res = run_waves(
            MEMORY, MEMORY_WAVES, common_args("llama3-8b", 8192, steps, False, loss="compiled"), args, blend
        )
        ok &= report_memory(res, MEMORY, "llama3-8b", 8192)
        out["memory"] = res
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
