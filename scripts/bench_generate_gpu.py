#!/usr/bin/env python3
"""Generation speed: snakellm's fast engine and eager decoder vs Hugging Face transformers' ``generate``.

One process, one GPU, the same weights: a randomly initialised llama-1b preset
(TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads in 4 KV groups) in bf16,
exported to a Hugging Face directory with ``snakellm.export.hf.export_hf`` and
loaded back with ``AutoModelForCausalLM`` (SDPA attention). All decode greedily
from the same random prompts (``--prompt-len`` tokens) exactly ``--new-tokens``
tokens (no early stop); tokens/s = batch x new tokens / wall time of the whole
call (prefill included), best of ``--repeats`` after a warm-up (which also
captures the engine's CUDA graphs). The engine runs twice: as it runs by
default (fused Triton kernels for steps of up to ``fused_max_batch`` rows,
``kernels.py``) and with its PyTorch-ops step (``--fused-max-batch 0``, the step
before the kernels).

Printed beside the figures: the bandwidth bound at batch 1 (bytes of weights read
per token / the device-to-device copy bandwidth measured here), the engine's peak
memory, and how many rows the engine's bf16 greedy tokens share with the eager
decoder's and transformers' for the first 16 tokens (bf16: rows may part after a
near-tie). Then, at the engine level (``EngineWorker``, no HTTP): ``--clients``
concurrent streaming clients vs the same requests one at a time (requests/s,
time to first token, inter-token latency), and an evaluation-shaped batch
(``--eval-prompts`` prompts of 64-256 tokens, 32 new tokens) through the eager
decoder in batches of 16 (evaluate's default before the engine) and through the
engine. Bars: batch 1 >= 60% of the bandwidth bound (and >= 1,000 tokens/s for llama-1b);
batch 32 >= 5x transformers. ``--preset llama3-8b`` (Llama 3.1 8B's shape with GPT-2's
vocabulary: about 7.4 B parameters, 14.8 GB of bf16 weights read per token) is issue 31's 8B figure;
``--preset qwen3-8b`` (QK-norm, heads of 128) holds Qwen3 to the same bars; ``--preset qwen3-30b-a3b
--layers 16`` and ``--preset mixtral-8x7b --layers 8`` the mixtures of experts (their bandwidth bound
counts the active weights: the routed experts a decode step reads).

Numerics (issue 45): the engine's greedy rows are fed, teacher-forced, through the eager decoder over
the same weights cast to fp32; against that forward, each bf16 implementation's log-probability of
every generated token (the engine's as it reported them, the eager decoder's and transformers') and
whether its choice is the fp32 argmax. The bar (:func:`numerics_bar`) fails only when the engine is
farther from fp32 than transformers' bf16 is. ``--numerics-only`` runs just that, per batch size.

    python scripts/bench_generate_gpu.py                        # llama-1b on cuda
    python scripts/bench_generate_gpu.py --smoke                # tiny-llama on the CPU: proves the script
    python scripts/bench_generate_gpu.py --preset llama3-8b --repeats 2 --clients 0 --eval-prompts 256 --no-eager
    python scripts/bench_generate_gpu.py --preset qwen3-8b --numerics-only --batch-sizes 8 --new-tokens 64
    python scripts/bench_generate_gpu.py --smoke --numerics-only --dtype bf16 --preset tiny-qwen3   # CPU, bf16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument(
        "--layers", type=int, default=None, help="the preset's shape with this many layers (qwen3-30b-a3b's fp32 copy)"
    )
    p.add_argument("--toy", action="store_true", help="tiny-llama, short runs (for the CPU)")
    p.add_argument("--smoke", action="store_true", help="--toy on the CPU: the same code path in seconds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time the engine with torch.compile'd steps")
    p.add_argument("--no-eager", action="store_true", help="skip the eager decoder (the 'before' figures)")
    p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients (0: skip)")
    p.add_argument("--eval-prompts", type=int, default=1000, help="evaluation-shaped prompts (0: skip)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument(
        "--serve-check",
        action="store_true",
        help="then serve the same model with snakellm serve on 127.0.0.1 and ask it once per API",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="the model's weights (auto: bf16 on cuda, fp32 on the CPU); the numerics bar needs bf16",
    )
    p.add_argument(
        "--numerics-only",
        action="store_true",
        help="only the numerics against the fp32 forward (engine, eager, transformers), per batch size; no timing",
    )
    p.add_argument("--clients-of", default=None, help=argparse.SUPPRESS)  # the HTTP client process (internal)
    a = p.parse_args(argv)
    if a.smoke:  # seconds: two small batches, a few clients and evaluation prompts
        a.toy, a.device, a.batch_sizes, a.clients, a.eval_prompts = True, "cpu", "1,4", 4, 8
    if a.toy:  # a tiny preset of the family asked for (tiny-llama unless it is tiny-*)
        a.preset = a.preset if a.preset.startswith("tiny-") else "tiny-llama"
        a.prompt_len, a.new_tokens, a.repeats = 16, 16, 1
        a.clients, a.eval_prompts = min(a.clients, 8), min(a.eval_prompts, 32)
    if a.dtype == "auto":
        a.dtype = "bf16" if a.device.startswith("cuda") else "fp32"
    if a.numerics_only:
        a.clients, a.eval_prompts, a.serve_check = 0, 0, False
    return a


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn: Any, repeats: int, device: str) -> tuple[float, Any]:
    """Best wall time of ``fn()`` over ``repeats`` runs after one warm-up, and the last result."""
    fn()
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (2 GiB, best of 5)."""
    import torch

    if not device.startswith("cuda"):
        return float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del x, y
    return 2 * 2**30 / best


