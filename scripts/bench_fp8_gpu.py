#!/usr/bin/env python3
"""FP8 training on one GPU: `snakellm train --precision fp8` beside bf16 and a hand-written torchao Llama.

Two parts, each a few minutes on one H100 (run them as two calls, or ``--part all``):

**speed** (``--part speed``): llama-1b (TinyLlama 1.1B's shape), sequence 2048,
micro batch 16, on random ids of GPT-2's vocabulary, four runs in one session:

* ``snakellm train --precision bf16`` and ``--precision fp8`` (the real command:
  megatron-core's GPTModel, its DDP, AdamW with fp32 master weights, the fused
  compiled loss, ``--compile``; fp8 = torchao float8 matmuls inside the block
  linears, :mod:`snakellm.models.fp8`);
* the reference: a hand-written plain-PyTorch Llama of the same shape (fused
  q/k/v and gate/up linears, RoPE, SDPA with grouped-query attention, RMSNorm,
  SwiGLU; fp32 weights under bf16 autocast, fused AdamW, gradient clipping,
  each block ``torch.compile``'d, compiled cross-entropy), bf16 and with
  ``torchao.float8.convert_to_float8_training`` on its block linears (output
  layer bf16) -- what torchtitan does.

It prints tokens/s (median of the logging windows after the warm-up, which
holds compilation), MFU against the **bf16** dense peak (989.4 TFLOP/s, so
bf16 and FP8 figures compare; 6 N + 12 L h s FLOPs per token), and peak
memory, beside the anchors measured on one H200 (issue 30). Bars: ours FP8 >=
0.95x the hand-written FP8 Llama, >= 1.15x ours bf16.

**numerics** (``--part numerics``): llama-1b, 300 steps, bf16 vs FP8 with the
same data, seed and schedule: the loss curve side by side, the final loss
(mean of the last 10 steps) and the loss at step 300 within 1% of bf16's, no
divergence; then a resume: the FP8 run's checkpoint at step 200 moved into a
run directory of its own and trained on to step 300 must continue as the
uninterrupted FP8 run did (the first resumed step's loss bit for bit: weights,
optimizer state and data position restored exactly; the later steps differ only
by the GPU's non-deterministic backward kernels, whose size is printed).
``--bf16-again`` and ``--fp8-again`` run the same command a second time: each
precision's own run-to-run spread, the noise floor the 1% bar is read against.
Micro and global batch 8 by default (16K tokens a step) so that the part fits
~4-5 minutes. Its data (``--data``): **text** (default), the repository's
English text (``resources/``: the Wikipedia excerpt, WikiText-2's test split and
Botchan, 0.99M GPT-2 tokens, so 300 steps are ~5 epochs) tokenized by the
workflow itself (``snakemake ... data/tokens/gpt2/blend.json`` in
``--text-data``; where snakemake is not installed, build it elsewhere with
``--make-text-data DIR`` and bring DIR); or **chain**, a synthetic corpus with
a known entropy (each token followed by one of 4 successors with probabilities
0.55/0.25/0.12/0.08: the loss falls from ln 50257 = 10.8 toward 1.13, through a
plateau whose exit time varies from run to run by a few steps, which moves the
step-300 loss of two identical bf16 runs ~2% apart); or ``--blend`` (any
blend.json of GPT-2 ids).

    python scripts/bench_fp8_gpu.py --gpus 0,1,2,3          # both parts, four lanes side by side: ~3.5 min
    python scripts/bench_fp8_gpu.py --gpus 0,1,2            # three lanes: ~4 min
    python scripts/bench_fp8_gpu.py --part speed            # one GPU, one run after another: ~4 min
    python scripts/bench_fp8_gpu.py --part numerics         # one GPU: ~6 min
    python scripts/bench_fp8_gpu.py --part numerics --gpus 0,1,2,3 --bf16-again --fp8-again   # and each one's spread
    python scripts/bench_fp8_gpu.py --make-text-data .bench/text-gpt2   # the text data, where snakemake is installed
    python scripts/bench_fp8_gpu.py --pool seed*/bench-fp8.json   # several runs' numerics as one sample a side
    python scripts/bench_fp8_gpu.py --smoke                 # CPU, tiny-llama: the same code paths

**Another family's shape** (issue 45): ``--num-layers`` trains fewer of the preset's layers (8 of an 8B's on
one GPU) and ``--versus PRESET`` adds ours bf16 with another preset in the same run (same layers, sequence,
batch and data), printing ``--preset``'s tokens/s and MFU against it (bar >= 0.95x); the hand-written
reference computes Qwen3's QK-norm and head size too. ``--bf16-only`` leaves the FP8 runs out:

    python scripts/bench_fp8_gpu.py --part speed --bf16-only --preset qwen3-8b --versus llama3-8b \
        --num-layers 8 --seq-length 8192 --micro-batch-size 2 --global-batch-size 8   # one H200: ~5 min

With ``--gpus`` the runs go to lanes, one per GPU (see :func:`run_parts`): ours bf16 and FP8 share a
GPU, as do the FP8 numerics run and its resume; the hand-written runs and bf16's numerics run may be
on others (identical GPUs of one host: the table names each run's GPU).

``--smoke`` runs both parts on the CPU with tiny-llama (FP8 through torch's CPU
``_scaled_mm`` under snakellm.models.fp8's test-only override of the GPU
check). Output: the tables on stdout, ``bench-fp8.json`` and each run's log in
``--out`` ($OUT if set).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

VOCAB = 50257
PEAK = 989.4  # TFLOP/s, dense bf16, H100/H200 SXM
# issue 30, one H200, same session: (tokens/s, MFU)
ANCHORS = {
    "hand-written compiled Llama, bf16 (H200)": (73_483, 0.606),
    "hand-written compiled Llama, torchao float8 (H200)": (86_187, 0.711),
    "snakellm train bf16 (H200)": (73_170, None),
}
BARS = {"fp8_vs_reference_fp8": 0.95, "fp8_vs_bf16": 1.15, "final_loss_rel": 0.01, "versus": 0.95}
SUCCESSOR_P = (0.55, 0.25, 0.12, 0.08)
ANY_DEVICE_ENV = "SNAKELLM_FP8_ANY_DEVICE"  # snakellm.models.fp8's test-only override (the smoke run on CPU)


# ----------------------------------------------------------------------------- data


def make_chain_data(root: Path, tokens: int, vocab: int = VOCAB, seed: int = 0) -> Path:
    """A blend over documents of 2048 tokens from a first-order chain: id t is followed by one of 4 fixed
    successors (probabilities SUCCESSOR_P), so there is something to learn and a known entropy."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    blend = root / "blend.json"
    if blend.exists() and json.loads(blend.read_text()).get("tokens", 0) >= tokens:
        return blend
    root.mkdir(parents=True, exist_ok=True)
    prefix = root / "chain_text_document"
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab - 1, size=(vocab, len(SUCCESSOR_P)))
    cum = np.cumsum(SUCCESSOR_P)
    doc, ndocs = 2048, tokens // 2048 + 1
    ids = np.empty((ndocs, doc), dtype=np.int64)
    ids[:, 0] = rng.integers(0, vocab - 1, size=ndocs)
    for j in range(1, doc - 1):  # vectorised over the documents
        pick = np.searchsorted(cum, rng.random(ndocs))
        ids[:, j] = succ[ids[:, j - 1], pick]
    ids[:, -1] = vocab - 1  # end of document
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16 if vocab < 65500 else np.int32)
    for row in ids:
        builder.add_document(torch.from_numpy(row), [doc])
    builder.finalize(f"{prefix}.idx")
    tok = {"name": "gpt2", "kind": "gpt2-bpe", "vocab_size": vocab, "eod_id": vocab - 1}
    blend.write_text(json.dumps({"data_prefix": [1.0, str(prefix)], "tokenizer": tok, "tokens": tokens}))
    return blend


