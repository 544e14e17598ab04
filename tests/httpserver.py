"""A real HTTP file server on 127.0.0.1 for the download tests, with fault injection.

It serves the files under ``root`` with what real shard hosts provide (Range
requests answered with 206 + Content-Range, a strong ETag, Last-Modified,
If-Range) and records every request, so tests assert on what actually went over
the socket: how many requests a path got, which Range they asked for.

Faults are queued per URL path and consumed one per request, in order; once
the queue is empty a path can fail forever (``fail_always``). A fault is a dict:

* ``{"status": 429, "headers": {"Retry-After": "1"}}``: that status, empty body;
* ``{"drop_after": 1000}``: announce the full length, send 1000 body bytes, then
  close the connection (a dropped / truncated transfer);
* ``{"stall_after": 1000, "stall_s": 2}``: send 1000 bytes then go silent (a
  read timeout on the client);
* ``{"ignore_range": True}``: answer a Range request with 200 and the whole file;
* ``{"reset": True}``: close the connection without any response;
* ``{"page": b"<html>...", "content_type": "text/html"}``: answer 200 with that body
  instead of the file (an error page behind a 200);
* ``{"trickle_bps": 100}``: send the body at about that many bytes per second.
"""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Seen:
    """One request as the server saw it."""

    path: str
    range: str | None
    if_range: str | None
    status: int
    body_bytes: int  # body bytes actually written to the socket
    time: float


class ShardServer:
    """``with ShardServer(root) as srv: srv.url("chunk1/x.jsonl.zst")``."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.requests: list[Seen] = []
        self._faults: dict[str, list[dict]] = {}
        self._always: dict[str, dict] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                server._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        # dropped connections are the point of some faults: no tracebacks for them
        self._httpd.handle_error = lambda request, client_address: None
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    # -------------------------------------------------------------- test API

    def __enter__(self) -> ShardServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def url(self, rel: str) -> str:
        return f"http://127.0.0.1:{self.port}/{rel.lstrip('/')}"

    def inject(self, rel: str, *faults: dict) -> None:
        """Queue faults for the next requests of ``rel`` (one fault per request)."""
        with self._lock:
            self._faults.setdefault("/" + rel.lstrip("/"), []).extend(faults)

    def fail_always(self, rel: str, fault: dict | None) -> None:
        """Every request of ``rel`` gets ``fault`` (None: back to normal)."""
        with self._lock:
            key = "/" + rel.lstrip("/")
            if fault is None:
                self._always.pop(key, None)
            else:
                self._always[key] = fault

    def seen(self, rel: str | None = None) -> list[Seen]:
        with self._lock:
            if rel is None:
                return list(self.requests)
            key = "/" + rel.lstrip("/")
            return [r for r in self.requests if r.path == key]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    @staticmethod
    def etag(data: bytes) -> str:
        return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'

    # -------------------------------------------------------------- serving

    def _next_fault(self, path: str) -> dict | None:
        with self._lock:
            queue = self._faults.get(path)
            if queue:
                return queue.pop(0)
            return self._always.get(path)

    def _record(self, h: BaseHTTPRequestHandler, path: str, status: int, sent: int) -> None:
        with self._lock:
            self.requests.append(
                Seen(path, h.headers.get("Range"), h.headers.get("If-Range"), status, sent, time.monotonic())
            )

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        fault = self._next_fault(path) or {}
        if fault.get("reset"):
            self._record(h, path, 0, 0)
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if "status" in fault:
            status = fault["status"]
            self._record(h, path, status, 0)
            h.send_response(status)
            for k, v in fault.get("headers", {}).items():
                h.send_header(k, v)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if "page" in fault:
            self._record(h, path, 200, len(fault["page"]))
            h.send_response(200)
            h.send_header("Content-Type", fault.get("content_type", "text/html; charset=utf-8"))
            h.send_header("Content-Length", str(len(fault["page"])))
            h.end_headers()
            h.wfile.write(fault["page"])
            return
        file = (self.root / path.lstrip("/")).resolve()
        if not file.is_file() or self.root.resolve() not in file.parents:
            self._record(h, path, 404, 0)
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        data = file.read_bytes()
        etag = self.etag(data)
        start, end, status = 0, len(data) - 1, 200
        rng = h.headers.get("Range")
        if_range = h.headers.get("If-Range")
        if rng and not fault.get("ignore_range") and (if_range is None or if_range == etag):
            m = _RANGE.match(rng)
            if m:
                start = int(m.group(1))
                end = min(int(m.group(2)), len(data) - 1) if m.group(2) else len(data) - 1
                if start >= len(data):
                    self._record(h, path, 416, 0)
                    h.send_response(416)
                    h.send_header("Content-Range", f"bytes */{len(data)}")
                    h.send_header("Content-Length", "0")
                    h.end_headers()
                    return
                status = 206
        body = data[start : end + 1]
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("ETag", etag)
        h.send_header("Last-Modified", email.utils.formatdate(file.stat().st_mtime, usegmt=True))
        h.send_header("Accept-Ranges", "bytes")
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.end_headers()
        if "trickle_bps" in fault:
            step = max(1, int(fault["trickle_bps"] // 10))
            sent = 0
            try:
                while sent < len(body):
                    h.wfile.write(body[sent : sent + step])
                    h.wfile.flush()
                    sent += step
                    time.sleep(0.1)
            except OSError:  # the client gave up
                pass
            self._record(h, path, status, min(sent, len(body)))
            h.close_connection = True
            return
        cut = fault.get("drop_after", fault.get("stall_after"))
        if cut is None:
            h.wfile.write(body)
            self._record(h, path, status, len(body))
            return
        h.wfile.write(body[:cut])
        h.wfile.flush()
        self._record(h, path, status, min(cut, len(body)))
        if "stall_after" in fault:
            time.sleep(fault.get("stall_s", 2.0))
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)