PEAK_TFLOPS = 989.4  # dense bf16, H100/H200 SXM


def call_roofline(
    b: int, a: argparse.Namespace, bw: float, wbytes: int, element_size: int, kv_bytes_per_token: int
) -> float:
    """The fastest a whole ``b``-row call could run, in tokens/s: its prefill (2 FLOPs a weight a prompt token,
    attention left out) at the bf16 peak, then ``new_tokens - 1`` decode steps, each reading every weight once
    and the rows' cached keys and values once at the measured copy bandwidth (attention's arithmetic, norms,
    sampling and every other kernel left out)."""
    prefill_s = 2 * (wbytes / element_size) * b * a.prompt_len / (PEAK_TFLOPS * 1e12)
    steps = range(a.new_tokens - 1)  # step i attends over prompt_len + i + 1 cached positions a row
    decode_bytes = sum(wbytes + b * (a.prompt_len + i + 1) * kv_bytes_per_token for i in steps)
    return b * a.new_tokens / (prefill_s + decode_bytes / bw)


def kv_bytes_per_token(arch: dict, element_size: int) -> int:
    """Bytes of one token's cached keys and values over all layers."""
    head_dim = arch.get("kv_channels") or arch["hidden_size"] // arch["num_attention_heads"]
    groups = arch.get("num_query_groups") or arch["num_attention_heads"]
    return 2 * arch["num_layers"] * groups * head_dim * element_size


def roofline(batches: dict, a: argparse.Namespace, bw: float, wbytes: int, element_size: int, kv: int) -> None:
    """Print (and record) each batch's whole-call roofline above 1 row, beside the engine and 5x transformers."""
    for b in sorted(int(k) for k in batches if int(k) > 1):
        r = batches[str(b)]
        roof = r["call_roofline_tokens_per_s"] = call_roofline(b, a, bw, wbytes, element_size, kv)
        e, t = r["engine_tokens_per_s"], r["transformers_tokens_per_s"]
        print(
            f"batch {b}, the whole call's roofline (the prefill of {b * a.prompt_len:,} tokens at the bf16 peak "
            f"{PEAK_TFLOPS} TFLOP/s, then {a.new_tokens - 1} decode steps each reading the weights and the KV cache "
            f"once at the measured copy bandwidth): {roof:,.0f} tokens/s; the engine {e:,.0f} = {e / roof:.0%} of "
            f"it; 5x transformers = {5 * t:,.0f} tokens/s = {5 * t / roof:.0%} of it",
            flush=True,
        )


def weight_bytes_per_token(model: Any, arch: dict) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding (one row of it is read),
    which is also the output layer when they are tied. A mixture of experts reads only the routed experts: of each
    layer's experts, ``moe_router_topk`` of ``num_experts`` (the active weights)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if arch.get("num_experts"):
        experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".local_experts." in n)
        total -= experts * (arch["num_experts"] - arch["moe_router_topk"]) // arch["num_experts"]
    emb = model.embedding.word_embeddings.weight
    if arch.get("untie_embeddings_and_output_weights", True) and getattr(model, "output_layer", None) is not None:
        total -= emb.numel() * emb.element_size()
    return total