SMOKE_MERGES = 1024  # the smoke's text data: GPT-2's first 1,024 merges (its bf16 output layer on the CPU: see main)
TEXT_TOKENIZER = "vocab_file: resources/tokenizers/gpt2/vocab.json, merges_file: resources/tokenizers/gpt2/merges.txt, \
vocab_size: 50257"
TEXT_CONFIG = (
    """\
# bench_fp8_gpu.py's numerics data: the repository's English text, GPT-2 BPE
sources:
  wikipedia: {kind: local, path: resources/wikipedia/enwiki-pages-articles-excerpt.xml.bz2, format: mediawiki,
              shards_per_chunk: 1}
  wikitext: {kind: local, path: "resources/corpus/wikitext/chunk*/example_train_*.jsonl.zst", format: jsonl.zst,
             shards_per_chunk: 16}
  botchan: {kind: local, path: "resources/corpus/botchan/*.jsonl", format: jsonl, shards_per_chunk: 1}
tokenizers:
  gpt2: {kind: gpt2-bpe, """
    + TEXT_TOKENIZER
    + """}
tokenize: {tokenizers: [gpt2]}
runs: {}
"""
)


def make_text_data(root: Path, merges: int | None = None) -> Path:
    """The repository's English text (``resources/``) tokenized with GPT-2 BPE by the workflow itself, in ``root``
    (built once); returns a copy of its blend.json with the prefixes made absolute (train runs in the repo).
    ``merges``: GPT-2's BPE cut to its first ``merges`` merges instead (the smoke's: see
    ``bench_finetune_gpu.small_gpt2``)."""
    blend = root / "data" / "tokens" / "gpt2" / "blend.json"
    config = TEXT_CONFIG
    if merges is not None:
        from bench_finetune_gpu import small_gpt2

        tok = small_gpt2(root, merges)
        files = ", ".join(f"{k}: {v}" for k, v in tok["files"].items())  # absolute: train runs in the repo
        config = config.replace(TEXT_TOKENIZER, f"{files}, vocab_size: {tok['vocab_size']}")
    if not blend.exists():
        bindir = str(Path(sys.executable).parent)
        snakemake = shutil.which("snakemake", path=os.pathsep.join([bindir, os.environ.get("PATH", "")]))
        if snakemake is None:
            raise SystemExit(
                f"{blend} is missing and snakemake, which builds it, is not installed here: run "
                "`python scripts/bench_fp8_gpu.py --make-text-data DIR` where it is and pass --text-data DIR "
                "(or --data chain)"
            )
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.yaml").write_text(config)
        if not (root / "resources").exists():
            (root / "resources").symlink_to(REPO / "resources")
        env = {**os.environ, "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")])}
        cmd = [snakemake, "data/tokens/gpt2/blend.json", "-s", str(REPO / "Snakefile"), "-d", str(root)]
        cmd += ["--configfile", str(root / "config.yaml"), "--replace-workflow-config", "-c", "2", "--nocolor"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"building the text data in {root} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    obj = json.loads(blend.read_text())
    dp = obj["data_prefix"]
    obj["data_prefix"] = [x if i % 2 == 0 else str((root / x).resolve()) for i, x in enumerate(dp)]
    absolute = root / "blend.abs.json"
    absolute.write_text(json.dumps(obj, indent=1))
    return absolute


def text_merges(args) -> int | None:
    """The merges of GPT-2's BPE the text data is tokenized with: the smoke's few (its own data), else all."""
    return SMOKE_MERGES if args.smoke and not args.text_data else None


def data_label(args, blend: Path) -> str:
    if args.blend:
        return str(blend)
    if args.data == "text":
        cut = f" (its first {SMOKE_MERGES:,} merges)" if text_merges(args) else ""
        return (
            f"text data: the repository's English text, {json.loads(blend.read_text())['tokens']:,} GPT-2{cut} tokens"
        )
    return f"chain data: entropy {chain_entropy():.3f}"


def chain_entropy() -> float:
    return -sum(p * math.log(p) for p in SUCCESSOR_P)


# ----------------------------------------------------------------------------- snakellm train


def train(
    args, name: str, blend: Path, out: Path, precision: str, *, mbs: int, gbs: int, steps: int, warmup: int, extra=()
):
    """One `snakellm train` run; returns its metrics records, summary and wall time (or the error)."""
    run_dir = Path(args.workdir) / "runs" / name
    if run_dir.exists() and not any(a == "--keep-run-dir" for a in extra):
        shutil.rmtree(run_dir)
    extra = [a for a in extra if a != "--keep-run-dir"]
    cmd = [sys.executable, "-m", "snakellm.cli", "train", "--blend", str(blend), "--run-dir", str(run_dir)]
    cmd += ["--preset", args.preset, "--seq-length", str(args.seq_length), "--device", args.device]
    cmd += ["--num-layers", str(args.num_layers)] if args.num_layers else []
    cmd += ["--steps", str(steps), "--decay-steps", str(steps), "--micro-batch-size", str(mbs)]
    cmd += ["--global-batch-size", str(gbs), "--precision", precision, "--fp8-recipe", args.recipe]
    cmd += ["--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--warmup-steps", str(warmup)]
    cmd += ["--log-interval", str(args.log_interval), "--eval-iters", "0", "--split", "100,0,0"]
    cmd += ["--no-tensorboard", "--no-progress", "--seed", str(args.seed)]
    cmd += ["--loss", "compiled" if args.device != "cpu" else "eager"]
    cmd += ["--compile"] if args.compile else []
    cmd += list(extra)
    log = out / f"{name}.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    if args.smoke:
        env[ANY_DEVICE_ENV] = "1"
    if args.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=_timeout(args), cwd=REPO)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    res: dict = {"name": name, "precision": precision, "rc": rc, "wall_s": round(time.time() - t0, 1)}
    if rc == 124:
        res["error"] = f"timed out (--budget-s/--timeout); {log}:\n" + log.read_text()[-1500:]
        return res
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        res["error"] = log.read_text()[-3000:]
        return res
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    res.update(
        run_dir=str(run_dir),
        losses={r["step"]: r["loss"] for r in recs if "loss" in r},
        tokens_per_s=_steady(recs, args.warmup_steps),
        flops_per_token=summary["flops_per_token"],
        peak_gib=summary.get("peak_gpu_memory_gib"),
        final_loss=summary["final_loss"],
    )
    return res


