#!/usr/bin/env python3
"""Conversion at real size in bounded memory: an 8B Llama-3-shaped model, HF -> snakellm -> HF and .nemo.

Steps, each its own process (the real commands), with its wall time and peak resident memory
(``ru_maxrss`` of that process alone, from ``os.wait4``):

1. ``make``: a Hugging Face directory with random bf16 weights of the shape asked for (default Llama
   3.1 8B: 32 layers, d=4096, 32 heads in 8 KV groups, SwiGLU 14336, vocabulary 128,256, untied,
   RoPE scaling llama3), written shard by shard (``--shard-size``), with GPT-2's tokenizer files
   (a tokenizer smaller than the model's vocabulary is allowed);
2. ``snakellm import-hf`` -> runs/bench (then the source directory is removed unless ``--keep``);
3. ``snakellm export-hf`` -> hf-out (then removed);
4. ``snakellm export-nemo`` -> bench.nemo (fp32, as NeMo keeps its parameters; then removed).

The bar: every step's peak RSS under 1.5 x one shard + 2 GB (a 16 GB bf16 model converts on a
24 GB machine). ``--json`` writes the figures. The test suite runs this with a small shape
(tests/test_convert_memory.py).

    python scripts/bench_convert.py --workdir /tmp/convert          # 8B, ~16 GB of bf16 weights
    python scripts/bench_convert.py --layers 4 --hidden 512 --ffn 1536 --heads 8 --kv-heads 2 \\
        --vocab 32000 --shard-size 50MB --workdir /tmp/small
    python scripts/bench_convert.py --smoke    # seconds: one layer, d=64, a temp workdir (tests/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT2_DIR = REPO / "resources" / "tokenizers" / "gpt2"


def hf_config(a: argparse.Namespace) -> dict:
    """config.json of the Llama 3.x model the flags describe."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.ffn,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.hidden // a.heads,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }


def hf_shapes(a: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the model, in the order transformers writes them."""
    h, f, d = a.hidden, a.ffn, a.hidden // a.heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (a.vocab, h))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (a.heads * d, h)),
            (p + "self_attn.k_proj.weight", (a.kv_heads * d, h)),
            (p + "self_attn.v_proj.weight", (a.kv_heads * d, h)),
            (p + "self_attn.o_proj.weight", (h, a.heads * d)),
            (p + "mlp.gate_proj.weight", (f, h)),
            (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (a.vocab, h))]


def make(a: argparse.Namespace, out: Path) -> None:
    """The random bf16 model, one tensor generated at a time and written shard by shard."""
    import torch

    sys.path.insert(0, str(REPO))
    from snakellm.export.hf import parse_size
    from snakellm.export.stream import ShardWriter

    torch.manual_seed(0)
    out.mkdir(parents=True)
    writer = ShardWriter(out, parse_size(a.shard_size))
    # one block of normal(0, 0.02) values, tiled from a random offset per tensor: drawing 8B normals
    # one by one takes an hour on 2 busy cores, copying takes seconds, and the conversion sees the same
    block = (torch.randn(1 << 24) * 0.02).to(torch.bfloat16)
    for name, shape in hf_shapes(a):
        t = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            flat, start = t.view(-1), int(torch.randint(0, block.numel(), ()))
            for lo in range(0, flat.numel(), block.numel()):
                n = min(block.numel(), flat.numel() - lo)
                flat[lo : lo + n].copy_(torch.roll(block, -start)[:n])
        writer.add({name: t})
        del t
    writer.finish()
    (out / "config.json").write_text(json.dumps(hf_config(a), indent=2))
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2_DIR / f, out / f)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def measured(cmd: list[str], log: Path) -> dict:
    """Run ``cmd``; its wall time, exit status and peak RSS (GB)."""
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
        _, status, usage = os.wait4(proc.pid, 0)
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": round(time.time() - t0, 1),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),  # Linux reports KiB
    }


def du(path: Path) -> float:
    """Size of a file or directory in GB."""
    if path.is_file():
        return path.stat().st_size / 1e9
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9


def run(a: argparse.Namespace) -> list[dict]:
    from snakellm.export.hf import parse_size

    wd = Path(a.workdir)
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    # the installed command, or the module where the package is only on PYTHONPATH (the GPU machine)
    exe = Path(sys.executable).parent / "snakellm"
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "snakellm.cli"]
    me = [sys.executable, str(Path(__file__).resolve())]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in SHAPE_KEYS]
    steps = [
        ("make", [*me, *flags, "--make-only", str(wd / "hf")], wd / "hf", None),
        ("import-hf", [*cli, "import-hf", str(wd / "hf"), str(wd / "runs" / "bench")], wd / "runs", wd / "hf"),
        (
            "export-hf",
            [*cli, "export-hf", str(wd / "runs" / "bench"), str(wd / "hf-out"), "--max-shard-size", a.shard_size],
            wd / "hf-out",
            wd / "hf-out",
        ),
        (
            "export-nemo",
            [*cli, "export-nemo", str(wd / "runs" / "bench"), str(wd / "bench.nemo")],
            wd / "bench.nemo",
            wd / "bench.nemo",
        ),
    ]
    shard = parse_size(a.shard_size) / 1e9
    bar = 1.5 * shard + 2.0
    results = []
    for name, cmd, product, remove in steps:
        r = {"step": name, **measured(cmd, wd / f"{name}.log")}
        r["output_gb"] = round(du(product), 2) if product.exists() else None
        r["bar_gb"] = round(bar, 3)
        r["within_bar"] = r["peak_rss_gb"] <= bar
        results.append(r)
        print(json.dumps(r), flush=True)
        if r["rc"] != 0:
            print((wd / f"{name}.log").read_text()[-4000:], file=sys.stderr)
            break
        if remove is not None and not a.keep and name != "make":
            # the step's input (import: the source) or its own product is no longer needed
            shutil.rmtree(remove, ignore_errors=True) if remove.is_dir() else remove.unlink(missing_ok=True)
    return results


SHAPE_KEYS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "shard_size")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--shard-size", default="5GB", help="HF shard size, source and export")
    p.add_argument("--workdir", default="/tmp/snakellm-bench-convert")
    p.add_argument("--keep", action="store_true", help="keep every intermediate")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--make-only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="seconds: a 1-layer d=64 shape in 1 MB shards, temp workdir")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab, a.shard_size = 1, 64, 128, 4, 2, 50304, "1MB"
        a.workdir = tempfile.mkdtemp(prefix="snakellm-bench-convert-smoke-")
    if a.make_only:
        make(a, Path(a.make_only))
        return 0
    sys.path.insert(0, str(REPO))
    results = run(a)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    print(f"\n{'step':12s} {'wall s':>8s} {'peak RSS GB':>12s} {'bar GB':>8s} {'output GB':>10s}")
    for r in results:
        print(
            f"{r['step']:12s} {r['wall_s']:>8.1f} {r['peak_rss_gb']:>12.2f} {r['bar_gb']:>8.2f} {r['output_gb'] or 0:>10.2f}"
        )
    ok = len(results) == 4 and all(r["rc"] == 0 and r["within_bar"] for r in results)
    if a.smoke:
        shutil.rmtree(a.workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
