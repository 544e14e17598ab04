"""``snakellm download`` against a real HTTP server on 127.0.0.1 that injects faults.

The server (tests/httpserver.py) serves real shards of the shipped corpus with
Range/If-Range support and records every request, so each test asserts on what
went over the socket (how many requests, which Range) and on the bytes and
sha256 that ended up on disk and in the manifest.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from httpserver import ShardServer

from snakellm.data import download
from snakellm.data.chunk import _read_manifest
from snakellm.data.planning import url_to_relpath
from snakellm.steps import chunk as chunk_step
from snakellm.steps import download as download_step

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "resources" / "corpus" / "wikitext"
SHARDS = [f"chunk1/example_train_{i}.jsonl.zst" for i in range(6)]
# tiny delays: the policy is the same, the test just does not wait for it
FAST = ["--backoff", "0.01", "--max-backoff", "0.05", "--timeout", "5", "--no-progress", "--concurrency", "4"]


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def srv(tmp_path):
    """A server over a private copy of the corpus (tests change files on it)."""
    root = tmp_path / "www"
    shutil.copytree(CORPUS, root)
    with ShardServer(root) as s:
        yield s


class Run:
    def __init__(self, tmp: Path, srv: ShardServer, capsys) -> None:
        self.tmp, self.srv, self.capsys = tmp, srv, capsys
        self.dest = tmp / "data" / "raw" / "web" / "shards"
        self.manifest = tmp / "data" / "raw" / "web" / "chunk-00000.manifest.json"

    def __call__(self, rels: list[str], *extra: str) -> tuple[int, str]:
        argv = ["--dest", str(self.dest), "--manifest", str(self.manifest), "--source", "web", "--chunk", "chunk-00000"]
        rc = download_step.main(argv + FAST + list(extra) + [self.srv.url(r) for r in rels])
        return rc, self.capsys.readouterr().err

    def local(self, rel: str) -> Path:
        return self.dest / url_to_relpath(self.srv.url(rel))

    def served(self, rel: str) -> bytes:
        return (self.srv.root / rel).read_bytes()

    def assert_complete(self, rels: list[str]) -> dict:
        """The manifest lists every shard with the server's exact bytes, size and sha256."""
        man = json.loads(self.manifest.read_text())
        assert [s["url"] for s in man["shards"]] == [self.srv.url(r) for r in rels]
        for rel, entry, (path, exp) in zip(rels, man["shards"], _read_manifest(str(self.manifest))):
            want = self.served(rel)
            assert Path(path) == self.local(rel)
            assert (exp.size, exp.sha256, exp.url) == (len(want), sha256(want), self.srv.url(rel))
            assert Path(path).read_bytes() == want
            assert entry["size"] == len(want)
            assert entry["sha256"] == sha256(want)
        assert man["size"] == sum(len(self.served(r)) for r in rels)
        assert not list(self.dest.rglob("*.part")), "a .part file survived a successful download"
        return man


@pytest.fixture
def run(tmp_path, srv, capsys) -> Run:
    return Run(tmp_path, srv, capsys)


def test_downloads_every_shard_with_manifest_and_checksums(run, srv):
    rc, err = run(SHARDS)
    assert rc == 0, err
    run.assert_complete(SHARDS)
    assert len(srv.seen()) == len(SHARDS)
    assert all(r.range is None and r.status == 200 for r in srv.seen())
    # the manifest is what `snakellm chunk --manifest` reads: paths relative to its directory
    man = json.loads(run.manifest.read_text())
    assert all(not Path(s["path"]).is_absolute() and s["path"].startswith("shards/") for s in man["shards"])
    assert (man["source"], man["chunk"]) == ("web", "chunk-00000")


