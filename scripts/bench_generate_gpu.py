#!/usr/bin/env python3
"""Generation speed: snakellm's KV-cached decoding vs Hugging Face transformers' ``generate``.

One process, one GPU, the same weights: a randomly initialised llama-1b preset
(TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads in 4 KV groups) in bf16,
exported to a Hugging Face directory with ``snakellm.export.hf.export_hf`` and
loaded back with ``AutoModelForCausalLM`` (SDPA attention). Both decode greedily
from the same random prompts (``--prompt-len`` tokens, all rows the same length)
exactly ``--new-tokens`` tokens (no early stop); tokens/s = batch x new tokens /
wall time of the whole call (prefill included), best of ``--repeats`` after a
warm-up. Bar: ours >= transformers at every batch size.

    python scripts/bench_generate_gpu.py                        # llama-1b, batch 1 and 32, on cuda
    python scripts/bench_generate_gpu.py --toy --device cpu     # tiny-llama on the CPU: proves the script
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--toy", action="store_true", help="tiny-llama, short runs (for the CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument(
        "--serve-check",
        action="store_true",
        help="then serve the same model with snakellm serve's handler on 127.0.0.1 and ask it once per API",
    )
    a = p.parse_args()
    if a.toy:
        a.preset, a.prompt_len, a.new_tokens, a.repeats = "tiny-llama", 16, 16, 1
    import torch
    from transformers import AutoModelForCausalLM

    from snakellm.export.hf import build_for_import, export_hf
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.models.loading import LoadedModel
    from snakellm.serve.generate import Generator, SamplingParams
    from snakellm.tokenize import encoders

    cuda = a.device.startswith("cuda")
    bf16 = cuda
    dtype = torch.bfloat16 if bf16 else torch.float32
    gpt2 = REPO / "resources" / "tokenizers" / "gpt2"
    tok = encoders.load("gpt2-bpe", vocab_file=str(gpt2 / "vocab.json"), merges_file=str(gpt2 / "merges.txt"))
    info = tok.info()
    arch = resolve(a.preset)
    if arch["seq_length"] < a.prompt_len + a.new_tokens:
        arch["seq_length"] = a.prompt_len + a.new_tokens
    padded = padded_vocab_size(tok.vocab_size, arch)
    torch.manual_seed(0)
    t0 = time.time()
    model = build_for_import(arch, padded, device=a.device).eval()
    if bf16:
        model.bfloat16()
    nparams = sum(p.numel() for p in model.parameters())
    print(
        f"model: {a.preset} {nparams / 1e6:.0f}M parameters, {str(dtype)[6:]} on {a.device} "
        f"({torch.cuda.get_device_name() if cuda else 'CPU'}); built in {time.time() - t0:.1f} s",
        flush=True,
    )
    loaded = LoadedModel(model, arch, padded, info, 0, Path("random-init"), Path("random-init"), a.device)
    ours = Generator(model, arch, tok, tok.vocab_size)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        out = export_hf(loaded, Path(tmp) / "hf", dtype="bfloat16" if bf16 else "float32")
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation="sdpa").to(a.device).eval()
        print(f"exported to HF and loaded {type(hf).__name__} in {time.time() - t0:.1f} s", flush=True)

        def sync():
            if cuda:
                torch.cuda.synchronize()

        for b in [int(x) for x in a.batch_sizes.split(",")]:
            g = torch.Generator().manual_seed(b)
            prompts = torch.randint(0, tok.vocab_size, (b, a.prompt_len), generator=g)
            params = SamplingParams(max_new_tokens=a.new_tokens, greedy=True, stop_at_eod=False)

            def run_ours(n=a.new_tokens, params=params, prompts=prompts):
                params.max_new_tokens = n
                return ours.generate(prompts.tolist(), params)

            x = prompts.to(a.device)

            def run_hf(n=a.new_tokens, x=x):
                with torch.inference_mode():
                    return hf.generate(
                        x,
                        attention_mask=torch.ones_like(x),
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=0,
                        eos_token_id=None,
                    )

            times = {}
            outs = {}
            for name, fn in (("snakellm", run_ours), ("transformers", run_hf)):
                fn(8)  # warm-up
                best = float("inf")
                for _ in range(a.repeats):
                    sync()
                    t = time.perf_counter()
                    outs[name] = fn()
                    sync()
                    best = min(best, time.perf_counter() - t)
                times[name] = best
            ours_ids = [o.ids for o in outs["snakellm"]]
            hf_ids = outs["transformers"][:, a.prompt_len :].tolist()
            first = sum(o[:16] == h[:16] for o, h in zip(ours_ids, hf_ids, strict=True))
            tps = {k: b * a.new_tokens / v for k, v in times.items()}
            results[b] = {
                "snakellm_tokens_per_s": tps["snakellm"],
                "transformers_tokens_per_s": tps["transformers"],
                "speedup": tps["snakellm"] / tps["transformers"],
                "rows_same_first_16_tokens": first,
                "batch": b,
                "prompt_len": a.prompt_len,
                "new_tokens": a.new_tokens,
            }
            print(
                f"batch {b:>3}: snakellm {tps['snakellm']:>9.1f} tokens/s | transformers {tps['transformers']:>9.1f} "
                f"tokens/s | {tps['snakellm'] / tps['transformers']:.2f}x | greedy rows identical for 16 tokens: "
                f"{first}/{b}",
                flush=True,
            )
    if a.serve_check:
        serve_check(ours, a.device)
    ok = all(r["speedup"] >= 1.0 for r in results.values())
    print(f"bar (at least as fast as transformers at every batch size): {'PASS' if ok else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


def serve_check(gen, device: str) -> None:
    """NeMo's PUT /generate and OpenAI's /v1/completions against this device's model, over real HTTP."""
    import urllib.request

    from snakellm.serve.server import serve_in_thread
    from snakellm.serve.settings import ServeSettings

    url, stop = serve_in_thread(gen, ServeSettings(port=0, quiet=True), "bench")

    def call(path, method, body):
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
    stop()


if __name__ == "__main__":
    sys.exit(main())