def _steady(recs: list[dict], warmup: int) -> float | None:
    """Median tokens/s of the logging windows that start after ``warmup`` (every record of a window carries it)."""
    windows: dict[float, int] = {}
    for r in recs:
        if r.get("tokens_per_s"):
            windows.setdefault(r["tokens_per_s"], r["step"])
    steady = [tps for tps, first in windows.items() if first > warmup]
    return statistics.median(steady) if steady else None


# ----------------------------------------------------------------------------- the hand-written reference


def reference_worker(spec: dict) -> dict:
    """Train the hand-written Llama for ``spec['steps']`` steps; tokens/s after the warm-up, peak memory."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from snakellm import models
    from snakellm.models.families import head_dim

    dev = torch.device(spec["device"] if spec["device"] != "cuda" else "cuda:0")
    cuda = dev.type == "cuda"
    over = {"seq_length": spec["seq_length"], **({"num_layers": spec["num_layers"]} if spec["num_layers"] else {})}
    arch = models.resolve(spec["preset"], over)
    vocab = models.padded_vocab_size(spec["vocab"], arch, 1)
    h, heads, groups, ffn = (
        arch["hidden_size"],
        arch["num_attention_heads"],
        arch["num_query_groups"],
        arch["ffn_hidden_size"],
    )
    # Qwen3's heads of their own size (kv_channels) and its QK-norm: RMSNorm over each query and key head
    hd, eps, seq = head_dim(arch), arch["layernorm_epsilon"], arch["seq_length"]
    qk_norm = bool(arch.get("qk_norm"))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
            self.qkv = nn.Linear(h, (heads + 2 * groups) * hd, bias=False)
            self.proj = nn.Linear(heads * hd, h, bias=False)
            self.fc1 = nn.Linear(h, 2 * ffn, bias=False)  # [gate; up]
            self.fc2 = nn.Linear(ffn, h, bias=False)
            if qk_norm:
                self.q_norm, self.k_norm = nn.RMSNorm(hd, eps=eps), nn.RMSNorm(hd, eps=eps)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.attn_norm(x)).split([heads * hd, groups * hd, groups * hd], dim=-1)
            q, k, v = (y.view(b, t, -1, hd) for y in (q, k, v))
            if qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = (y.transpose(1, 2) for y in (q, k, v))
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups < heads)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, heads * hd))
            gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.fc2(F.silu(gate) * up)

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, h)
            self.layers = nn.ModuleList(Block() for _ in range(arch["num_layers"]))
            self.norm = nn.RMSNorm(h, eps=eps)
            self.output = nn.Linear(h, vocab, bias=False)
            inv = 1.0 / (arch["rotary_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)

        def forward(self, ids):
            x = self.embed(ids)
            cos, sin = self.cos.to(torch.bfloat16), self.sin.to(torch.bfloat16)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.output(self.norm(x))

    torch.manual_seed(0)
    model = Llama().to(dev)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=arch["init_method_std"])
    if spec["fp8"]:
        import logging

        logging.getLogger("torchao").setLevel(logging.ERROR)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            module_filter_fn=lambda m, fqn: fqn != "output",
            config=Float8LinearConfig.from_recipe_name(spec["recipe"]),
        )
    if spec["compile"]:
        for layer in model.layers:
            layer.compile(dynamic=False)
    loss_fn = lambda logits, y: F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # noqa: E731
    if spec["compile"]:
        loss_fn = torch.compile(loss_fn, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    mbs, accum = spec["micro_batch_size"], spec["global_batch_size"] // spec["micro_batch_size"]
    gen = torch.Generator(device=dev).manual_seed(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses, t_start = [], None
    for step in range(1, spec["steps"] + 1):
        if step == spec["warmup_steps"] + 1:
            sync()
            t_start = time.perf_counter()
        for _ in range(accum):
            ids = torch.randint(0, spec["vocab"], (mbs, seq + 1), device=dev, generator=gen)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            loss = loss_fn(logits, ids[:, 1:]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=cuda)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach() * accum)
    sync()
    timed = spec["steps"] - spec["warmup_steps"]
    tps = timed * spec["global_batch_size"] * seq / (time.perf_counter() - t_start) if t_start and timed else None
    return {
        "tokens_per_s": tps,
        "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if cuda else None,
        "last_loss": float(losses[-1]),
        "flops_per_token": models.flops_per_token(arch, vocab),
        "params": sum(p.numel() for p in model.parameters()),
    }


def reference(args, name: str, out: Path, fp8: bool) -> dict:
    spec = {
        "device": args.device,
        "preset": args.preset,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "compile": args.compile,
        "fp8": fp8,
        "recipe": args.recipe,
        "vocab": args.vocab,
        "num_layers": args.num_layers,
    }
    log = out / f"{name}.log"
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--reference-worker", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=fh,
                text=True,
                env=env,
                timeout=_timeout(args),
            )
        except subprocess.TimeoutExpired:
            return {"name": name, "rc": 124, "wall_s": round(time.time() - t0, 1), "error": f"timed out; {log}"}
    res = {"name": name, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        res["error"] = log.read_text()[-3000:]
        return res
    res.update(json.loads(lines[-1]))
    return res


# ----------------------------------------------------------------------------- the parts


def mfu(r: dict, peak: float) -> float | None:
    return r["tokens_per_s"] * r["flops_per_token"] / (peak * 1e12) if r.get("tokens_per_s") else None


def speed_data(args) -> Path:
    from bench_train_gpu import make_data

    return make_data(
        Path(args.workdir) / f"data-random-{args.vocab}",
        int(args.steps * args.global_batch_size * (args.seq_length + 1) * 1.05),
        vocab=args.vocab,
    )


def numerics_data(args) -> Path:
    if args.blend:
        return Path(args.blend)
    if args.data == "text":
        return make_text_data(Path(args.text_data or Path(args.workdir) / "data-text").resolve(), text_merges(args))
    steps, gbs = args.numerics_steps, args.numerics_global_batch_size
    root = Path(args.workdir) / f"data-chain-{args.vocab}"
    return make_chain_data(root, int(steps * gbs * (args.seq_length + 1) * 1.05), vocab=args.vocab)


SPEED_LABELS = {
    "speed-bf16": "snakellm train bf16",
    "speed-fp8": "snakellm train fp8",
    "reference-bf16": "hand-written Llama bf16",
    "reference-fp8": "hand-written Llama torchao fp8",
    "versus-bf16": "snakellm train bf16, --versus",
}


def speed_run(args, out: Path, blend: Path, name: str) -> dict:
    kw = dict(mbs=args.micro_batch_size, gbs=args.global_batch_size, steps=args.steps, warmup=min(2, args.steps))
    if name.startswith("speed-"):
        r = train(args, name, blend, out, name.split("-")[1], **kw, extra=["--no-checkpoints"])
    elif name == "versus-bf16":  # the same run with the --versus preset (same layers, sequence, batch, data)
        a = copy.copy(args)
        a.preset = args.versus
        r = train(a, name, blend, out, "bf16", **kw, extra=["--no-checkpoints"])
    else:
        r = reference(args, name, out, fp8=name.endswith("fp8"))
    r["label"] = SPEED_LABELS[name].replace("--versus", str(args.versus))
    if args.versus and name == "speed-bf16":
        r["label"] += f", {args.preset}"
    r["label"] += f" ({args.recipe})" if name.endswith("fp8") else ""
    r["gpu"] = _gpu(args)
    ok = f"{r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else f"FAILED rc={r['rc']}\n{r.get('error', '')}"
    print(f"  {r['label']} (GPU {r['gpu']}): {ok} [{r['wall_s']}s]", flush=True)
    return r


def report_speed(args, rows: dict[str, dict]) -> dict:
    gpus = sorted({str(r.get("gpu")) for r in rows.values()})
    print(
        f"\n{args.preset}, seq {args.seq_length}, micro batch {args.micro_batch_size}, global batch "
        f"{args.global_batch_size}, {args.steps} steps (median of windows after step {args.warmup_steps}), "
        f"{'compiled' if args.compile else 'eager'}, {_device_name()} (GPU {', '.join(gpus)}); MFU against the "
        f"bf16 peak {args.peak_tflops} TFLOP/s"
    )
    print(f"{'':60s} {'tokens/s':>10s} {'MFU':>7s} {'peak GiB':>9s} {'GPU':>4s}")
    for label, (tps, m) in ANCHORS.items():
        print(f"{'[anchor] ' + label:60s} {tps:>10,} {f'{m:.1%}' if m else '':>7s} {'':>9s}")
    for r in rows.values():
        m = mfu(r, args.peak_tflops)
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "failed"
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        print(f"{r['label']:60s} {tps:>10s} {f'{m:.1%}' if m else '-':>7s} {peak:>9s} {str(r.get('gpu')):>4s}")
    if not all(r.get("tokens_per_s") for r in rows.values()):
        return {}
    t = {k: r["tokens_per_s"] for k, r in rows.items()}
    d = t["speed-bf16"] / t["reference-bf16"]
    out: dict = {"bf16_vs_reference_bf16": d, "pass": True}
    if not args.bf16_only:
        a, b = t["speed-fp8"] / t["reference-fp8"], t["speed-fp8"] / t["speed-bf16"]
        c = t["reference-fp8"] / t["reference-bf16"]
        bar_a, bar_b = BARS["fp8_vs_reference_fp8"], BARS["fp8_vs_bf16"]
        print(f"ours fp8 / hand-written fp8:   {a:.3f}x (bar >= {bar_a}): {'PASS' if a >= bar_a else 'FAIL'}")
        print(f"ours fp8 / ours bf16:          {b:.3f}x (bar >= {bar_b}): {'PASS' if b >= bar_b else 'FAIL'}")
        print(f"hand-written fp8 / bf16:       {c:.3f}x (the issue's H200 anchor: 1.173x)")
        out.update(
            fp8_vs_reference_fp8=a, fp8_vs_bf16=b, reference_fp8_vs_bf16=c, **{"pass": a >= bar_a and b >= bar_b}
        )
    print(f"ours bf16 / hand-written bf16: {d:.3f}x")
    if "versus-bf16" in t:  # issue 45: a family's shape against another's, the same layers, sequence and batch
        v, bar_v = t["speed-bf16"] / t["versus-bf16"], BARS["versus"]
        mv = mfu(rows["speed-bf16"], args.peak_tflops) / mfu(rows["versus-bf16"], args.peak_tflops)
        print(
            f"ours bf16 {args.preset} / ours bf16 {args.versus}: {v:.3f}x in tokens/s, {mv:.3f}x in MFU "
            f"(bar >= {bar_v}: within 5% of it or faster): {'PASS' if v >= bar_v else 'FAIL'}"
        )
        out.update(versus=args.versus, vs_versus=v, mfu_vs_versus=mv, versus_pass=v >= bar_v)
        out["pass"] = out["pass"] and v >= bar_v
    return out


def numerics_kw(args) -> dict:
    return dict(
        mbs=args.numerics_micro_batch_size,
        gbs=args.numerics_global_batch_size,
        steps=args.numerics_steps,
        warmup=args.lr_warmup,
    )


def numerics_extra(args, *extra: str) -> list[str]:
    """Every step's loss is recorded whatever the interval; a longer one syncs with the host less often."""
    return ["--log-interval", str(args.numerics_log_interval), *extra]