def test_snakellm_chunk_reads_the_manifest(run, srv, tmp_path):
    # the contract with the chunk step: the manifest stands for its shards, in order
    assert run(SHARDS)[0] == 0
    out = tmp_path / "c.jsonl"
    assert chunk_step.main([str(run.manifest), "-o", str(out), "--format", "jsonl.zst", "--no-progress"]) == 0
    stats = json.loads(out.with_name("c.stats.json").read_text())
    assert [Path(s["shard"]) for s in stats["per_shard"]] == [run.local(r) for r in SHARDS]
    assert stats["documents"] > 0 and stats["rejected"] == 0
    assert [s["sha256"] for s in stats["per_shard"]] == [sha256(run.served(r)) for r in SHARDS]


def test_snakellm_chunk_checks_shards_against_the_manifest(run, srv, tmp_path, capsys):
    assert run(SHARDS)[0] == 0
    out = tmp_path / "c.jsonl"
    args = ["--manifest", str(run.manifest), "-o", str(out), "--format", "jsonl.zst", "--no-progress"]
    # same size, one flipped bit: named with its URL and both hashes, removed so that the next run fetches it
    bad = run.local(SHARDS[1])
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 1
    bad.write_bytes(bytes(raw))
    assert chunk_step.main(args) == 1
    err = capsys.readouterr().err
    assert f"shard {bad} ({srv.url(SHARDS[1])}) has sha256 {sha256(bytes(raw))}" in err
    assert f"the manifest recorded {sha256(run.served(SHARDS[1]))}" in err and "the next run downloads it again" in err
    assert not bad.exists() and not out.exists()
    # gone: the message says so (the workflow downloads it again at its next start)
    assert chunk_step.main(args) == 1
    assert f"shard {bad} ({srv.url(SHARDS[1])}) listed in the manifest is missing" in capsys.readouterr().err
    # cut short: the size is wrong
    assert run(SHARDS)[0] == 0
    bad.write_bytes(run.served(SHARDS[1])[:-10])
    assert chunk_step.main(args) == 1
    assert (
        f"is {len(run.served(SHARDS[1])) - 10} bytes, the manifest recorded {len(run.served(SHARDS[1]))}"
        in capsys.readouterr().err
    )


def test_complete_shards_are_never_fetched_again(run, srv):
    assert run(SHARDS)[0] == 0
    first = run.manifest.read_bytes()
    srv.clear()
    rc, err = run(SHARDS)
    assert rc == 0, err
    assert srv.seen() == [], "a complete shard was requested again"
    assert run.manifest.read_bytes() == first  # byte-stable manifest
    assert "6 shards already complete" in err

    # one shard gone: only it is fetched; one sidecar gone: hash recomputed locally, no request
    run.local(SHARDS[2]).unlink()
    Path(str(run.local(SHARDS[4])) + ".meta.json").unlink()
    srv.clear()
    assert run(SHARDS)[0] == 0
    assert [r.path for r in srv.seen()] == ["/" + SHARDS[2]]
    run.assert_complete(SHARDS)
    assert run.manifest.read_bytes() == first


def test_429_waits_for_retry_after_seconds(run, srv):
    srv.inject(SHARDS[0], {"status": 429, "headers": {"Retry-After": "1"}})
    rc, err = run(SHARDS[:2], "--max-backoff", "5")
    assert rc == 0, err
    first, second = srv.seen(SHARDS[0])
    assert (first.status, second.status) == (429, 200)
    assert second.time - first.time >= 0.95, "Retry-After: 1 was not honoured"
    assert "HTTP 429" in err and "Retry-After 1s" in err
    run.assert_complete(SHARDS[:2])


def test_429_retry_after_http_date_is_capped_by_max_backoff(run, srv):
    later = email.utils.formatdate(time.time() + 120, usegmt=True)
    srv.inject(SHARDS[0], {"status": 429, "headers": {"Retry-After": later}})
    rc, err = run(SHARDS[:1], "--max-backoff", "0.3")
    assert rc == 0, err
    first, second = srv.seen(SHARDS[0])
    assert 0.28 <= second.time - first.time < 5, "HTTP-date Retry-After not parsed or not capped"
    run.assert_complete(SHARDS[:1])


