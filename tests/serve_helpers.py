"""``snakellm serve`` as a real process on 127.0.0.1 for the server tests (a free port, its log kept)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import env_with_venv


class ServerProcess:
    """A started ``snakellm serve``; ``log`` collects its stderr lines while it runs."""

    def __init__(self, run: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "snakellm.cli", "serve", str(run), "--port", "0", "--threads", "1", *args]
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, text=True, env={**env_with_venv(), **(env or {})}, cwd=cwd
        )
        self.log: list[str] = []
        self.url = ""
        deadline = time.time() + 240
        assert self.proc.stderr is not None
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                break
        if not self.url:
            self.proc.kill()
            raise AssertionError("server did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def call(url: str, path: str, body, method: str = "PUT", headers: dict | None = None) -> tuple[int, object]:
    """One request with urllib: (status, parsed JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reference_greedy(gen, prompt: list[int], n: int, *, rep=1.0, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """Greedy tokens under vLLM's penalties, computed the slow way: a full forward over the whole sequence
    at every step, then bias, repetition (prompt + generated), frequency and presence (generated only)
    applied token by token in plain Python (the reference the engine's tensor ops are held to)."""
    import torch

    dec = gen.decoder
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        t = torch.tensor([ids], dtype=torch.long)
        m = t.shape[1]
        with torch.inference_mode():
            row = dec.forward(t, torch.arange(m)[None], dec.new_cache(1, m), 0, torch.ones(1, m, dtype=torch.bool))
        logits = [float(x) for x in row[0, -1].tolist()]
        for tok, b in (bias or {}).items():
            logits[tok] += b
        seen = set(ids)
        counts: dict[int, int] = {}
        for tok in out:
            counts[tok] = counts.get(tok, 0) + 1
        for tok in range(len(logits)):
            x = logits[tok]
            if rep != 1.0 and tok in seen:
                x = x / rep if x > 0 else x * rep
            if tok in counts:
                x -= frequency * counts[tok] + presence
            logits[tok] = x
        nxt = max(range(len(logits)), key=logits.__getitem__)
        out.append(nxt)
        ids.append(nxt)
    return out