def build(a: argparse.Namespace) -> tuple[Any, ...]:
    import torch

    from snakellm.export.hf import build_for_import
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.tokenize import encoders

    gpt2 = REPO / "resources" / "tokenizers" / "gpt2"
    tok = encoders.load("gpt2-bpe", vocab_file=str(gpt2 / "vocab.json"), merges_file=str(gpt2 / "merges.txt"))
    arch = resolve(a.preset, {"num_layers": a.layers} if a.layers else None)
    arch["seq_length"] = max(arch["seq_length"], a.prompt_len + a.new_tokens, 256 + 32)
    padded = padded_vocab_size(tok.vocab_size, arch)
    torch.manual_seed(0)
    t0 = time.time()
    model = build_for_import(arch, padded, device=a.device).eval()
    if a.dtype == "bf16":
        model.bfloat16()
    nparams = sum(p.numel() for p in model.parameters())
    print(
        f"model: {a.preset} {nparams / 1e6:.0f}M parameters, {model.embedding.word_embeddings.weight.dtype} on "
        f"{a.device} ({torch.cuda.get_device_name() if a.device.startswith('cuda') else 'CPU'}); torch "
        f"{torch.__version__}; built in {time.time() - t0:.1f} s",
        flush=True,
    )
    return tok, arch, padded, model


def make_engine(
    gen: Any, a: argparse.Namespace, max_batch: int, max_seq_len: int, compile: bool = False, fused: bool = True
) -> Any:
    from snakellm.serve.engine import Engine, EngineSettings

    s = EngineSettings(
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        kv_cache_memory="0.5",
        compile=compile,
        fused_max_batch=EngineSettings.fused_max_batch if fused else 0,
    )
    return Engine(gen, s)