def test_5xx_and_dropped_connections_are_retried(run, srv):
    srv.inject(SHARDS[0], {"status": 503}, {"status": 500}, {"status": 502})
    srv.inject(SHARDS[1], {"reset": True}, {"status": 408})
    rc, err = run(SHARDS)
    assert rc == 0, err
    assert [r.status for r in srv.seen(SHARDS[0])] == [503, 500, 502, 200]
    assert [r.status for r in srv.seen(SHARDS[1])] == [0, 408, 200]
    run.assert_complete(SHARDS)


def test_connection_closed_mid_body_resumes_with_range(run, srv):
    size = len(run.served(SHARDS[3]))
    half = size // 2
    srv.inject(SHARDS[3], {"drop_after": half})
    rc, err = run(SHARDS)
    assert rc == 0, err
    first, second = srv.seen(SHARDS[3])
    assert (first.status, first.range, first.body_bytes) == (200, None, half)
    # the retry continues the part: asks only for the rest, guarded by the ETag
    assert second.range == f"bytes={half}-"
    assert second.if_range == ShardServer.etag(run.served(SHARDS[3]))
    assert (second.status, second.body_bytes) == (206, size - half)
    assert f"connection closed after {half} of {size} bytes" in err
    run.assert_complete(SHARDS)  # bytes and sha256 of the resumed file are right


def test_read_timeout_mid_body_resumes_with_range(run, srv):
    srv.inject(SHARDS[0], {"stall_after": 5000, "stall_s": 3})
    rc, err = run(SHARDS[:1], "--timeout", "0.3")
    assert rc == 0, err
    first, second = srv.seen(SHARDS[0])
    assert first.body_bytes == 5000
    assert (second.range, second.status) == ("bytes=5000-", 206)
    assert "timed out" in err
    run.assert_complete(SHARDS[:1])


def test_resume_follows_redirects_with_the_range(run, srv):
    # mirrors and CDNs redirect; the Range must survive the redirect
    srv.inject(SHARDS[0], {"drop_after": 5000}, {"status": 302, "headers": {"Location": "/mirror/" + SHARDS[0]}})
    (srv.root / "mirror" / "chunk1").mkdir(parents=True)
    shutil.copy(srv.root / SHARDS[0], srv.root / "mirror" / SHARDS[0])
    rc, err = run(SHARDS[:1])
    assert rc == 0, err
    assert [(r.range, r.status) for r in srv.seen(SHARDS[0])] == [(None, 200), ("bytes=5000-", 302)]
    assert [(r.range, r.status) for r in srv.seen("mirror/" + SHARDS[0])] == [("bytes=5000-", 206)]
    run.assert_complete(SHARDS[:1])  # stored under the original URL's path


def test_200_answer_to_a_range_request_restarts_from_zero(run, srv):
    srv.inject(SHARDS[0], {"drop_after": 7000}, {"ignore_range": True})
    rc, err = run(SHARDS[:1])
    assert rc == 0, err
    first, second = srv.seen(SHARDS[0])
    assert second.range == "bytes=7000-" and second.status == 200
    run.assert_complete(SHARDS[:1])  # the whole body once, not the head twice


def test_retries_count_only_failures_without_new_bytes(run, srv):
    # every response drops after 6000 bytes: each retry makes progress, so even
    # --retries 1 gets a 26 kB shard through, one Range request at a time
    size = len(run.served(SHARDS[0]))
    srv.fail_always(SHARDS[0], {"drop_after": 6000})
    rc, err = run(SHARDS[:1], "--retries", "1")
    assert rc == 0, err
    seen = srv.seen(SHARDS[0])
    assert [r.range for r in seen] == [None] + [f"bytes={k}-" for k in range(6000, size, 6000)]
    run.assert_complete(SHARDS[:1])