def numerics_plain(args, out: Path, blend: Path, precision: str, name: str) -> dict:
    """A numerics run without checkpoints: bf16's, and each precision's second run (``--bf16-again``,
    ``--fp8-again``: the same command; the FP8 run's checkpoint at --resume-at changes nothing else)."""
    r = train(args, name, blend, out, precision, **numerics_kw(args), extra=numerics_extra(args, "--no-checkpoints"))
    print(f"  {name} {args.numerics_steps} steps (GPU {_gpu(args)}): rc {r['rc']} [{r['wall_s']}s]", flush=True)
    return r


def report_again(args, precision: str, first: dict, again: dict) -> dict:
    """A precision's own run-to-run spread: the same command again, against its first run (the noise floor of
    the FP8 comparison: the GPU's non-deterministic kernels, and the GPU where the lanes differ, are all that
    differs)."""
    if first["rc"] or again["rc"]:
        print(f"{precision} again: FAILED rc {again['rc']}\n{again.get('error', '')}")
        return {}
    steps, c = args.numerics_steps, again["losses"]
    last, mean, worst = loss_gaps(steps, first, again)
    print(
        f"{precision} again (the same command, GPU {again.get('gpu')}): step {steps} {c[steps]:.4f}, {last:+.3%} "
        f"from the first {precision} run; mean of the last 10 steps {mean:+.3%}; largest step difference after "
        f"step {steps // 10}: {worst:.2%} ({precision}'s own spread: the noise floor of fp8's figures above)"
    )
    return {"last_step_rel": last, "final_rel": mean, "worst_step_rel": worst}