def peak_memory(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def same_rows(x: list[list[int]], y: list[list[int]], n: int = 16) -> int:
    return sum(p[:n] == q[:n] for p, q in zip(x, y, strict=True))


def bench_batch(b: int, a: argparse.Namespace, gen: Any, hf: Any, vocab: int, ref: Any) -> dict:
    """One batch size: the engine (and compiled engine), the eager decoder, transformers; the numerics of each
    against the fp32 forward ``ref`` (:func:`against_fp32`)."""
    import torch

    from snakellm.serve.generate import SamplingParams

    prompts = torch.randint(0, vocab, (b, a.prompt_len), generator=torch.Generator().manual_seed(b))
    params = SamplingParams(max_new_tokens=a.new_tokens, greedy=True, stop_at_eod=False)
    lp_params = SamplingParams(max_new_tokens=a.new_tokens, greedy=True, stop_at_eod=False, logprobs=True)
    rows = prompts.tolist()
    r: dict[str, Any] = {"batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens}
    if a.numerics_only:
        eng = make_engine(gen, a, b, a.prompt_len + a.new_tokens)
        r.update(against_fp32(ref, gen, eng.generate(rows, lp_params), hf))
        text, ok = numerics_bar(r["vs_fp32"])
        print(f"batch {b:>3} numerics: {text}: {'ok' if ok else 'FARTHER'}", flush=True)
        return r
    times, ids = {}, {}
    # the engine as it runs by default (fused Triton kernels up to fused_max_batch rows), and its PyTorch-ops step
    variants = [("engine", False, True), ("engine_unfused", False, False)]
    variants += [("engine_compiled", True, False)] if a.compile else []
    for name, comp, fused in variants:
        t0 = time.perf_counter()
        eng = make_engine(gen, a, b, a.prompt_len + a.new_tokens, compile=comp, fused=fused)
        reset_peak(a.device)
        times[name], out = best_time(lambda eng=eng: eng.generate(rows, params), a.repeats, a.device)
        ids[name] = [o.ids for o in out]
        r[f"{name}_peak_gib"] = peak_memory(a.device)
        r[f"{name}_start_s"] = time.perf_counter() - t0 - times[name] * (a.repeats + 1)
        r[f"{name}_kv_cache_gib"] = eng.fast.cache.nbytes / 2**30
        if name == "engine":
            r.update(against_fp32(ref, gen, eng.generate(rows, lp_params), hf))
        del eng
        torch.cuda.empty_cache() if a.device.startswith("cuda") else None
    if not a.no_eager:
        times["eager"], out = best_time(lambda: gen.generate(rows, params), max(1, a.repeats - 1), a.device)
        ids["eager"] = [o.ids for o in out]
    x = prompts.to(a.device)

    def run_hf() -> Any:
        with torch.inference_mode():
            return hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=a.new_tokens,
                min_new_tokens=a.new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )

    # as many timed runs as the engine, best of them: its `generate` is bound by the host issuing kernels and varied
    # 868-1,228 tokens/s at 8B, batch 32, in three runs on one H100 machine
    times["transformers"], out = best_time(run_hf, a.repeats, a.device)
    ids["transformers"] = out[:, a.prompt_len :].tolist()
    for k, v in times.items():
        r[f"{k}_tokens_per_s"] = b * a.new_tokens / v
    for k in ids:
        if k != "engine":
            r[f"rows_same_16_engine_vs_{k}"] = same_rows(ids["engine"], ids[k])
    r["speedup_vs_transformers"] = r["engine_tokens_per_s"] / r["transformers_tokens_per_s"]
    line = " | ".join(f"{k} {b * a.new_tokens / v:,.1f}" for k, v in times.items())
    agree = ", ".join(f"{k.split('_vs_')[1]} {v}/{b}" for k, v in r.items() if k.startswith("rows_same"))
    vs = r["vs_fp32"]
    agree += "; teacher-forced against fp32, |d logprob| max/mean: " + ", ".join(
        f"{k} {vs[k]['max']:.3f}/{vs[k]['mean']:.3f}" for k in IMPLS if k in vs
    )
    print(
        f"batch {b:>3} tokens/s: {line} | engine/transformers {r['speedup_vs_transformers']:.2f}x | peak "
        f"{r['engine_peak_gib']:.2f} GiB (KV cache {r['engine_kv_cache_gib']:.2f}) | engine rows equal for 16 "
        f"tokens to: {agree}",
        flush=True,
    )
    return r


IMPLS = ("engine", "eager", "transformers")
FP32_NOISE = 1e-4  # nats: fp32 models (the CPU smoke) part from their fp32 reference by rounding only


def against_fp32(ref: Any, gen: Any, outs: list, hf: Any = None) -> dict:
    """Each implementation's log-probabilities of the engine's greedy rows against an fp32 forward of the same
    weights (teacher forcing: every implementation is fed the same rows, the prompt and the engine's tokens).

    ``ref``: the eager decoder over an fp32 copy of the model (the bf16 weights, exactly, in fp32). For each
    implementation, at every generated position: ``|log p(token) - log p_fp32(token)|`` (its max, mean and
    the mean's standard error), and whether its choice is the fp32 argmax (the engine's choice is the token
    it drew; the eager decoder's and transformers' the argmax of their teacher-forced logits). The engine's
    log-probabilities are those it reported while generating. ``engine_minus_transformers``: the per-position
    difference of the engine's and transformers' distances (mean and standard error), for the bar.
    """
    import torch

    dec = gen.decoder
    rows = [o.prompt_ids + o.ids for o in outs]
    n_prompt = len(outs[0].prompt_ids)
    tokens = torch.tensor(rows, device=dec.device)
    b, t = tokens.shape
    positions = torch.arange(t, device=dec.device)[None].expand(b, t)
    valid = torch.ones(b, t, dtype=torch.bool, device=dec.device)
    target = tokens[:, n_prompt:, None]

    def scored(logits: Any) -> tuple[Any, Any]:
        lsm = torch.log_softmax(logits.float(), dim=-1)
        return lsm.gather(-1, target)[..., 0], lsm.argmax(dim=-1)

    with torch.inference_mode():
        lp32, top32 = scored(ref.forward(tokens, positions, ref.new_cache(b, t), 0, valid)[:, n_prompt - 1 : -1])
        per: dict[str, tuple[Any, Any]] = {
            "engine": (torch.tensor([o.logprobs for o in outs], device=dec.device), tokens[:, n_prompt:]),
            "eager": scored(dec.forward(tokens, positions, dec.new_cache(b, t), 0, valid)[:, n_prompt - 1 : -1]),
        }
        if hf is not None:
            hl = hf(tokens.to(hf.device)).logits[:, n_prompt - 1 : -1].to(dec.device)
            per["transformers"] = scored(hl)
    out: dict[str, Any] = {}
    dist: dict[str, Any] = {}
    for name, (lp, choice) in per.items():
        d = dist[name] = (lp.float() - lp32).abs().flatten()
        agree = (choice == top32).float().flatten()
        out[name] = {
            "max": d.max().item(),
            "mean": d.mean().item(),
            "se": (d.std() / d.numel() ** 0.5).item() if d.numel() > 1 else 0.0,
            "agree_fp32_argmax": agree.mean().item(),
            "agree_se": (agree.std() / agree.numel() ** 0.5).item() if agree.numel() > 1 else 0.0,
            "positions": d.numel(),
        }
    if "transformers" in dist:
        diff = dist["engine"] - dist["transformers"]
        out["engine_minus_transformers"] = {
            "mean": diff.mean().item(),
            "se": (diff.std() / diff.numel() ** 0.5).item() if diff.numel() > 1 else 0.0,
        }
    return {"vs_fp32": out}


def numerics_bar(vs: dict) -> tuple[str, bool]:
    """The engine's log-probabilities no farther from the fp32 forward than transformers' bf16 are.

    Farther means: a mean distance above transformers' by more than twice the standard error of the paired
    per-position difference and by more than a tenth of transformers' mean (a tiny model's distances are
    thousandths of a nat: their noise is not a difference of implementations; in fp32, differences below
    ``FP32_NOISE`` are the order of the sums), or a largest distance above 1.5x transformers' largest (a maximum over a few
    thousand positions is one draw of a heavy tail), or agreeing with the fp32 argmax less often than
    transformers by more than twice the agreement's standard error. Rows of random weights carry near-ties
    where any bf16 implementation may part from fp32: the yardstick is the other bf16 implementation's
    distance, not the distance to one of them (the former bar's: the eager bf16 decoder's top token).
    """
    e, h, d = vs["engine"], vs["transformers"], vs["engine_minus_transformers"]
    slack = max(2 * d["se"], 0.1 * h["mean"], FP32_NOISE)
    mean_ok = d["mean"] <= slack
    max_ok = e["max"] <= max(1.5 * h["max"], FP32_NOISE)
    agree_ok = e["agree_fp32_argmax"] >= h["agree_fp32_argmax"] - 2 * max(e["agree_se"], h["agree_se"])
    eager = vs.get("eager")
    text = (
        f"engine no farther from the fp32 forward than transformers' bf16 (|d logprob| max/mean: engine "
        f"{e['max']:.3f}/{e['mean']:.3f}, transformers {h['max']:.3f}/{h['mean']:.3f}"
        + (f", eager {eager['max']:.3f}/{eager['mean']:.3f}" if eager else "")
        + f"; mean difference {d['mean']:+.4f} (<= max(2 SE, 10% of transformers') {slack:.4f}); max <= 1.5x "
        f"transformers'; fp32 argmax "
        f"agreement engine {e['agree_fp32_argmax']:.1%}, transformers {h['agree_fp32_argmax']:.1%}"
        + (f", eager {eager['agree_fp32_argmax']:.1%}" if eager else "")
        + f"; {e['positions']} positions)"
    )
    return text, mean_ok and max_ok and agree_ok


def fp32_reference(model: Any, arch: dict, vocab: int) -> Any:
    """The eager decoder over the model's weights cast to fp32 (the same values; one tensor cast at a time)."""
    import torch

    from snakellm.serve.generate import Decoder

    return Decoder(model, arch, vocab).cast(torch.float32)


def graph_check(gen: Any, a: argparse.Namespace, vocab: int) -> dict:
    """Sampled (top-k/top-p/penalty, seeded) and greedy tokens with CUDA graphs equal the same code without."""
    import torch

    from snakellm.serve.engine import Engine, EngineSettings
    from snakellm.serve.generate import SamplingParams

    prompts = torch.randint(0, vocab, (6, 40), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [p[: 10 + 5 * i] for i, p in enumerate(prompts)]
    out = {}
    for name, params in (
        ("sampled", SamplingParams(48, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=11)),
        ("greedy", SamplingParams(48, greedy=True, stop_at_eod=False)),
    ):
        got = []
        for graphs in (True, False):
            eng = Engine(gen, EngineSettings(max_batch=8, max_seq_len=128, kv_cache_memory="0.2", cuda_graphs=graphs))
            got.append([o.ids for o in eng.generate(prompts, params)])
        out[name] = sum(x == y for x, y in zip(*got, strict=True))
    print(f"CUDA graphs vs the same step eagerly, rows identical: sampled {out['sampled']}/6, greedy {out['greedy']}/6")
    return out


async def _client(worker: Any, prompt: list[int], params: Any, t_start: float) -> dict:
    stamps = []
    async for ev in worker.submit(prompt, params):
        if ev.token is not None:
            stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t_start, "itl": [y - x for x, y in zip(stamps, stamps[1:], strict=False)]}


def bench_clients(a: argparse.Namespace, gen: Any, vocab: int) -> dict:
    """``--clients`` concurrent streaming clients vs the same requests one at a time, through EngineWorker."""
    import torch

    from snakellm.serve.engine import EngineWorker
    from snakellm.serve.generate import SamplingParams

    n = a.clients
    prompts = torch.randint(0, vocab, (n, a.prompt_len), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_new_tokens=a.new_tokens, greedy=True, stop_at_eod=False)
    worker = EngineWorker(make_engine(gen, a, n, a.prompt_len + a.new_tokens))
    try:
        worker.submit(prompts[0], params).result()  # warm-up: graphs for batch 1
        t0 = time.perf_counter()
        seq = []
        for p in prompts:
            ts = time.perf_counter()
            seq.append(asyncio.run(_client(worker, p, params, ts)))
        t_seq = time.perf_counter() - t0

        async def together() -> list[dict]:
            ts = time.perf_counter()
            return await asyncio.gather(*(_client(worker, p, params, ts) for p in prompts))

        asyncio.run(together())  # warm-up: graphs for the larger buckets
        t0 = time.perf_counter()
        par = asyncio.run(together())
        t_par = time.perf_counter() - t0
    finally:
        worker.close()

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) > 1 else xs[0] * 1000

    r: dict[str, Any] = {"clients": n, "sequential_rps": n / t_seq, "concurrent_rps": n / t_par}
    for name, res in (("sequential", seq), ("concurrent", par)):
        ttft = [x["ttft"] for x in res]
        itl = [y for x in res for y in x["itl"]]
        r[name] = {f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 90, 99)}
        r[name].update({f"itl_p{q}_ms": pct(itl, q) for q in (50, 90, 99)})
    r["speedup"] = r["concurrent_rps"] / r["sequential_rps"]
    print(
        f"engine, {n} streaming clients: concurrent {r['concurrent_rps']:.2f} req/s vs sequential "
        f"{r['sequential_rps']:.2f} req/s = {r['speedup']:.1f}x; concurrent TTFT p50/p90/p99 "
        f"{r['concurrent']['ttft_p50_ms']:.1f}/{r['concurrent']['ttft_p90_ms']:.1f}/"
        f"{r['concurrent']['ttft_p99_ms']:.1f} ms, ITL p50/p90/p99 {r['concurrent']['itl_p50_ms']:.2f}/"
        f"{r['concurrent']['itl_p90_ms']:.2f}/{r['concurrent']['itl_p99_ms']:.2f} ms; sequential TTFT p50 "
        f"{r['sequential']['ttft_p50_ms']:.1f} ms, ITL p50 {r['sequential']['itl_p50_ms']:.2f} ms",
        flush=True,
    )
    return r