def test_failed_run_keeps_the_part_and_the_next_run_resumes_it(run, srv):
    size = len(run.served(SHARDS[5]))
    srv.inject(SHARDS[5], {"drop_after": 6000})
    srv.fail_always(SHARDS[5], {"status": 503})
    rc, err = run(SHARDS, "--retries", "2")
    assert rc == 1
    assert f"{srv.url(SHARDS[5])}: gave up after 3 attempts" in err
    assert "last error: HTTP 503" in err and "6000 bytes kept in" in err
    assert [r.status for r in srv.seen(SHARDS[5])] == [200, 503, 503]  # 1 try + 2 retries without new bytes
    assert not run.manifest.exists()
    part = Path(str(run.local(SHARDS[5])) + ".part")
    assert part.stat().st_size == 6000
    assert all(run.local(r).read_bytes() == run.served(r) for r in SHARDS[:5])

    srv.fail_always(SHARDS[5], None)
    srv.clear()
    rc, err = run(SHARDS)
    assert rc == 0, err
    # next process: only the missing tail of the failed shard, hashed together with the kept head
    (only,) = srv.seen()
    assert (only.path, only.range, only.status, only.body_bytes) == ("/" + SHARDS[5], "bytes=6000-", 206, size - 6000)
    run.assert_complete(SHARDS)


def test_killed_process_leaves_no_final_file_and_the_next_run_resumes(run, srv):
    # SIGKILL mid-body (a preempted Slurm job, an OOM kill): nothing may look complete
    srv.inject(SHARDS[1], {"stall_after": 3000, "stall_s": 10})
    argv = [
        str(Path(sys.executable).parent / "snakellm"),
        "download",
        "--dest",
        str(run.dest),
        "--manifest",
        str(run.manifest),
        "--no-progress",
        *[srv.url(r) for r in SHARDS[:2]],
    ]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    part = Path(str(run.local(SHARDS[1])) + ".part")
    deadline = time.monotonic() + 20
    while not (part.exists() and part.stat().st_size == 3000 and run.local(SHARDS[0]).exists()):
        assert time.monotonic() < deadline and proc.poll() is None, "download did not reach the stall"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert not run.local(SHARDS[1]).exists() and not run.manifest.exists()
    srv.clear()
    rc, err = run(SHARDS[:2])
    assert rc == 0, err
    (only,) = srv.seen()
    assert (only.path, only.range, only.status) == ("/" + SHARDS[1], "bytes=3000-", 206)
    run.assert_complete(SHARDS[:2])


def test_part_of_a_file_that_changed_on_the_server_restarts(run, srv):
    srv.inject(SHARDS[0], {"drop_after": 4000})
    assert run(SHARDS[:1], "--retries", "0")[0] == 1
    # the server now has a different file under the same URL
    other = run.served(SHARDS[1])
    (srv.root / SHARDS[0]).write_bytes(other)
    srv.clear()
    rc, err = run(SHARDS[:1])
    assert rc == 0, err
    (only,) = srv.seen()
    assert only.range == "bytes=4000-" and only.status == 200  # If-Range did not match: whole new file
    assert run.local(SHARDS[0]).read_bytes() == other
    run.assert_complete(SHARDS[:1])


def test_416_for_a_part_that_is_already_whole_restarts(run, srv):
    data = run.served(SHARDS[0])
    final = run.local(SHARDS[0])
    final.parent.mkdir(parents=True)
    Path(str(final) + ".part").write_bytes(data)
    Path(str(final) + ".meta.json").write_text(
        json.dumps({"url": srv.url(SHARDS[0]), "total": len(data), "validator": '"stale"'})
    )
    rc, err = run(SHARDS[:1])
    assert rc == 0, err
    # If-Range did not match, so a plain 200; a matching one would have given 416 then 200
    assert [r.status for r in srv.seen()] in ([200], [416, 200])
    run.assert_complete(SHARDS[:1])
    srv.clear()
    final.unlink()
    Path(str(final) + ".part").write_bytes(data)
    Path(str(final) + ".meta.json").write_text(
        json.dumps({"url": srv.url(SHARDS[0]), "total": len(data), "validator": ShardServer.etag(data)})
    )
    assert run(SHARDS[:1])[0] == 0
    assert [(r.range, r.status) for r in srv.seen()] == [(f"bytes={len(data)}-", 416), (None, 200)]
    run.assert_complete(SHARDS[:1])