def numerics_fp8(args, out: Path, blend: Path) -> tuple[dict, dict]:
    """The uninterrupted FP8 run (a checkpoint at --resume-at), then the resumed one on the same GPU."""
    at = args.resume_at
    extra = numerics_extra(args, "--save-interval", str(at), "--keep-last", "2")
    fp8 = train(args, "numerics-fp8", blend, out, "fp8", **numerics_kw(args), extra=extra)
    print(
        f"  numerics fp8 {args.numerics_steps} steps (GPU {_gpu(args)}): rc {fp8['rc']} [{fp8['wall_s']}s]", flush=True
    )
    if fp8["rc"]:
        return fp8, {"name": "numerics-fp8-resumed", "rc": -1, "wall_s": 0, "error": "the FP8 run failed"}
    resumed = _resume_run(args, blend, out, fp8, numerics_kw(args), at)
    print(f"  numerics fp8 resumed at {at} (GPU {_gpu(args)}): rc {resumed['rc']} [{resumed['wall_s']}s]", flush=True)
    return fp8, resumed


def loss_gaps(steps: int, base: dict, run: dict) -> tuple[float, float, float]:
    """``run`` against ``base``: relative difference at the last step, of the final loss (mean of the last 10
    steps), and the largest at any step after the first tenth."""
    a, b = base["losses"], run["losses"]
    worst = max(abs(b[s] / a[s] - 1) for s in a if s > steps // 10)
    return b[steps] / a[steps] - 1, run["final_loss"] / base["final_loss"] - 1, worst


def report_numerics(args, blend: Path, bf16: dict, fp8: dict, resumed: dict) -> dict:
    steps, at = args.numerics_steps, args.resume_at
    mbs, gbs = args.numerics_micro_batch_size, args.numerics_global_batch_size
    for r in (bf16, fp8, resumed):
        if r["rc"]:
            print(f"FAILED {r['name']}:\n{r.get('error', '')}")
    if bf16["rc"] or fp8["rc"]:
        return {}
    a, b = bf16["losses"], fp8["losses"]
    rl = resumed.get("losses", {})
    every = max(1, steps // 30)
    print(
        f"\nloss curve ({args.preset}, seq {args.seq_length}, micro {mbs} / global batch {gbs}, lr {args.lr}, "
        f"{data_label(args, blend)}, {_device_name()}; "
        f"bf16 on GPU {bf16.get('gpu')}, fp8 and resumed on GPU {fp8.get('gpu')})"
    )
    print(f"{'step':>5s} {'bf16':>9s} {'fp8':>9s} {'fp8/bf16-1':>11s}" + (f" {'resumed':>9s}" if rl else ""))
    for s in sorted(a):
        if s == 1 or s % every == 0 or s == steps or s == at + 1:
            rr = rl.get(s)
            line = f"{s:>5d} {a[s]:>9.4f} {b[s]:>9.4f} {b[s] / a[s] - 1:>+11.2%}"
            print(line + (f" {rr:>9.4f}" if rr is not None else ""))
    last_rel, rel, worst = loss_gaps(steps, bf16, fp8)
    finite = all(math.isfinite(v) for v in b.values())
    ok = abs(rel) <= BARS["final_loss_rel"] and finite
    print(
        f"final loss (mean of the last 10 steps): bf16 {bf16['final_loss']:.4f}, fp8 {fp8['final_loss']:.4f}, "
        f"{rel:+.3%} (bar within {BARS['final_loss_rel']:.0%}): {'PASS' if ok else 'FAIL'}; all finite: {finite}; "
        f"largest step difference after step {steps // 10}: {worst:.2%}"
    )
    # the issue's own words: the loss at the last step (the mean above smooths a noisy curve; both are printed)
    last_ok = abs(last_rel) <= BARS["final_loss_rel"] and finite
    print(
        f"loss at step {steps} (issue 30's bar: within {BARS['final_loss_rel']:.0%} of bf16 at step 300): bf16 "
        f"{a[steps]:.4f}, fp8 {b[steps]:.4f}, {last_rel:+.3%}: {'PASS' if last_ok else 'FAIL'}"
    )
    peaks = f"peak GiB: bf16 {bf16.get('peak_gib')}, fp8 {fp8.get('peak_gib')}"
    tps = f"tokens/s: bf16 {bf16.get('tokens_per_s') or 0:,.0f}, fp8 {fp8.get('tokens_per_s') or 0:,.0f}"
    print(f"{tps}; {peaks} (micro batch {mbs})")
    verdict: dict = {
        "final_rel": rel,
        "last_step_rel": last_rel,
        "last_step_pass": last_ok,
        "finite": finite,
        "worst_step_rel": worst,
        "pass": ok,
    }
    if rl:
        first = rl.get(at + 1) == b.get(at + 1)
        diffs = [abs(rl[s] - b[s]) for s in rl if s in b]
        same = all(d == 0 for d in diffs)
        after = "every step identical" if same else f"largest difference afterwards {max(diffs):.2e}"
        print(
            f"resume from step {at}: steps {min(rl)}-{max(rl)}; first resumed step's loss "
            f"{'identical' if first else 'DIFFERENT'} ({rl.get(at + 1)!r} vs {b.get(at + 1)!r}); {after}; "
            f"last step's loss {rl[max(rl)]:.6f} vs {b[max(rl)]:.6f}: {'PASS' if first else 'FAIL'}"
        )
        verdict.update(
            resume_first_step_identical=first,
            resume_all_identical=same,
            resume_max_abs_diff=max(diffs) if diffs else None,
        )
        verdict["pass"] = ok and first
    return verdict


def side_gap(bf16: list[float], fp8: list[float]) -> dict:
    """fp8 against bf16 over the runs of each side (one loss a run): each side's mean and spread (relative
    standard deviation), fp8's relative difference, its standard error, and whether it is within the bar."""
    mb, mf = statistics.mean(bf16), statistics.mean(fp8)
    sd = {p: statistics.stdev(v) / statistics.mean(v) if len(v) > 1 else 0.0 for p, v in (("bf16", bf16), ("fp8", fp8))}
    var = sum(statistics.variance(v) / len(v) if len(v) > 1 else 0.0 for v in (bf16, fp8))
    rel = mf / mb - 1
    return {
        "bf16": mb,
        "fp8": mf,
        "sd": sd,
        "rel": rel,
        "se": math.sqrt(var) / mb,
        "pass": abs(rel) <= BARS["final_loss_rel"],
    }


def report_both_runs(args, runs: dict[str, list[dict]]) -> dict:
    """With two runs a side: fp8 against bf16 as the mean of each side's two runs, and the range over the four
    cross pairs (each fp8 run against each bf16 run)."""
    if any(r["rc"] for rs in runs.values() for r in rs):
        return {}
    steps = args.numerics_steps
    at = side_gap(*([r["losses"][steps] for r in runs[p]] for p in ("bf16", "fp8")))
    final = side_gap(*([r["final_loss"] for r in runs[p]] for p in ("bf16", "fp8")))
    pairs = [loss_gaps(steps, b, f)[:2] for f in runs["fp8"] for b in runs["bf16"]]
    ok = at["pass"] and final["pass"]
    print(
        f"two runs a side, their means: step {steps} bf16 {at['bf16']:.4f}, fp8 {at['fp8']:.4f}, {at['rel']:+.3%}; "
        f"final loss (mean of the last 10 steps) {final['rel']:+.3%} (bar within {BARS['final_loss_rel']:.0%}): "
        f"{'PASS' if ok else 'FAIL'}; the four cross pairs: step {steps} "
        f"{min(p[0] for p in pairs):+.3%} to {max(p[0] for p in pairs):+.3%}, final loss "
        f"{min(p[1] for p in pairs):+.3%} to {max(p[1] for p in pairs):+.3%}"
    )
    return {"last_step_rel": at["rel"], "final_rel": final["rel"], "pass": ok, "pairs": pairs}


def report_pool(paths: list[Path]) -> dict:
    """Several numerics results (``bench-fp8.json`` of runs with other seeds or machines) as one sample a side:
    every run's final loss and step-``steps`` loss, and :func:`side_gap` of each."""
    runs: dict[str, list[tuple[str, float, float]]] = {"bf16": [], "fp8": []}
    for path in paths:
        got = json.loads(Path(path).read_text())
        num, a = got.get("numerics"), got.get("args", {})
        if not num:
            raise SystemExit(f"{path}: no numerics part")
        steps = str(a.get("numerics_steps"))
        for key in ("bf16", "bf16_again", "fp8", "fp8_again"):
            r = num.get(key)
            if r and not r["rc"]:
                label = f"{path} seed {a.get('seed', 1234)} {key}"
                runs[key.split("_")[0]].append((label, r["final_loss"], r["losses"][steps]))
    if not runs["bf16"] or not runs["fp8"]:
        raise SystemExit("--pool: no finished bf16 and fp8 runs")
    print(f"\npooled numerics: {len(paths)} result files, {len(runs['bf16'])} bf16 and {len(runs['fp8'])} fp8 runs")
    for p_, rs in runs.items():
        for label, final, last in rs:
            print(f"  {p_:4s} final {final:.4f}  step {steps} {last:.4f}  {label}")
    out: dict = {"runs": runs}
    for i, what in ((1, "final loss (mean of the last 10 steps)"), (2, f"loss at step {steps}")):
        g = side_gap(*([r[i] for r in runs[p_]] for p_ in ("bf16", "fp8")))
        print(
            f"{what}: bf16 {g['bf16']:.4f} (runs spread {g['sd']['bf16']:.2%}), fp8 {g['fp8']:.4f} "
            f"({g['sd']['fp8']:.2%}): fp8 {g['rel']:+.3%} (standard error {g['se']:.2%}; bar within "
            f"{BARS['final_loss_rel']:.0%}): {'PASS' if g['pass'] else 'FAIL'}"
        )
        out["final" if i == 1 else "last_step"] = {k: g[k] for k in ("rel", "se", "pass")}
    return out


def _resume_run(args, blend: Path, out: Path, fp8: dict, kw: dict, at: int) -> dict:
    """Move the uninterrupted FP8 run's checkpoint at ``at`` into a run directory of its own and train on."""
    src = Path(fp8["run_dir"]) / "checkpoints"
    dst_run = Path(args.workdir) / "runs" / "numerics-fp8-resumed"
    if dst_run.exists():
        shutil.rmtree(dst_run)
    (dst_run / "checkpoints").mkdir(parents=True)
    it = f"iter_{at:07d}"
    if not (src / it).exists():
        return {"name": "numerics-fp8-resumed", "rc": -1, "wall_s": 0, "error": f"{src / it} missing"}
    os.rename(src / it, dst_run / "checkpoints" / it)  # a move: no copy of ~15 GB
    shutil.copy(src / "run_config.json", dst_run / "checkpoints" / "run_config.json")
    (dst_run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(at))
    extra = numerics_extra(args, "--keep-run-dir", "--resume", "require", "--no-checkpoints")
    return train(args, "numerics-fp8-resumed", blend, out, "fp8", **kw, extra=extra)


def _timeout(args) -> float:
    """A run's time limit: --timeout, and what is left of --budget-s (so the tables still print)."""
    if args.deadline is None:
        return args.timeout
    return max(1.0, min(args.timeout, args.deadline - time.time()))


def _gpu_name(gpu: str | None) -> str:
    """A lane's GPU as printed: its id, or "visible" (no --gpus: the visible device(s))."""
    return "visible" if gpu is None else str(gpu)


def _gpu(args) -> str:
    return _gpu_name(args.gpu)


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--part", choices=("speed", "numerics", "all"), default="all")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, a few steps: the same code paths")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers than the preset's (8 of an 8B: one GPU)")
    p.add_argument(
        "--bf16-only", action="store_true", help="speed part: leave out the FP8 runs (ours and the hand-written)"
    )
    p.add_argument(
        "--versus",
        default=None,
        metavar="PRESET",
        help="speed part: ours bf16 with this preset too (same layers, sequence and batch), and --preset's tokens/s "
        "against it (bar >= 0.95x; e.g. --preset qwen3-8b --versus llama3-8b)",
    )
    p.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise", help="fp8_recipe")
    p.add_argument("--micro-batch-size", type=int, default=16, help="speed part")
    p.add_argument("--global-batch-size", type=int, default=16, help="speed part")
    p.add_argument("--steps", type=int, default=12, help="speed part: steps per run")
    p.add_argument("--warmup-steps", type=int, default=4, help="speed part: steps left out (compilation)")
    p.add_argument("--log-interval", type=int, default=2)
    p.add_argument("--numerics-steps", type=int, default=300)
    p.add_argument("--numerics-log-interval", type=int, default=10)
    p.add_argument("--numerics-micro-batch-size", type=int, default=8)
    p.add_argument("--numerics-global-batch-size", type=int, default=8)
    p.add_argument("--resume-at", type=int, default=200, help="numerics: the checkpoint the resumed run starts from")
    p.add_argument(
        "--bf16-again",
        action="store_true",
        help="numerics: run bf16 a second time (the same command; its own GPU where --gpus has one free, else after "
        "the first on that one): bf16's own spread",
    )
    p.add_argument("--fp8-again", action="store_true", help="numerics: run fp8 a second time, likewise")
    p.add_argument("--seed", type=int, default=1234, help="every run's seed (initialisation and data order)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=30)
    p.add_argument("--data", choices=("text", "chain"), default="text", help="numerics data (see above)")
    p.add_argument(
        "--text-data", default=None, help="numerics: where the text data is, or is built (None: WORKDIR/data-text)"
    )
    p.add_argument("--make-text-data", metavar="DIR", default=None, help="build the text data in DIR and stop")
    p.add_argument("--blend", default=None, help="numerics data: a blend.json of GPT-2 ids instead of --data")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="leave out torch.compile")
    p.add_argument("--vocab", type=int, default=VOCAB, help="ids of the data (GPT-2's vocabulary)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU ids to run lanes side by side (4: ours | hand-written | fp8 numerics + resume | "
        "bf16 numerics; up to 6 with --bf16-again and --fp8-again, a lane each: see run_parts); default: "
        "everything on the visible GPU, one run after another",
    )
    p.add_argument("--peak-tflops", type=float, default=PEAK, help="bf16 dense peak per GPU for MFU (also for FP8)")
    p.add_argument("--workdir", default="/tmp/snakellm-bench-fp8")
    p.add_argument("--out", default=None, help="logs and bench-fp8.json (default: $OUT, else bench-out)")
    p.add_argument("--timeout", type=float, default=580, help="seconds a run may take")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop every run this long after the start, so that the tables of what finished print before an outer "
        "time limit",
    )
    p.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        default=None,
        help="print the numerics of several bench-fp8.json (other seeds: --seed) as one sample a side, and stop",
    )
    p.add_argument("--reference-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.deadline = time.time() + args.budget_s if args.budget_s else None
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron\..*")  # "Transformer Engine and Apex are not installed"
    if args.reference_worker:
        print(json.dumps(reference_worker(json.loads(args.reference_worker))), flush=True)
        return 0
    if args.pool:
        report_pool([Path(x) for x in args.pool])
        return 0
    if args.make_text_data:
        blend = make_text_data(Path(args.make_text_data).resolve())
        print(f"{blend}: {json.loads(blend.read_text())['tokens']:,} GPT-2 tokens")
        return 0
    if args.smoke:
        # seq 64, the numerics' micro batch 1 of 2 and their text in GPT-2's first 1,024 merges (SMOKE_MERGES): the
        # text runs' GPT-2 output layer in bf16 was most of the CPU's time (no bf16 matrix units: ~4 s a step of 512
        # tokens), and the smoke runs five of them
        args.device, args.compile, args.seq_length, args.vocab = "cpu", False, 64, 256
        args.preset = args.preset if args.preset.startswith("tiny") else "tiny-llama"
        args.versus = args.versus and (args.versus if args.versus.startswith("tiny") else "tiny-llama")
        args.micro_batch_size, args.global_batch_size, args.steps, args.warmup_steps = 2, 4, 4, 1
        args.log_interval, args.numerics_log_interval, args.lr_warmup, args.lr = 1, 2, 2, 3e-3
        args.numerics_steps, args.numerics_micro_batch_size, args.numerics_global_batch_size = 8, 1, 2
        args.resume_at, args.timeout, args.bf16_again, args.fp8_again = 4, 300, True, True
        args.workdir = tempfile.mkdtemp(prefix="snakellm-bench-fp8-smoke-")  # removed at the end
    out = Path(args.out or os.environ.get("OUT") or (Path(args.workdir) / "out" if args.smoke else "bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        results = run_parts(args, out)
        results["args"] = vars(args)
        (out / "bench-fp8.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"\ntotal {time.time() - t0:.0f}s; results in {out / 'bench-fp8.json'}")
        if args.smoke and "numerics" in results:  # the pooled report on this run's own results
            report_pool([out / "bench-fp8.json"])
    finally:
        if args.smoke:
            shutil.rmtree(args.workdir, ignore_errors=True)
    parts = [results[k].get("verdict", {}) for k in ("speed", "numerics") if k in results]
    ran = all(parts)  # every part produced its figures
    if args.smoke:  # the CPU is deterministic: the resumed run must repeat the uninterrupted one exactly
        return 0 if ran and results.get("numerics", {}).get("verdict", {}).get("resume_all_identical", True) else 1
    return 0 if ran and all(v.get("pass") for v in parts) else 1


BASE_LANE = {"bf16-again": "numerics-bf16", "fp8-again": "numerics-fp8"}


def plan_lanes(keys: list[str], n: int) -> dict[str, int]:
    """Lane (GPU index) of each kind of run: a GPU each while there are enough; else the fixed plans below,
    a second run of a precision after its first, on the first's GPU."""
    if len(keys) <= n:
        return {k: i for i, k in enumerate(keys)}
    # the longest lanes apart: fp8 numerics + resume ~200 s, hand-written ~95 s + bf16 numerics ~135 s, ours ~130 s
    plan = {1: (0, 0, 0, 0), 2: (0, 1, 1, 0), 3: (0, 1, 2, 1)}.get(n, (0, 1, 2, 3))
    lane_of = {
        k: plan[("ours", "reference", "numerics-fp8", "numerics-bf16").index(k)] for k in keys if k not in BASE_LANE
    }
    return {k: lane_of[BASE_LANE.get(k, k)] for k in keys}


def run_parts(args, out: Path) -> dict:
    """The runs of the parts asked for, in lanes: one lane per GPU of ``--gpus`` (or all in one lane).

    Kinds of run: ours bf16 and fp8 (one lane: their ratio on one device), the two hand-written runs, the
    FP8 numerics run and its resumed run (the resume is compared on the device of the uninterrupted run),
    bf16's numerics run, and the second bf16 and fp8 numerics runs. A GPU each where there are enough
    (--part numerics --bf16-again --fp8-again on four GPUs); else :func:`plan_lanes` shares them.
    """
    from concurrent.futures import ThreadPoolExecutor

    speed, numerics = args.part in ("speed", "all"), args.part in ("numerics", "all")
    sblend = speed_data(args) if speed else None
    nblend = numerics_data(args) if numerics else None
    jobs: list[tuple[str, object]] = []  # (lane key, thunk taking the lane's args)
    if speed:
        fp8 = () if args.bf16_only else ("fp8",)
        for name in ("speed-bf16", *(f"speed-{p}" for p in fp8), *(["versus-bf16"] if args.versus else [])):
            jobs.append(("ours", lambda a, n=name: ("speed", n, speed_run(a, out, sblend, n))))
        for name in ("reference-bf16", *(f"reference-{p}" for p in fp8)):
            jobs.append(("reference", lambda a, n=name: ("speed", n, speed_run(a, out, sblend, n))))
    if numerics:
        jobs.append(("numerics-fp8", lambda a: ("numerics", "fp8", numerics_fp8(a, out, nblend))))
        jobs.append(
            ("numerics-bf16", lambda a: ("numerics", "bf16", numerics_plain(a, out, nblend, "bf16", "numerics-bf16")))
        )
        for p in ("bf16", "fp8"):
            if getattr(args, f"{p}_again"):
                name = f"numerics-{p}-again"
                jobs.append(
                    (
                        f"{p}-again",
                        lambda a, p=p, n=name: ("numerics", f"{p}-again", numerics_plain(a, out, nblend, p, n)),
                    )
                )
    gpus = [g for g in (args.gpus or "").split(",") if g][:6] or [None]
    keys = list(dict.fromkeys(k for k, _ in jobs))
    lane_of = plan_lanes(keys, len(gpus))

    def gpu_label(key: str) -> str:
        return _gpu_name(gpus[lane_of[key]])

    lanes: dict[int, list] = {}
    for k, job in jobs:
        lanes.setdefault(lane_of[k], []).append(job)
    print(
        f"== {args.part}: {args.preset}; lanes: "
        + "; ".join(
            f"GPU {_gpu_name(gpus[i])}: {', '.join(k for k in keys if lane_of[k] == i)}" for i in sorted(lanes)
        ),
        flush=True,
    )

    def run_lane(i: int) -> list:
        a = copy.copy(args)
        a.gpu = gpus[i]  # None: the visible device(s), not restricted
        return [job(a) for job in lanes[i]]

    with ThreadPoolExecutor(len(lanes)) as pool:
        done = [r for rs in pool.map(run_lane, sorted(lanes)) for r in rs]
    results: dict = {}
    if speed:
        rows = {n: r for part, n, r in done if part == "speed"}
        rows = {n: rows[n] for n in SPEED_LABELS if n in rows}
        results["speed"] = {"rows": list(rows.values()), "verdict": report_speed(args, rows)}
    if numerics:
        got = {n: r for part, n, r in done if part == "numerics"}
        (fp8, resumed), bf16 = got["fp8"], got["bf16"]
        for r, key in ((fp8, "numerics-fp8"), (resumed, "numerics-fp8"), (bf16, "numerics-bf16")):
            r["gpu"] = gpu_label(key)
        verdict = report_numerics(args, nblend, bf16, fp8, resumed)
        results["numerics"] = {"bf16": bf16, "fp8": fp8, "resumed": resumed, "verdict": verdict}
        for precision, first in (("bf16", bf16), ("fp8", fp8)):
            if f"{precision}-again" in got:
                again = got[f"{precision}-again"]
                again["gpu"] = gpu_label(f"{precision}-again")
                results["numerics"][f"{precision}_again"] = again
                verdict[f"{precision}_again"] = report_again(args, precision, first, again)
        if "bf16-again" in got and "fp8-again" in got:
            both = {"bf16": [bf16, got["bf16-again"]], "fp8": [fp8, got["fp8-again"]]}
            verdict["two_runs_a_side"] = report_both_runs(args, both)
    return results


if __name__ == "__main__":
    sys.exit(main())