def bench_eval(a: argparse.Namespace, gen: Any, vocab: int) -> dict:
    """Evaluation-shaped work: prompts of 64-256 tokens, 32 new greedy tokens; eager in batches of 16 vs engine."""
    import torch

    from snakellm.serve.generate import SamplingParams

    g = torch.Generator().manual_seed(11)
    lens = torch.randint(64, 257, (a.eval_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_new_tokens=32, greedy=True, stop_at_eod=False)
    eng = make_engine(gen, a, 64, 256 + 32)
    eng.generate(prompts[:64], params)  # warm-up
    sync(a.device)
    t0 = time.perf_counter()
    fast = eng.generate(prompts, params)
    sync(a.device)
    t_fast = time.perf_counter() - t0
    r: dict[str, Any] = {"prompts": len(prompts), "engine_examples_per_s": len(prompts) / t_fast}
    if not a.no_eager:
        t0 = time.perf_counter()
        eager = [o for k in range(0, len(prompts), 16) for o in gen.generate(prompts[k : k + 16], params)]
        sync(a.device)
        r["eager_batch16_examples_per_s"] = len(prompts) / (time.perf_counter() - t0)
        r["rows_same_16"] = same_rows([o.ids for o in fast], [o.ids for o in eager])
    print(
        f"evaluation-shaped, {len(prompts)} prompts of 64-256 tokens, 32 new: engine "
        f"{r['engine_examples_per_s']:.1f} examples/s"
        + (
            f" vs eager batches of 16 {r['eager_batch16_examples_per_s']:.1f} examples/s "
            f"({r['engine_examples_per_s'] / r['eager_batch16_examples_per_s']:.1f}x; rows equal for 16 tokens "
            f"{r['rows_same_16']}/{len(prompts)})"
            if "eager_batch16_examples_per_s" in r
            else ""
        ),
        flush=True,
    )
    return r


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.clients_of:
        print(json.dumps(http_clients(a.clients_of, a.clients, a.new_tokens)))
        return 0
    import torch

    from snakellm.models.loading import LoadedModel
    from snakellm.serve.generate import Generator

    cuda = a.device.startswith("cuda")
    tok, arch, padded, model = build(a)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    results["preset"], results["dtype"] = a.preset, a.dtype
    ref = fp32_reference(model, arch, tok.vocab_size)
    if a.numerics_only:
        return numerics_only(a, model, arch, padded, tok, ref, results)
    bw = copy_bandwidth(a.device)
    wbytes = weight_bytes_per_token(model, arch)
    results["bound"] = {"copy_bytes_per_s": bw, "weight_bytes_per_token": wbytes, "tokens_per_s": bw / wbytes}
    print(
        f"bandwidth bound at batch 1: {wbytes / 1e9:.3f} GB of weights per token / {bw / 1e12:.2f} TB/s measured "
        f"copy bandwidth (read + write) = {bw / wbytes:,.0f} tokens/s",
        flush=True,
    )
    loaded = LoadedModel(model, arch, padded, tok.info(), 0, Path("random-init"), Path("random-init"), a.device)
    gen = Generator(model, arch, tok, tok.vocab_size)
    if cuda:
        results["graph_check"] = graph_check(gen, a, tok.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        hf = load_transformers(loaded, a, Path(tmp))
        batches = a.batch_sizes.split(",")
        results["batches"] = {b: bench_batch(int(b), a, gen, hf, tok.vocab_size, ref) for b in batches}
        del hf
    if a.clients:
        results["clients"] = bench_clients(a, gen, tok.vocab_size)
    if a.eval_prompts:
        results["eval"] = bench_eval(a, gen, tok.vocab_size)
    if a.serve_check:
        results["serve"] = serve_check(gen, a.device, a.clients or 8, a.new_tokens)
    size = model.embedding.word_embeddings.weight.element_size()
    roofline(results["batches"], a, bw, wbytes, size, kv_bytes_per_token(arch, size))
    bars = []
    if "1" in results["batches"]:
        v = results["batches"]["1"]["engine_tokens_per_s"]
        if a.preset == "llama-1b":
            bars.append((f"batch 1 >= 1,000 tokens/s ({v:,.0f}; bound {bw / wbytes:,.0f})", v >= 1000))
        share = v / (bw / wbytes)
        bars.append(
            (f"batch 1 >= 60% of the bandwidth bound ({v:,.0f} = {share:.0%} of {bw / wbytes:,.0f})", share >= 0.6)
        )
    if "32" in results["batches"]:
        r32 = results["batches"]["32"]
        v, e32, roof = r32["speedup_vs_transformers"], r32["engine_tokens_per_s"], r32["call_roofline_tokens_per_s"]
        bars.append(
            (f"batch 32 >= 5x transformers ({v:.2f}x; the engine at {e32 / roof:.0%} of the roofline above)", v >= 5)
        )
        if "engine_compiled_tokens_per_s" in r32:  # --compile: the engine's compile setting
            v = r32["engine_compiled_tokens_per_s"] / r32["transformers_tokens_per_s"]
            bars.append((f"batch 32 with the engine's compile setting >= 5x transformers ({v:.2f}x)", v >= 5))
    # the yardstick is an fp32 forward of the same weights, not another bf16 implementation: against the eager
    # bf16 decoder's top token the engine "failed" at 8B (0.406 nats, allowed 0.328) while against fp32 it was
    # as close as transformers' bf16 (max 0.240 vs 0.270, mean 0.063 vs 0.065)
    bars += [
        (f"batch {k}: {text}", ok) for k, r in results["batches"].items() for text, ok in [numerics_bar(r["vs_fp32"])]
    ]
    if "serve" in results:
        v = results["serve"]["speedup"]
        bars.append((f"server: {results['serve']['clients']} concurrent clients >= 8x sequential ({v:.1f}x)", v >= 8))
    for text, ok in bars:
        print(f"bar: {text}: {'PASS' if ok else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0 if all(ok for _, ok in bars) or not cuda else 1


def load_transformers(loaded: Any, a: argparse.Namespace, tmp: Path) -> Any:
    """The same weights through our Hugging Face export, loaded by transformers (SDPA) in the model's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import export_hf

    bf16 = a.dtype == "bf16"
    out = export_hf(loaded, tmp / "hf", dtype="bfloat16" if bf16 else "float32")
    dtype = torch.bfloat16 if bf16 else torch.float32
    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation="sdpa").to(a.device).eval()


def numerics_only(a: argparse.Namespace, model: Any, arch: dict, padded: int, tok: Any, ref: Any, results: dict) -> int:
    """``--numerics-only``: per batch size the engine's greedy rows, and every implementation against fp32."""
    from snakellm.models.loading import LoadedModel
    from snakellm.serve.generate import Generator

    loaded = LoadedModel(model, arch, padded, tok.info(), 0, Path("random-init"), Path("random-init"), a.device)
    gen = Generator(model, arch, tok, tok.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        hf = load_transformers(loaded, a, Path(tmp))
        batches = a.batch_sizes.split(",")
        results["batches"] = {b: bench_batch(int(b), a, gen, hf, tok.vocab_size, ref) for b in batches}
    bars = [numerics_bar(r["vs_fp32"]) for r in results["batches"].values()]
    for (text, ok), b in zip(bars, results["batches"], strict=True):
        print(f"bar: batch {b}: {text}: {'PASS' if ok else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0 if all(ok for _, ok in bars) else 1


def http_clients(url: str, clients: int, max_tokens: int) -> tuple[float, float, list[str], list[str]]:
    """``clients`` concurrent OpenAI completions, after a warm-up, then the same ones in sequence:
    (sequential s, concurrent s, sequential texts, concurrent texts). Run by the client process."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    words = "the of and to in is was for on that with as by at from his her an which".split()
    prompts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(20 + i % 9)) for i in range(clients)]

    def one(prompt: str) -> str:
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    one(prompts[0])
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, prompts))  # warm-up: graphs for the larger buckets
        t0 = time.perf_counter()
        par = list(pool.map(one, prompts))
        t_par = time.perf_counter() - t0
    t0 = time.perf_counter()
    seq = [one(p) for p in prompts]
    return time.perf_counter() - t0, t_par, seq, par


def serve_check(gen: Any, device: str, clients: int, max_tokens: int) -> dict:
    """NeMo's PUT /generate and OpenAI's /v1/completions against this device's model, over real HTTP;
    then ``clients`` concurrent completions vs the same ones in sequence (requests/s)."""
    import subprocess
    import urllib.request

    from snakellm.serve.server import serve_in_thread
    from snakellm.serve.settings import ServeSettings

    url, stop = serve_in_thread(gen, ServeSettings(port=0, quiet=True), "bench")

    def call(path: str, method: str, body: dict) -> tuple[int, Any]:
        req = urllib.request.Request(
            url + path, data=json.dumps(body).encode(), method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())

    code, r = call(
        "/generate",
        "PUT",
        {
            "sentences": ["Deep learning is", "The capital of France"],
            "tokens_to_generate": min(300, gen.decoder.max_len - 8),
            "temperature": 1.0,
            "add_BOS": True,
            "top_k": 0,
            "top_p": 0.9,
            "greedy": False,
            "all_probs": False,
            "repetition_penalty": 1.2,
            "min_tokens_to_generate": 2,
        },
    )
    print(f"serve on {device}: PUT /generate -> {code}, keys {sorted(r)}, {len(r['token_ids'][0])} tokens in row 0")
    code, r = call("/v1/completions", "POST", {"model": "bench", "prompt": "Hello", "max_tokens": 16, "temperature": 0})
    print(f"serve on {device}: POST /v1/completions -> {code}, usage {r['usage']}")
    try:  # the clients in a process of their own, as users' are: the server keeps its GIL to itself
        cmd = [sys.executable, __file__, "--clients-of", url, "--clients", str(clients)]
        done = subprocess.run([*cmd, "--new-tokens", str(max_tokens)], capture_output=True, text=True, check=True)
        t_seq, t_par, seq, par = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        stop()
    out = {"clients": clients, "sequential_rps": clients / t_seq, "concurrent_rps": clients / t_par}
    out["speedup"] = out["concurrent_rps"] / out["sequential_rps"]
    out["same_texts"] = sum(x == y for x, y in zip(par, seq, strict=True))
    print(
        f"serve on {device}: {clients} concurrent completions ({max_tokens} tokens, greedy) "
        f"{out['concurrent_rps']:.1f} req/s vs sequential {out['sequential_rps']:.1f} req/s = {out['speedup']:.1f}x; "
        f"same texts {out['same_texts']}/{clients}",
        flush=True,
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