def test_part_without_a_known_origin_is_not_resumed(run, srv):
    final = run.local(SHARDS[0])
    final.parent.mkdir(parents=True)
    Path(str(final) + ".part").write_bytes(b"junk from somewhere else")
    assert run(SHARDS[:1])[0] == 0
    assert [r.range for r in srv.seen()] == [None]
    run.assert_complete(SHARDS[:1])


def test_persistent_404_fails_fast_naming_the_url_and_keeps_the_rest(run, srv):
    missing = "chunk1/example_train_99.jsonl.zst"
    rels = SHARDS[:3] + [missing] + SHARDS[3:]
    rc, err = run(rels, "--retries", "8", "--backoff", "1")
    assert rc == 1
    assert f"{srv.url(missing)}: HTTP 404" in err
    assert "1 of 7 shards failed" in err
    assert len(srv.seen(missing)) == 1, "a 404 was retried"
    assert not run.manifest.exists()
    for r in SHARDS:
        assert run.local(r).read_bytes() == run.served(r)

    # the file appears on the server: the retry fetches it and nothing else
    shutil.copy(srv.root / SHARDS[0], srv.root / missing)
    srv.clear()
    rc, err = run(rels)
    assert rc == 0, err
    assert [r.path for r in srv.seen()] == ["/" + missing]
    run.assert_complete(rels)


def test_persistent_503_gives_up_with_url_and_last_status(run, srv):
    srv.fail_always(SHARDS[1], {"status": 503, "headers": {"Retry-After": "0"}})
    rc, err = run(SHARDS[:2], "--retries", "2")
    assert rc == 1
    assert f"{srv.url(SHARDS[1])}: gave up after 3 attempts" in err
    assert "last error: HTTP 503" in err
    assert len(srv.seen(SHARDS[1])) == 3
    assert run.local(SHARDS[0]).read_bytes() == run.served(SHARDS[0])


def test_unreachable_host_is_retried_then_reported(run, srv, tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    url = f"http://127.0.0.1:{port}/x.jsonl.zst"
    rc = download_step.main(
        ["--dest", str(tmp_path / "d"), "--manifest", str(tmp_path / "m.json"), *FAST, "--retries", "1", url]
    )
    err = run.capsys.readouterr().err
    assert rc == 1
    assert f"{url}: gave up after 2 attempts" in err and "refused" in err.lower()


def test_rejects_non_http_urls_and_duplicate_destinations(run, srv, tmp_path):
    rc, err = run([], "file:///etc/passwd")
    assert rc == 1 and "not an http(s) URL" in err
    rc, err = run([SHARDS[0], SHARDS[0]])
    assert rc == 1 and "would both be stored as" in err


def test_help_explains_the_step():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "snakellm"), "download", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for word in (
        "--concurrency",
        "--retries",
        "--backoff",
        "--max-backoff",
        "--timeout",
        "Retry-After",
        "Range",
        "sha256",
        "manifest",
    ):
        assert word in out


@pytest.mark.parametrize(
    "value, expected",
    [("7", 7.0), (" 2.5 ", 2.5), ("-3", 0.0), ("", None), (None, None), ("soon", None)],
)
def test_retry_after_seconds(value, expected):
    assert download.retry_after_seconds(value) == expected


def test_retry_after_http_date():
    now = time.time()
    assert download.retry_after_seconds(email.utils.formatdate(now + 30, usegmt=True), now=now) == pytest.approx(
        30, abs=1
    )
    assert download.retry_after_seconds(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0


def test_backoff_doubles_with_jitter_and_caps():
    o = download.Options(backoff=1.0, max_backoff=5.0)
    for failures, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (10, 5.0)]:
        d = download.backoff_delay(failures, o)
        assert base * 0.5 <= d <= base
    assert download.backoff_delay(1, o, retry_after=3.0) == 3.0
    assert download.backoff_delay(1, o, retry_after=3600.0) == 5.0


