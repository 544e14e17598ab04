"""``snakellm serve`` against bad HTTP: every kind of bad input gets its 4xx (or a 500 for a failing
chat template) in OpenAI's error shape and the server answers the next request; stalled connections
are closed by the idle timeout; a bounded soak of parallel clients leaves threads and memory flat."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
from hf_helpers import random_checkpoint, tokenizer_block
from serve_helpers import ServerProcess

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
IDLE = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("serve-http")
    run = tmp / "run"
    random_checkpoint(run, {}, tokenizer_block("gpt2-bpe"), seed=3)
    # a template that fails while rendering a message whose content is not a number: a bug -> 500
    (tmp / "failing.jinja").write_text("{{ (messages[0]['content'] | int) // 0 }}")
    s = ServerProcess(
        run,
        "--quiet",
        "--api-key",
        KEY,
        "--idle-timeout",
        str(IDLE),
        "--request-timeout",
        "15",
        "--max-body-bytes",
        "4096",
        "--max-prompts",
        "8",
        "--chat-template",
        str(tmp / "failing.jinja"),
        cwd=tmp,
        # two malloc arenas: glibc's default (8 per core) let the soak's RSS swing by +-25 MB between rounds on a
        # loaded 2-core machine (58 MB once in CI) with no leak; with 2 it stays within 1 MB, so a leak shows.
        # A fixed mmap threshold: glibc raises its threshold after each large free (up to 32 MB), after which
        # tensors of a batched round come from the heap and stay in the RSS (+56 MB at one round, +43 MB at
        # the end, once in CI with 2 arenas); fixed at 1 MiB, every larger buffer is unmapped when freed
        env={"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1048576"},
    )
    yield s
    s.stop()


GOOD = json.dumps({"model": "run", "prompt": "Hello", "max_tokens": 2, "temperature": 0})


def _conn(s: ServerProcess) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)


def _req(c: http.client.HTTPConnection, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
    c.request(method, path, body=body, headers=AUTH if headers is None else headers)
    r = c.getresponse()
    raw = r.read()
    return r.status, dict(r.getheaders()), json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}


def _good(c: http.client.HTTPConnection) -> str:
    code, _, body = _req(c, "POST", "/v1/completions", GOOD)
    assert code == 200, body
    return body["choices"][0]["text"]


def _raw(s: ServerProcess, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while True:
            part = sock.recv(65536)
            if not part:
                return out
            out += part
            if b"\r\n\r\n" in out and b"connection: close" not in out.lower() and b"content-length" in out.lower():
                head, _, rest = out.partition(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(rest) >= n:
                    return out


@pytest.mark.parametrize(
    "method,path,body,headers,status,param",
    [
        ("DELETE", "/v1/completions", None, None, 405, None),
        ("PATCH", "/generate", None, None, 405, None),
        ("GET", "/v1/chat/completions", None, None, 405, None),
        ("POST", "/v1/nothing", "{}", None, 404, None),
        ("GET", "/v1/models/other", None, None, 404, "model"),
        ("POST", "/v1/completions", GOOD, {"Content-Type": "application/json"}, 401, None),
        ("POST", "/v1/completions", GOOD, {"Authorization": "Bearer wrong"}, 401, None),
        ("PUT", "/generate", '{"sentences": ["x"]}', {"Authorization": "Basic eDp5"}, 401, None),
        ("POST", "/v1/completions", "{not json", None, 400, None),
        ("POST", "/v1/completions", "", None, 400, None),
        ("POST", "/v1/completions", "[1, 2]", None, 422, None),
        ("POST", "/v1/completions", '"a string"', None, 422, None),
        ("POST", "/v1/completions", json.dumps({"prompt": "x" * 5000}), None, 413, None),
        ("POST", "/v1/completions", json.dumps({"prompt": ["a"] * 3, "n": 3}), None, 413, "n"),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "stream": "yes"}), None, 400, "stream"),
        (
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}),
            None,
            400,
            "stream_options",
        ),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "top_k": 1.5}), None, 400, "top_k"),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "seed": "1"}), None, 400, "seed"),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "stop": ["a"] * 17}), None, 400, "stop"),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "n": 0}), None, 400, "n"),
        ("POST", "/v1/chat/completions", json.dumps({"messages": []}), None, 400, "messages"),
        (
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user"}]}),
            None,
            400,
            "messages[0].content",
        ),
        (
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            None,
            400,
            "messages[0].content",
        ),
        (
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            None,
            400,
            "top_logprobs",
        ),
        (
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "x"}], "echo": True}),
            None,
            400,
            "echo",
        ),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}), None, 500, None),
    ],
)
def test_bad_input_gets_its_status_and_the_next_request_is_served(served, method, path, body, headers, status, param):
    c = _conn(served)
    try:
        code, hdrs, r = _req(c, method, path, body, headers)
        assert code == status, r
        err = r["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param
        if status == 405:
            assert "allow" in {k.lower() for k in hdrs}
        if status == 401:
            assert err["type"] == "authentication_error"
        if status == 500:
            assert "ZeroDivisionError" in err["message"]
        _good(c)  # the same kept-alive connection goes on
    finally:
        c.close()


def test_malformed_http_and_bodies(served):
    # a Content-Length that is not a number: uvicorn answers 400 and closes; the server goes on
    out = _raw(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
    assert out.startswith(b"HTTP/1.1 400")
    # a chunked body is read whole
    c = _conn(served)
    c.putrequest("POST", "/v1/completions")
    for k, v in AUTH.items():
        c.putheader(k, v)
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    half = len(GOOD) // 2
    for part in (GOOD[:half], GOOD[half:]):
        c.send(f"{len(part):x}\r\n{part}\r\n".encode())
    c.send(b"0\r\n\r\n")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == _good(c)
    c.close()
    # a chunked body over the limit: 413 without reading the rest
    big = b"x" * 3000
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    head += b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    out = _raw(served, head + (b"%x\r\n" % len(big) + big + b"\r\n") * 2 + b"0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413")
    # a body that never completes: 408 after the request timeout (15 s)
    t0 = time.time()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    out = _raw(served, head + b'\r\nContent-Length: 100\r\n\r\n{"prompt": ')
    assert out.startswith(b"HTTP/1.1 408") and 14 < time.time() - t0 < 60
    # /health needs no key
    c = _conn(served)
    assert _req(c, "GET", "/health", headers={})[0] == 200
    _good(c)
    c.close()


def test_stalled_connections_are_closed_by_the_idle_timeout(served):
    socks = []
    try:
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", served.port), timeout=30)
            if i % 2:  # half send an unfinished request head, half nothing at all
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        t0 = time.time()
        # a stalled connection does not hold the server: a request on a new one is answered at once
        c = _conn(served)
        _good(c)
        c.close()
        closed_at = []
        for s in socks:
            s.settimeout(max(0.1, t0 + IDLE + 15 - time.time()))
            assert s.recv(1024) == b""  # closed by the server (a timeout here raises)
            closed_at.append(time.time() - t0)
        assert max(closed_at) < IDLE + 15
    finally:
        for s in socks:
            s.close()
    c = _conn(served)
    _good(c)
    c.close()


def test_soak_of_parallel_clients_leaves_threads_and_memory_flat(served):
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process(served.proc.pid)
    bodies = [
        ("POST", "/v1/completions", GOOD),
        ("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 3, "stream": True})),
        ("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 2})),
        ("PUT", "/generate", json.dumps({"sentences": ["Hi", "there"], "tokens_to_generate": 3})),
        ("POST", "/v1/completions", "{bad json"),
        ("POST", "/v1/completions", json.dumps({"prompt": "x", "logit_bias": {"1": 1}})),
    ]

    def round_of(n_threads: int, per_thread: int) -> list:
        errors: list = []

        def worker(k: int) -> None:
            c = _conn(served)
            try:
                for i in range(per_thread):
                    method, path, body = bodies[(k + i) % len(bodies)]
                    code, _, _ = _req(c, method, path, body)
                    if code not in (200, 400):
                        errors.append(code)
            except Exception as e:
                errors.append(e)
            finally:
                c.close()

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
        return errors

    assert round_of(8, 6) == []  # warm up: every shape once
    # and two full rounds: the allocator settles there
    # (a few MB over the first rounds, flat after)
    assert round_of(8, 12) == [] and round_of(8, 12) == []
    time.sleep(0.5)
    threads0, rss0 = proc.num_threads(), proc.memory_info().rss
    t0 = time.time()
    rounds = 0
    series = [rss0]
    while rounds < 6 and time.time() - t0 < 60:
        assert round_of(8, 12) == []
        rounds += 1
        series.append(proc.memory_info().rss)
    time.sleep(0.5)
    threads1, rss1 = proc.num_threads(), proc.memory_info().rss
    assert rounds >= 2
    assert threads1 == threads0, (threads0, threads1)
    growth_mb = [round((x - rss0) / 2**20, 1) for x in series]
    assert rss1 - rss0 < 24 * 2**20, growth_mb  # measured: within 1 MB, quiet or with three CPU hogs beside it
