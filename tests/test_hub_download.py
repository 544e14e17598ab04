"""The Hugging Face Hub's parquet over http: the resolve URL layout at a pinned revision, its redirect to the
storage host, a 429 and a 401, and HF_TOKEN sent as a bearer header to the Hub's own host only.

A real HTTP server on 127.0.0.1 plays both hosts: ``127.0.0.1`` is the Hub (``/datasets/{org}/{name}/resolve/
{sha}/{path}``, which checks the token and redirects), ``localhost`` the storage host (``/cas/...``) the redirect
leads to; every request is recorded with its Host and Authorization headers.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snakellm.data.chunk import build_chunk
from snakellm.data.download import DownloadError, Options, download_chunk
from snakellm.data.planning import list_http_shards

SHA = "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9"
TOKEN = "hf_testsecret_0123456789"


class Hub:
    def __init__(self, root: Path, need_token: bool = True) -> None:
        self.root, self.need_token = root, need_token
        self.seen: list[tuple[str, str, str | None]] = []  # (host, path, authorization)
        self.throttle: set[str] = set()  # paths answered with one 429 first
        hub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                hub.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def template(self, repo: str, pattern: str) -> str:
        return f"http://127.0.0.1:{self.port}/datasets/{repo}/resolve/{SHA}/{pattern}"

    def _send(self, h, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def handle(self, h) -> None:
        host = h.headers.get("Host", "").split(":")[0]
        auth = h.headers.get("Authorization")
        self.seen.append((host, h.path, auth))
        if host == "127.0.0.1" and "/resolve/" in h.path:
            if self.need_token and auth != f"Bearer {TOKEN}":
                return self._send(h, 401, b'{"error":"Invalid credentials"}')
            if h.path in self.throttle:
                self.throttle.discard(h.path)
                return self._send(h, 429, headers={"Retry-After": "0"})
            rel = h.path.split(f"/resolve/{SHA}/", 1)[1]
            # the Hub redirects to its storage host with a signed URL
            loc = f"http://localhost:{self.port}/cas/{rel}?X-Amz-Signature=abc"
            return self._send(h, 302, headers={"Location": loc})
        if host == "localhost" and h.path.startswith("/cas/"):
            f = self.root / h.path[len("/cas/") :].split("?", 1)[0]
            return self._send(h, 200, f.read_bytes(), {"Content-Type": "application/octet-stream"})
        self._send(h, 404)


def _files(root: Path) -> list[Path]:
    out = []
    for i in range(3):
        p = root / "sample" / "10BT" / f"{i:03d}_00000.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        tbl = pa.table({"text": [f"doc {i}-{j} ü" for j in range(20)], "id": [f"<urn:{i}-{j}>" for j in range(20)]})
        pq.write_table(tbl, p, row_group_size=7)
        out.append(p)
    return out


def test_hub_layout_redirect_429_and_token_only_to_the_hub(tmp_path, monkeypatch):
    files = _files(tmp_path / "repo")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with Hub(tmp_path / "repo") as hub:
        urls = list_http_shards(
            {"url": hub.template("HuggingFaceFW/fineweb-edu", "sample/10BT/{000..002}_00000.parquet")}
        )
        hub.throttle.add(urls[1].split(str(hub.port), 1)[1])
        opts = Options(backoff=0.01, max_backoff=0.05, format="parquet", token_env="HF_TOKEN")
        man = download_chunk(urls, tmp_path / "raw", tmp_path / "m.manifest.json", opts=opts, show_progress=False)
        # the token went to the Hub's own host, never to the storage host the redirect led to
        assert {a for h, _, a in hub.seen if h == "127.0.0.1"} == {f"Bearer {TOKEN}"}
        assert [a for h, _, a in hub.seen if h == "localhost"] == [None, None, None]
        assert len([1 for h, _, _ in hub.seen if h == "127.0.0.1"]) == 4  # three files, one of them throttled once
    text = (tmp_path / "m.manifest.json").read_text()
    assert TOKEN not in text and len(man["shards"]) == 3
    for p in (tmp_path / "raw").rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes()
    # the downloaded shards are the same bytes, and chunk as local parquet does
    got = sorted((tmp_path / "raw").rglob("*.parquet"))
    assert [g.read_bytes() for g in got] == [f.read_bytes() for f in files]
    st = build_chunk([str(g) for g in got], str(tmp_path / "c.jsonl"), fmt="parquet", show_progress=False)
    assert st["documents"] == 60


def test_a_429_is_retried_and_a_401_names_the_variable_not_the_token(tmp_path, monkeypatch):
    _files(tmp_path / "repo")
    with Hub(tmp_path / "repo") as hub:
        url = hub.template("o/d", "sample/10BT/000_00000.parquet")
        path = url.split(str(hub.port), 1)[1]
        hub.throttle.add(path)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        opts = Options(backoff=0.01, max_backoff=0.05, format="parquet", token_env="HF_TOKEN")
        download_chunk([url], tmp_path / "raw", tmp_path / "m.manifest.json", opts=opts, show_progress=False)
        assert [p for h, p, _ in hub.seen if h == "127.0.0.1"] == [path, path]  # the 429, then the redirect
        # no token: a 401 that says none was sent
        monkeypatch.delenv("HF_TOKEN")
        with pytest.raises(DownloadError, match=r"HTTP 401 .*no token was sent: \$HF_TOKEN is not set"):
            download_chunk([url], tmp_path / "raw2", tmp_path / "m2.manifest.json", opts=opts, show_progress=False)
        # a wrong token: the message names the variable, never the value
        monkeypatch.setenv("HF_TOKEN", "hf_wrong_" + TOKEN)
        with pytest.raises(DownloadError) as e:
            download_chunk([url], tmp_path / "raw3", tmp_path / "m3.manifest.json", opts=opts, show_progress=False)
        assert "the bearer token from $HF_TOKEN was sent" in str(e.value) and TOKEN not in str(e.value)
    assert not (tmp_path / "m2.manifest.json").exists()
    assert TOKEN not in json.dumps(sorted(str(p) for p in tmp_path.rglob("*")))
