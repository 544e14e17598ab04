#!/usr/bin/env python3
"""MoE training throughput on one GPU: Qwen3-30B-A3B's shape (as many of its 48 layers as fit), sequence 4096.

Two sides, the same shape, sequence, micro batch and steps, in one run:

* ``snakellm train`` (the real command: megatron-core's MoE layer with its router, the alltoall
  dispatcher and the experts, bf16 weights with fp32 main gradients and AdamW, each layer compiled)
  on random ids of Qwen3's vocabulary (151,936), no checkpoints, no evaluation;
* the same command with ``--moe-experts sequential`` (megatron-core's SequentialMLP: one matmul per
  expert), to choose the experts' implementation on the GPU;
* a hand-written compiled PyTorch MoE of it (issue 45's reference: torchtitan cannot build a Qwen3-MoE
  of a chosen layer count from its wheel): RMSNorm, GQA attention with QK-norm and RoPE through SDPA,
  a softmax top-8 router renormalised, the experts as ``torch._grouped_mm`` over the tokens sorted by
  expert, the same AdamW (fp32 master weights, bf16 autocast), each layer ``torch.compile``'d.

Printed: each side's tokens/s (median of the steps after the warm-up ones) and MFU by active parameters
(6 N_active + 12 L h s FLOPs a token over 989.4 TFLOP/s dense bf16, H100/H200 SXM), and the ratio
(issue 45's bar: >= 1.0x). ``$OUT/bench_moe.json`` holds the figures.

    python scripts/bench_moe_gpu.py                    # 8 layers, seq 4096, micro batch 1, one GPU (~6 min on an H200)
    python scripts/bench_moe_gpu.py --layers 10
    python scripts/bench_moe_gpu.py --smoke            # CPU, the tiny Qwen3-MoE shape, seconds: the same code path
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
PEAK_TFLOPS = 989.4
VOCAB = 151936


def arch_of(args) -> dict:
    from snakellm.models import resolve

    preset = "tiny-qwen3-moe" if args.smoke else "qwen3-30b-a3b"
    return resolve(preset, {"num_layers": args.layers, "seq_length": args.seq})


def run_snakellm(args, arch: dict, blend: Path, out: Path, experts: str) -> dict:
    run_dir = Path(args.workdir) / "runs" / f"moe-{args.layers}-{experts}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [
        sys.executable, "-m", "snakellm.cli", "train", "--blend", str(blend), "--run-dir", str(run_dir),
        "--preset", "tiny-qwen3-moe" if args.smoke else "qwen3-30b-a3b", "--num-layers", str(args.layers),
        "--seq-length", str(args.seq), "--steps", str(args.steps), "--micro-batch-size", str(args.mbs),
        "--global-batch-size", str(args.mbs), "--log-interval", "1", "--eval-iters", "0", "--no-checkpoints",
        "--no-tensorboard", "--no-progress", "--lr", "3e-4", "--warmup-steps", "2", "--split", "100,0,0",
        "--moe-aux-loss-coeff", "0.001", "--moe-experts", experts,
    ]  # fmt: skip
    cmd += ["--device", "cpu", "--precision", "fp32"] if args.smoke else ["--precision", "bf16"]
    cmd += ["--compile"] if args.compile and not args.smoke else []
    cmd += ["--profile-steps", args.profile_steps] if args.profile_steps else []
    log = out / f"snakellm-train-{experts}.log"
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    side = "snakellm train" if experts == "grouped" else f"snakellm train ({experts})"
    res: dict = {"side": side, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode or not metrics.exists():
        res["error"] = log.read_text()[-3000:]
        return res
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines() if '"tokens_per_s"' in ln]
    steady = [r["tokens_per_s"] for r in recs if r["step"] > args.warmup]
    res["tokens_per_s"] = statistics.median(steady) if steady else None
    res["loss"] = [recs[0]["loss"], recs[-1]["loss"]]
    res["max_load"] = recs[-1].get("moe_max_load")
    return res


# ----------------------------------------------------------------------------- the hand-written MoE


def hand_written(args, arch: dict, device: str) -> dict:
    """Train the same shape in plain PyTorch; tokens/s of the steps after the warm-up ones."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    h, n, g = arch["hidden_size"], arch["num_attention_heads"], arch["num_query_groups"]
    d, E, k, f = arch["kv_channels"], arch["num_experts"], arch["moe_router_topk"], arch["moe_ffn_hidden_size"]
    eps, cuda = arch["layernorm_epsilon"], device.startswith("cuda")
    grouped = cuda  # torch._grouped_mm's backward runs on CUDA (sm90+); the CPU smoke loops over the experts

    def experts(x, w1, w2, idx, probs):
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        xs = x[order // k]
        counts = torch.bincount(flat, minlength=E)
        if grouped:
            offs = counts.cumsum(0).to(torch.int32)
            bf = torch.bfloat16  # autocast does not cast _grouped_mm's operands: it takes bf16 only
            a = torch._grouped_mm(xs.to(bf), w1.to(bf).transpose(1, 2), offs=offs)
            a1, a2 = a.chunk(2, dim=-1)
            y = torch._grouped_mm((F.silu(a1) * a2).to(bf), w2.to(bf).transpose(1, 2), offs=offs)
        else:
            parts, start = [], 0
            for e, c in enumerate(counts.tolist()):
                a1, a2 = (xs[start : start + c] @ w1[e].t()).chunk(2, dim=-1)
                parts.append((F.silu(a1) * a2) @ w2[e].t())
                start += c
            y = torch.cat(parts)
        y = y * probs.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, order // k, y.to(x.dtype))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
            self.qn, self.kn = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
            self.qkv = nn.Linear(h, (n + 2 * g) * d, bias=False)
            self.o = nn.Linear(n * d, h, bias=False)
            self.router = nn.Linear(h, E, bias=False)
            self.w1 = nn.Parameter(torch.randn(E, 2 * f, h) * 0.02)
            self.w2 = nn.Parameter(torch.randn(E, h, f) * 0.02 / math.sqrt(2 * arch["num_layers"]))

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            q, kk, v = self.qkv(self.n1(x)).split([n * d, g * d, g * d], dim=-1)
            q, kk = self.qn(q.view(b, s, n, d)), self.kn(kk.view(b, s, g, d))

            def rot(t):
                t1, t2 = t.chunk(2, dim=-1)
                return t * cos + torch.cat((-t2, t1), dim=-1) * sin

            q, kk, v = rot(q).transpose(1, 2), rot(kk).transpose(1, 2), v.view(b, s, g, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
            x = x + self.o(o.transpose(1, 2).reshape(b, s, n * d))
            t = self.n2(x).reshape(b * s, h)
            top, idx = self.router(t).float().topk(k, dim=-1)
            return x + experts(t, self.w1, self.w2, idx, top.softmax(dim=-1)).view(b, s, h)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, h)
            self.layers = nn.ModuleList(Layer() for _ in range(arch["num_layers"]))
            self.norm = nn.RMSNorm(h, eps=eps)
            self.head = nn.Linear(h, VOCAB, bias=False)

        def forward(self, ids, cos, sin):
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.head(self.norm(x))

    model = Model().to(device)
    if cuda and args.compile:
        for layer in model.layers:
            layer.compile(dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda)
    s = args.seq
    inv = 1.0 / (arch["rotary_base"] ** (torch.arange(0, d, 2, device=device).float() / d))
    fr = torch.arange(s, device=device).float()[:, None] * inv
    emb = torch.cat((fr, fr), dim=-1)[None, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    gen = torch.Generator(device=device).manual_seed(1)
    times, losses = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB - 1, (args.mbs, s + 1), device=device, generator=gen)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            logits = model(ids[:, :-1], cos, sin)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steady = times[args.warmup :] or times
    res = {"side": "hand-written compiled MoE", "tokens_per_s": args.mbs * s / statistics.median(steady)}
    res["loss"] = [losses[0], losses[-1]]
    res["grouped_mm"] = grouped
    if cuda:
        res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    del model, opt
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="layers of Qwen3-30B-A3B's 48 (8 fit an H200 with Adam)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1, help="sequences per step (both sides)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median (compilation)")
    p.add_argument(
        "--no-sequential",
        dest="sequential",
        action="store_false",
        help="skip the run with megatron-core's SequentialMLP experts (--moe-experts sequential)",
    )
    p.add_argument(
        "--no-compile", dest="compile", action="store_false", help="both sides eager (no torch.compile of the layers)"
    )
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument(
        "--profile-steps", default=None, metavar="A:B", help="ours: torch.profiler's kernel table of steps A..B"
    )
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the hand-written MoE")
    p.add_argument("--workdir", default="/tmp/snakellm-bench-moe")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny Qwen3-MoE shape, 2 layers, seq 64, 4 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.seq, args.steps, args.warmup = 2, 64, 4, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench_train_gpu import make_data

    from snakellm.models import flops_per_token, padded_vocab_size, param_count

    arch = arch_of(args)
    vocab = padded_vocab_size(VOCAB, arch)
    fpt = flops_per_token(arch, vocab)
    print(
        f"Qwen3-30B-A3B's shape, {args.layers} of 48 layers, seq {args.seq}, micro batch {args.mbs}: "
        f"{param_count(arch, vocab) / 1e9:.2f}B parameters, {param_count(arch, vocab, active=True) / 1e9:.2f}B active",
        flush=True,
    )
    blend = make_data(Path(args.workdir) / "data", args.seq * args.mbs * (args.steps + 2) * 2, vocab=VOCAB)
    ours = run_snakellm(args, arch, blend, out, "grouped")
    others = [run_snakellm(args, arch, blend, out, "sequential")] if args.sequential else []
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    ref = hand_written(args, arch, device) if args.reference else {}
    if args.profile_steps:
        prof = Path(args.workdir) / "runs" / f"moe-{args.layers}-grouped" / "profile.txt"
        if prof.exists():
            (out / "profile-grouped.txt").write_text(prof.read_text())
        trace = prof.with_name("profile-trace.json.gz")
        if trace.exists():
            shutil.copyfile(trace, out / "profile-grouped-trace.json.gz")
    results = [ours, *others, *([ref] if ref else [])]
    for r in results:
        if r.get("tokens_per_s"):
            r["mfu_active"] = r["tokens_per_s"] * fpt / (args.peak_tflops * 1e12)
            print(
                f"{r['side']:28s} {r['tokens_per_s']:12,.0f} tokens/s  MFU (active) {100 * r['mfu_active']:.1f}%  "
                f"loss {r['loss'][0]:.3f} -> {r['loss'][1]:.3f}",
                flush=True,
            )
        else:
            print(f"{r['side']:28s} failed: {r.get('error', '')[-800:]}", flush=True)
    if ours.get("tokens_per_s") and ref.get("tokens_per_s"):
        ratio = ours["tokens_per_s"] / ref["tokens_per_s"]
        print(f"snakellm / hand-written: {ratio:.3f}x (issue 45's bar: >= 1.0x)")
    for o in others:
        if o.get("tokens_per_s") and ours.get("tokens_per_s"):
            print(f"grouped experts / megatron-core's SequentialMLP: {ours['tokens_per_s'] / o['tokens_per_s']:.2f}x")
    (out / "bench_moe.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if ours.get("tokens_per_s") and (ref.get("tokens_per_s") or not args.reference) else 1


if __name__ == "__main__":
    sys.exit(main())
