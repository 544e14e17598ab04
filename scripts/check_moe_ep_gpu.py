#!/usr/bin/env python3
"""Expert parallelism at scale is the same training (issue 49's fourth point): EP N against EP 1, and an EP N
checkpoint resumed at EP N/2, through the real ``snakellm train`` (torchrun, N ranks, data parallel N).

Three launches on the same data (a learnable Markov chain of the model's vocabulary, ``bench_fp8_gpu``'s) and
seed, Qwen3-30B-A3B's shape at ``--num-layers`` of its 48 layers (EP 1 replicates all 128 experts of a layer
on every rank: 4 layers are ~3.1B parameters, ~56 GB of weights, gradients and Adam states a GPU):

1. ``--ep N``, ``--steps S --save-interval K``: the experts split over the N ranks;
2. ``--ep 1``: every rank holds every expert; its per-step losses and gradient norms must be run 1's within
   ``--rtol`` (bf16: the experts' sums and the all-to-all's order differ; the first step's loss, computed on
   the same weights and batch before any update, within ``--rtol-first``);
3. run 1's checkpoint of step K resumed at ``--ep N/2``: steps K+1..S must be run 1's within ``--rtol``.

    python scripts/check_moe_ep_gpu.py                 # 8 GPUs: EP 8 vs EP 1, EP 8 -> EP 4 (~6 minutes)
    python scripts/check_moe_ep_gpu.py --nproc 4       # 4 GPUs: EP 4 vs EP 1, EP 4 -> EP 2
    python scripts/check_moe_ep_gpu.py --smoke         # CPU, 2 gloo ranks, tiny-qwen3-moe, fp32: EP 2 / 1, 2 -> 1

Printed: each step's loss and gradient norm side by side, the largest relative differences, PASS or FAIL;
``$OUT/moe_ep_check.json`` holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from bench_fp8_gpu import make_chain_data  # noqa: E402
from bench_train_8b_gpu import vocab_of  # noqa: E402


def train(args, blend: Path, run_dir: Path, ep: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += ["-m", "snakellm.cli", "train", "--blend", str(blend), "--run-dir", str(run_dir), "--preset", args.preset]
    cmd += ["--num-layers", str(args.num_layers), "--seq-length", str(args.seq), "--micro-batch-size", "1"]
    cmd += ["--global-batch-size", str(args.nproc * args.micro_batches), "--steps", str(args.steps)]
    cmd += ["--save-interval", str(args.save_at), "--keep-last", "5", "--lr", "3e-4", "--warmup-steps", "2"]
    cmd += ["--log-interval", "1", "--eval-iters", "0", "--split", "100,0,0", "--seed", "1234", "--no-progress"]
    cmd += ["--no-tensorboard", "--ep", str(ep), "--precision", "fp32" if args.smoke else "bf16"]
    cmd += ["--device", "cpu", "--threads", "1"] if args.smoke else ["--loss", "compiled"]
    cmd += list(extra)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name}: exit {proc.returncode}; its log {log}:\n{log.read_text()[-3000:]}")
    return proc


def records(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r for r in recs if "loss" in r}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(name: str, run: dict[int, dict], ref: dict[int, dict], steps: range, rtol: float) -> dict:
    rows = [(s, run[s]["loss"], ref[s]["loss"], run[s]["grad_norm"], ref[s]["grad_norm"]) for s in steps]
    loss = max(rel(a, b) for _, a, b, _, _ in rows)
    norm = max(rel(a, b) for _, _, _, a, b in rows)
    ok = loss <= rtol and norm <= 10 * rtol
    print(f"\n{name}: step | loss (run, reference) | gradient norm (run, reference)")
    for s, a, b, ga, gb in rows:
        print(f"  {s:3d} | {a:.6f} {b:.6f} | {ga:.6f} {gb:.6f}")
    print(f"  largest relative difference: loss {loss:.2e} (bar {rtol:g}), gradient norm {norm:.2e} "
          f"(bar {10 * rtol:g}): {'PASS' if ok else 'FAIL'}")  # fmt: skip
    return {"name": name, "max_rel_loss": loss, "max_rel_grad_norm": norm, "pass": ok, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=8, help="GPUs (torchrun processes); EP N is this")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--num-layers", type=int, default=4, help="of the preset's layers (EP 1 holds every expert)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches of one sequence a rank and step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=6, help="the checkpoint resumed at EP N/2")
    p.add_argument("--rtol", type=float, default=2e-2, help="per-step loss (gradient norm: 10x)")
    p.add_argument("--rtol-first", type=float, default=5e-3, help="the first step's loss (the same weights)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a launch")
    p.add_argument("--workdir", default="/tmp/snakellm-moe-ep")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo ranks, tiny-qwen3-moe, fp32 (bars 1e-5)")
    a = p.parse_args(argv)
    if a.smoke:
        a.nproc, a.preset, a.num_layers, a.seq, a.steps, a.save_at = 2, "tiny-qwen3-moe", 2, 64, 4, 2
        a.rtol, a.rtol_first, a.workdir = 1e-5, 1e-5, a.workdir + "-smoke"
    if a.nproc < 2 or a.nproc % 2:
        p.error(f"--nproc {a.nproc}: EP N and N/2 need an even number of ranks")
    root, out = Path(a.workdir), Path(a.out)
    shutil.rmtree(root / "runs", ignore_errors=True)
    (root / "runs").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab_of(a.preset, a.smoke)
    blend = make_chain_data(
        root / f"data-{vocab}-{a.seq}", int(a.steps * a.nproc * a.micro_batches * (a.seq + 1) * 1.1), vocab=vocab
    )
    t0 = time.time()
    n, half = a.nproc, a.nproc // 2
    train(a, blend, root / "runs" / f"ep{n}", n)
    train(a, blend, root / "runs" / "ep1", 1, "--no-checkpoints")
    src, dst = root / "runs" / f"ep{n}", root / "runs" / f"ep{n}-to-ep{half}"
    shutil.copytree(src, dst)
    (dst / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(f"{a.save_at}\n")
    train(a, blend, dst, half, "--no-checkpoints")
    big, one, resumed = records(src), records(root / "runs" / "ep1"), records(dst)
    print(f"{a.preset} ({a.num_layers} layers, seq {a.seq}), {n} ranks, {a.steps} steps, "
          f"{'fp32 on the CPU' if a.smoke else 'bf16'}: {time.time() - t0:.0f} s")  # fmt: skip
    first = rel(big[1]["loss"], one[1]["loss"])
    first_ok = first <= a.rtol_first
    print(f"first step's loss, EP {n} vs EP 1 (the same weights and batch): {big[1]['loss']:.6f} vs "
          f"{one[1]['loss']:.6f}, {first:.2e} (bar {a.rtol_first:g}): {'PASS' if first_ok else 'FAIL'}")  # fmt: skip
    checks = [
        compare(f"EP {n} vs EP 1", big, one, range(1, a.steps + 1), a.rtol),
        compare(
            f"EP {n}'s checkpoint of step {a.save_at} resumed at EP {half} vs EP {n}",
            resumed,
            big,
            range(a.save_at + 1, a.steps + 1),
            a.rtol,
        ),  # fmt: skip
    ]
    ok = first_ok and all(c["pass"] for c in checks)
    (out / "moe_ep_check.json").write_text(json.dumps({"first_step": first, "checks": checks, "pass": ok}, indent=1))
    print(f"\nEP {n} = EP 1 and EP {n} -> EP {half}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
