#!/usr/bin/env python3
"""Server throughput on the CPU: parallel clients vs the same requests one at a time, over real HTTP.

A randomly initialised ``tiny`` model (the embedded default's shape) with the GPT-2
tokenizer is served by ``snakellm serve``'s own app on 127.0.0.1 (uvicorn), once
with the continuous-batching engine (what ``snakellm serve`` runs) and once with
the single model worker it replaced (requests one at a time) for reference.
``--requests`` OpenAI completions (``--max-tokens`` new tokens, greedy) are sent
one after another, then from ``--clients`` threads at once, by a client process of
their own (as users' clients are); requests/s of each.
Bar: parallel >= 3x sequential on the engine. Not a timed test: the figure moves
with the machine's load.

    python scripts/bench_serve_cpu.py
    python scripts/bench_serve_cpu.py --smoke   # seconds: 4 requests, 2 clients, 4 tokens (tests/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model(preset: str) -> Any:
    import torch

    from snakellm.export.hf import build_for_import
    from snakellm.models.architecture import padded_vocab_size, resolve
    from snakellm.serve.generate import Generator
    from snakellm.tokenize import encoders

    gpt2 = REPO / "resources" / "tokenizers" / "gpt2"
    tok = encoders.load("gpt2-bpe", vocab_file=str(gpt2 / "vocab.json"), merges_file=str(gpt2 / "merges.txt"))
    arch = resolve(preset)
    torch.manual_seed(0)
    m = build_for_import(arch, padded_vocab_size(tok.vocab_size, arch)).eval()
    return Generator(m, arch, tok, tok.vocab_size)


def serve(gen: Any, batching: bool) -> tuple[str, Any]:
    """(url, stop) of the server app on a thread, on the engine or on the single model worker."""
    from snakellm.serve.app import Served, create_app
    from snakellm.serve.chat import load_template
    from snakellm.serve.engine.serving import BatchingWorker
    from snakellm.serve.server import bind, make_server
    from snakellm.serve.settings import ServeSettings
    from snakellm.serve.worker import ModelWorker

    s = ServeSettings(port=0, quiet=True)
    worker = BatchingWorker(gen) if batching else ModelWorker(gen)
    app = create_app(Served(worker, s, "tiny", load_template(None, {}, None, gen.tok)))
    sock = bind(s.host, 0)
    server = make_server(app, s)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            break
        except OSError:
            time.sleep(0.1)

    def stop() -> None:
        server.should_exit = True
        t.join(timeout=30)
        sock.close()
        worker.close()

    return url, stop


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def measure(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[float, float, list[str]]:
    """(sequential requests/s, parallel requests/s, the parallel answers' texts)."""
    complete(url, prompts[0], max_tokens)  # warm-up
    t0 = time.perf_counter()
    seq = [complete(url, p, max_tokens)["choices"][0]["text"] for p in prompts]
    t_seq = time.perf_counter() - t0
    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        par = [r["choices"][0]["text"] for r in pool.map(lambda p: complete(url, p, max_tokens), prompts)]
        t_par = time.perf_counter() - t0
    assert par == seq, "parallel clients got other answers than sequential ones"
    return len(prompts) / t_seq, len(prompts) / t_par, par


def clients(url: str, a: argparse.Namespace) -> tuple[float, float]:
    """``measure`` in a process of its own, as users' clients are: the server keeps its GIL to itself."""
    import subprocess

    cmd = [sys.executable, __file__, "--client-of", url, "--requests", str(a.requests), "--clients", str(a.clients)]
    out = subprocess.run([*cmd, "--max-tokens", str(a.max_tokens)], capture_output=True, text=True, check=True)
    seq, par = json.loads(out.stdout.strip().splitlines()[-1])
    return seq, par


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", default=None)
    p.add_argument("--client-of", default=None, help=argparse.SUPPRESS)  # the client process (internal)
    p.add_argument("--smoke", action="store_true", help="seconds: 4 requests from 2 clients, 4 tokens; no bar")
    a = p.parse_args()
    if a.smoke:
        a.requests, a.clients, a.max_tokens = 4, 2, 4
    words = "the of and to in is was for on that with as by at from his her an which".split()
    prompts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(3 + i % 9)) for i in range(a.requests)]
    if a.client_of:
        seq, par, _ = measure(a.client_of, prompts, a.clients, a.max_tokens)
        print(json.dumps([seq, par]))
        return 0
    import torch

    torch.set_num_threads(a.threads)
    gen = model(a.preset)
    out: dict[str, Any] = {"preset": a.preset, "requests": a.requests, "clients": a.clients, "max_tokens": a.max_tokens}
    for name, batching in (("engine", True), ("single_worker", False)):
        url, stop = serve(gen, batching)
        try:
            seq, par = clients(url, a)
        finally:
            stop()
        out[name] = {"sequential_rps": seq, "parallel_rps": par, "speedup": par / seq}
        print(
            f"{name:>13}: {a.requests} requests x {a.max_tokens} tokens: sequential {seq:.1f} req/s, "
            f"{a.clients} parallel clients {par:.1f} req/s = {par / seq:.2f}x",
            flush=True,
        )
    ok = out["engine"]["speedup"] >= 3
    print(f"bar: {a.clients} parallel clients >= 3x sequential on the engine: {'PASS' if ok else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0 if ok or a.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