# ----------------------------------------------------------------- downloads that verify what they got

HTML = b"<!DOCTYPE html><html><body><h1>429 Too Many Requests</h1></body></html>\n"


def test_html_page_behind_a_200_is_retried_as_a_server_error_then_fails_with_the_url(run, srv):
    """An error page answered with 200 used to be recorded as the shard (and fail every chunk run)."""
    srv.fail_always(SHARDS[0], {"page": HTML, "content_type": "text/html; charset=utf-8"})
    rc, err = run(SHARDS[:2], "--format", "jsonl.zst", "--retries", "2")
    assert rc == 1
    assert f"{srv.url(SHARDS[0])}: gave up after 3 attempts" in err
    assert "HTTP 200 with Content-Type text/html for a zstd shard (an error page?)" in err
    assert not run.local(SHARDS[0]).exists() and not run.manifest.exists()
    assert run.local(SHARDS[1]).read_bytes() == run.served(SHARDS[1])
    srv.fail_always(SHARDS[0], None)
    rc, err = run(SHARDS[:2], "--format", "jsonl.zst")
    assert rc == 0, err
    run.assert_complete(SHARDS[:2])


def test_a_body_without_the_formats_magic_bytes_is_fetched_again(run, srv):
    """An HTML body sent as application/octet-stream: caught by its first bytes, and the retry gets the file."""
    srv.inject(SHARDS[0], {"page": HTML, "content_type": "application/octet-stream"})
    rc, err = run(SHARDS[:1], "--format", "jsonl.zst")
    assert rc == 0, err
    assert "the body is not a zstd file (it starts with b'<!DOCTYP'" in err
    assert [r.status for r in srv.seen(SHARDS[0])] == [200, 200]
    run.assert_complete(SHARDS[:1])


def test_a_source_of_plain_jsonl_takes_any_body(run, srv):
    """No compression promised (format jsonl, no suffix): the magic check does not apply."""
    (srv.root / "plain.jsonl").write_bytes(b'{"text": "x"}\n')
    rc, err = run(["plain.jsonl"], "--format", "jsonl")
    assert rc == 0, err


def test_redirect_loop_is_named(run, srv):
    srv.fail_always(SHARDS[0], {"status": 302, "headers": {"Location": "/" + SHARDS[0]}})
    rc, err = run(SHARDS[:1])
    assert rc == 1
    assert f"{srv.url(SHARDS[0])}: redirect loop (or more than 10 redirects)" in err
    assert "not retried: a client error" not in err


def test_a_trickle_below_the_minimum_rate_is_ended(run, srv):
    """A server sending 100 bytes/s was waited on for as long as it kept sending."""
    srv.fail_always(SHARDS[0], {"trickle_bps": 100})
    t = time.monotonic()
    rc, err = run(SHARDS[:1], "--timeout", "0.5", "--min-rate", "1000", "--retries", "1")
    assert rc == 1 and time.monotonic() - t < 20
    assert "transfer slower than min_rate_bytes_s 1000" in err and "gave up after 2 attempts" in err


def test_a_shard_past_its_deadline_fails(run, srv):
    """Fast enough for the minimum rate, but not done in time: the per-shard deadline ends it."""
    srv.fail_always(SHARDS[0], {"trickle_bps": 2000})
    t = time.monotonic()
    rc, err = run(SHARDS[:1], "--timeout", "5", "--min-rate", "0", "--deadline", "1.5")
    assert rc == 1 and time.monotonic() - t < 20
    assert "not complete 1.5 s after its first request (deadline_s)" in err
    assert "bytes kept in" in err  # the next run resumes what arrived
