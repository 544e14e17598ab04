#!/usr/bin/env python3
"""8B checkpoints on 4 GPUs: every rank writes its own shards, asynchronously; a kill mid-save is harmless.

Two launches of the real ``snakellm train`` (torchrun, 4 ranks, FSDP: each rank holds and writes a
quarter of the model, its fp32 masters and Adam states, ~112 GB in all for Llama 3.1 8B's shape):

1. ``--steps 3 --save-interval 2 --async-save``: the checkpoint at step 2 is copied to host memory
   (what training waits for) and written by a forked process per rank while step 3 trains; its
   ``saved ... in`` line is the whole save. The final save (step 3) is under way when this script
   SIGKILLs every process of the job (the moment ``.iter_0000003.partial`` appears);
2. the next start (``--steps 3 --no-checkpoints``) must resume from iteration 2, intact, and finish.

Printed: checkpoint size, save time (blocking and total, GB/s), load time, and the checks.

    python scripts/check_checkpoint_8b_gpu.py                      # 4 GPUs, ~5 minutes
    python scripts/check_checkpoint_8b_gpu.py --num-layers 8       # a smaller model, faster
    python scripts/check_checkpoint_8b_gpu.py --sync               # synchronous saves (the default)
    python scripts/check_checkpoint_8b_gpu.py --smoke              # CPU, 2 ranks, tiny model
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def train_cmd(args, blend: Path, run_dir: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    cmd += ["-m", "snakellm.cli", "train", "--blend", str(blend), "--run-dir", str(run_dir)]
    cmd += ["--preset", "tiny-llama" if args.smoke else args.preset, "--fsdp", "--micro-batch-size", "1"]
    if args.num_layers:
        cmd += ["--num-layers", str(args.num_layers)]
    cmd += ["--seq-length", str(args.seq), "--global-batch-size", str(args.nproc), "--decay-steps", "100"]
    cmd += ["--lr", "1e-4", "--warmup-steps", "1", "--eval-iters", "0", "--split", "100,0,0", "--log-interval", "1"]
    cmd += ["--keep-last", "1", "--no-progress", "--no-tensorboard"]
    cmd += ["--device", "cpu", "--threads", "1", "--precision", "fp32"] if args.smoke else ["--precision", "bf16"]
    return cmd + list(extra)


def kill_all(pid: int) -> None:
    """SIGKILL the launcher and every process under it (torchrun starts its ranks in sessions of their own)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for pr in procs:
        try:
            pr.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers than the preset's (a smaller checkpoint)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--workdir", default="/tmp/snakellm-ckpt-8b", help="where the checkpoints go (~112 GB at 8B)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--smoke", action="store_true", help="CPU, 2 ranks, tiny model: the same path")
    p.add_argument("--sync", action="store_true", help="synchronous saves (snakellm train's default), not --async-save")
    args = p.parse_args(argv)
    if args.smoke:
        args.nproc, args.seq, args.workdir = 2, 64, args.workdir + "-smoke"
    from bench_train_gpu import make_data

    vocab = 256 if args.smoke else 128256
    work, out = Path(args.workdir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    blend = make_data(work / f"data-{vocab}", 8 * args.nproc * (args.seq + 1) * 2, vocab=vocab)
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    ckpts = run_dir / "checkpoints"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    # 1. save at 2 in the background, killed in the middle of the final save (3)
    log1 = out / "ckpt-1.log"
    t0 = time.time()
    with open(log1, "w") as fh:
        proc = subprocess.Popen(
            train_cmd(args, blend, run_dir, "--steps", "3", "--save-interval", "2", *([] if args.sync else ["--async-save"])),
            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )  # fmt: skip
    killed = False
    try:
        while proc.poll() is None and time.time() - t0 < args.timeout:
            if (ckpts / ".iter_0000003.partial").exists():
                kill_all(proc.pid)
                killed = True
                break
            time.sleep(0.005)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_all(proc.pid)
    text1 = log1.read_text(errors="replace")
    waited = re.search(r"saving \S+iter_0000002 in the background \(training waited ([0-9.]+)s\)", text1)
    saved = re.search(r"saved \S+iter_0000002 in ([0-9.]+)s", text1)
    tracker = ckpts / "latest_checkpointed_iteration.txt"
    latest = int(tracker.read_text()) if tracker.exists() else None
    size = du(ckpts / "iter_0000002") if (ckpts / "iter_0000002").exists() else 0
    print(f"launch 1: {time.time() - t0:.0f}s, killed mid-save of iteration 3: {killed}; latest = {latest}")
    if not ((waited or args.sync) and saved and killed):
        print(text1[-4000:])
    # 2. the next start resumes from 2 and finishes
    log2 = out / "ckpt-2.log"
    t1 = time.time()
    with open(log2, "w") as fh:
        rc = subprocess.run(
            train_cmd(args, blend, run_dir, "--steps", "3", "--no-checkpoints"),
            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=args.timeout,
        ).returncode  # fmt: skip
    text2 = log2.read_text(errors="replace")
    loaded = re.search(r"resumed from \S+iter_0000002 .*loaded in ([0-9.]+)s", text2)
    print(f"launch 2: {time.time() - t1:.0f}s, rc {rc}, resumed from iteration 2: {bool(loaded)}")
    if rc != 0 or not loaded:
        print(text2[-4000:])
    gb = size / 1e9
    print(f"\n{args.preset}{f' ({args.num_layers} layers)' if args.num_layers else ''}, FSDP over {args.nproc} ranks:")
    print(
        f"  checkpoint size      {gb:8.1f} GB ({len(list((ckpts / 'iter_0000002').glob('*.distcp'))) if size else 0} files)"
    )
    if (waited or args.sync) and saved:
        w, s = (float(waited.group(1)) if waited else float(saved.group(1))), float(saved.group(1))
        print(f"  save, training waits {w:8.1f} s ({'the whole save' if args.sync else 'copy to host memory'})")
        print(f"  save, total          {s:8.1f} s ({gb / max(s, 1e-9):.2f} GB/s over {args.nproc} writers)")
    if loaded:
        ld = float(loaded.group(1))
        print(f"  load                 {ld:8.1f} s ({gb / max(ld, 1e-9):.2f} GB/s)")
    ok = bool(killed and latest == 2 and loaded and rc == 0)
    print(f"  killed mid-save -> previous checkpoint intact and resumed: {'YES' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
