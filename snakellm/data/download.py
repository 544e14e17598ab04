"""``snakellm download``: fetch one chunk's http shards and write its manifest.

One job per chunk (never per shard: 60,000 shards must stay ~75 Snakemake jobs),
so the job itself has to do what a per-shard scheduler would otherwise do:

* fetch shards concurrently (a thread pool; the work is network-bound);
* retry what is worth retrying: 429 (waiting as long as ``Retry-After`` asks,
  in seconds or as an HTTP date, capped by ``--max-backoff``), 408, 5xx,
  refused/dropped connections, timeouts and bodies that end early; with
  exponential backoff and jitter so eight threads do not hammer a server in
  lockstep. Other 4xx (404, 403, 410, ...) are final at once: retrying a missing
  file only burns minutes;
* resume instead of restarting: the body goes to ``{shard}.part`` next to the
  final file and a retry asks for ``Range: bytes={len(part)}-`` with
  ``If-Range`` set to the validator (strong ETag or Last-Modified) of the
  response that started the part, so a shard that changed on the server
  restarts from zero instead of producing a spliced file. ``206`` appends,
  ``200`` (Range ignored, or the file changed) restarts, ``416`` restarts;
* hash while streaming (sha256; a resumed part is hashed from disk first) and
  check the final size against ``Content-Length`` / the ``Content-Range`` total;
* verify what arrived: for a compressed source an HTML/text ``Content-Type`` or a
  body without a compression's magic bytes (an error page behind a 200) is a
  server error, retried, then final with the URL; a trickle below
  ``min_rate`` ends the attempt, and a per-shard ``deadline`` ends the shard;
  a redirect loop is named as one;
* publish a shard only by renaming the complete, fsynced ``.part`` onto its
  final name. A final file therefore always is a complete download, so one that
  exists is never requested again; its size and sha256 come from the
  ``{shard}.meta.json`` sidecar (or are recomputed locally when the sidecar does
  not match the file);
* write the manifest (url, path, size, sha256 of every shard, paths relative
  to the manifest's directory) atomically and only when every shard is
  complete. ``snakellm chunk --manifest`` reads it; Snakemake sees the manifest
  as the job's only output, so a failed job leaves no output, while the
  completed shards (and the partial ones) stay on disk for the retry.

Where a shard lives is derived from its URL alone (``plan.url_to_relpath``:
host + path), so re-planning chunks never renames or re-downloads a shard.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import fcntl
import hashlib
import http.client
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit
from urllib.request import Request, urlopen

from snakellm import __version__
from snakellm.data.planning import url_to_relpath
from snakellm.errors import StepFailed
from snakellm.io.atomic import write_json
from snakellm.io.progress import progress
from snakellm.io.readers import compression_of, sniff

BLOCK = 1 << 18  # 256 KiB per read: few syscalls, fine-grained progress and resume points
USER_AGENT = f"snakellm/{__version__} (+download)"


@dataclass(frozen=True)
class Options:
    """Retry and transfer settings (the ``download:`` config section)."""

    concurrency: int = 8
    retries: int = 8
    backoff: float = 1.0
    max_backoff: float = 60.0
    timeout: float = 60.0
    deadline: float = 7200.0  # a shard not complete this long after its first request fails (0: no deadline)
    min_rate: float = 1024.0  # bytes/s an attempt must average over each `timeout` window (0: no minimum)
    format: str = ""  # the source's format: with the URL's suffix, the compression a body must have
    token_env: str = ""  # the environment variable of a bearer token for the URLs' own host (HF_TOKEN)


@dataclass
class ShardResult:
    """One complete shard, as listed in the manifest (plus run statistics)."""

    url: str
    path: Path
    size: int
    sha256: str
    fetched: int = 0  # bytes received in this run (0: reused from disk)
    requests: int = 0
    reused: bool = False

    def manifest_entry(self, base: Path) -> dict:
        return {
            "url": self.url,
            "path": os.path.relpath(self.path, base),
            "size": self.size,
            "sha256": self.sha256,
        }


class ShardError(StepFailed, RuntimeError):
    """A shard that could not be downloaded: the message names its URL and the last status/error."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class _Retryable(StepFailed):
    """An attempt failed in a way another attempt may fix (429, 5xx, network).

    ``progress=False``: whatever bytes it brought do not reset the failure
    count (a trickle below the minimum rate is a failure, not progress).
    """

    def __init__(self, message: str, retry_after: float | None = None, progress: bool = True) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.progress = progress


class _Restart(StepFailed):
    """The partial file cannot be continued (416, wrong Content-Range): start from zero now."""


class _Stopped(StepFailed):
    """The job is being interrupted; leave the .part for the next run."""


# ----------------------------------------------------------------- retry policy


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for: delta-seconds or an HTTP date; None if absent/invalid."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; be lenient with servers that omit it
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_delay(failures: int, opts: Options, retry_after: float | None = None) -> float:
    """Delay before the next attempt after ``failures`` consecutive failures.

    The server's ``Retry-After`` wins (it knows its rate limit), capped by
    ``max_backoff`` so a misconfigured server cannot park a job for hours.
    Otherwise ``backoff * 2**(failures-1)`` with "equal jitter" (50-100% of it),
    so concurrent workers that failed together do not retry together.
    """
    if retry_after is not None:
        return min(opts.max_backoff, retry_after)
    base = min(opts.max_backoff, opts.backoff * (2 ** max(0, failures - 1)))
    return base * random.uniform(0.5, 1.0)


def _is_retryable_status(status: int) -> bool:
    return status in (408, 429) or 500 <= status <= 599


# ----------------------------------------------------------------- sidecars


def _meta_path(final: Path) -> Path:
    return final.with_name(final.name + ".meta.json")


def _part_path(final: Path) -> Path:
    return final.with_name(final.name + ".part")


def _read_meta(final: Path) -> dict:
    try:
        with open(_meta_path(final)) as fh:
            meta = json.load(fh)
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _hash_file(path: Path, hasher=None, limit: int | None = None):
    """sha256 of a file (or its first ``limit`` bytes), read in blocks."""
    h = hasher or hashlib.sha256()
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            buf = fh.read(BLOCK if left is None else min(BLOCK, left))
            if not buf:
                break
            h.update(buf)
            if left is not None:
                left -= len(buf)
    return h


def _validator(headers) -> str | None:
    """What ``If-Range`` may carry: a strong ETag, else Last-Modified (weak ETags are not allowed)."""
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return headers.get("Last-Modified")


def _reuse_complete(url: str, final: Path) -> ShardResult:
    """A final file exists, hence is complete: report it without any request.

    The sidecar is trusted only while the file's size and mtime still match it;
    otherwise the hash is recomputed from disk (cheap next to a download).
    """
    st = final.stat()
    meta = _read_meta(final)
    if meta.get("size") == st.st_size and meta.get("mtime_ns") == st.st_mtime_ns and meta.get("sha256"):
        return ShardResult(url, final, st.st_size, meta["sha256"], reused=True)
    digest = _hash_file(final).hexdigest()
    _write_complete_meta(url, final, digest, meta)
    return ShardResult(url, final, st.st_size, digest, reused=True)


def _write_complete_meta(url: str, final: Path, digest: str, extra: dict | None = None) -> None:
    st = final.stat()
    meta = {k: v for k, v in (extra or {}).items() if k in ("etag", "last_modified", "validator")}
    meta.update(url=url, size=st.st_size, sha256=digest, mtime_ns=st.st_mtime_ns, complete=True)
    write_json(_meta_path(final), meta)


# ----------------------------------------------------------------- one shard


class _Progress:
    """Thread-safe byte counter over a tqdm bar whose total grows as sizes become known."""

    def __init__(self, bar, n_shards: int) -> None:
        self._bar = bar
        self._lock = threading.Lock()
        self._n_shards = n_shards
        self._done = 0
        self._tty = sys.stderr.isatty()
        self._shown: float | None = None

    def add_total(self, n: int) -> None:
        # no refresh here: in a log file tqdm only prints every 30 s, and
        # an explicit refresh per shard would print a line per shard
        with self._lock:
            self._bar.total = (self._bar.total or 0) + n

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def shard_done(self) -> None:
        with self._lock:
            self._done += 1
            self._bar.set_postfix_str(f"{self._done}/{self._n_shards} shards", refresh=False)

    def write(self, msg: str) -> None:
        """A retry/failure message: above the bar in a terminal, a plain line in a log file."""
        with self._lock:
            if self._tty:
                self._bar.write(msg, file=sys.stderr)
            else:
                # tqdm leaves its last line open ("\r<bar>"): start a fresh one after it
                shown = getattr(self._bar, "last_print_t", None)
                fresh = "\n" if shown is not None and shown != self._shown else ""
                self._shown = shown
                print(fresh + msg, file=sys.stderr, flush=True)


def _content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` -> (a, b, total or None for ``*``)."""
    if not value or not value.startswith("bytes "):
        return None
    try:
        rng, _, total = value[6:].partition("/")
        a, _, b = rng.partition("-")
        return int(a), int(b), (None if total.strip() == "*" else int(total))
    except ValueError:
        return None


def fetch_shard(
    url: str,
    final: Path,
    opts: Options,
    bar: _Progress,
    stop: threading.Event,
    log: Callable[[str], None],
) -> ShardResult:
    """Download ``url`` to ``final`` (resuming ``final.part``); raise ShardError when it keeps failing."""
    if final.exists():
        return _reuse_complete(url, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    part = _part_path(final)
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    # Unbuffered: every byte received is in the page cache at once, so even a
    # killed process leaves a .part holding all of it for the next run to resume.
    with os.fdopen(fd, "r+b", buffering=0) as fh:
        # Two processes appending to one .part would splice garbage into it.
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ShardError(url, f"{part} is being written by another process") from None
        if final.exists():  # another process finished it between our check and our open
            with contextlib.suppress(OSError):
                if os.fstat(fh.fileno()).st_size == 0 and os.stat(part).st_ino == os.fstat(fh.fileno()).st_ino:
                    part.unlink()  # the empty .part our open() just created
            return _reuse_complete(url, final)
        return _fetch_locked(url, final, part, fh, opts, bar, stop, log)


@dataclass
class _Part:
    """The state of one ``.part`` file; invariant: ``hasher`` has seen exactly the first ``offset`` bytes on disk."""

    url: str
    final: Path
    fh: BinaryIO  # the open, locked .part file
    bar: _Progress
    offset: int = 0
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    total: int | None = None  # full size of the shard, once a response announced it
    counted_total: int | None = None  # what this shard contributed to the bar's total
    validator: str | None = None  # strong ETag or Last-Modified of the response that started the part
    received: int = 0  # bytes received in this run, discarded attempts included

    def append(self, buf: bytes) -> None:
        try:
            view = memoryview(buf)
            while view:  # a raw write may be short
                view = view[self.fh.write(view) :]
        except OSError as e:  # disk full, quota: not a network problem, retrying will not help
            raise ShardError(self.url, f"cannot write {_part_path(self.final)}: {e}") from None
        self.hasher.update(buf)
        self.offset += len(buf)
        self.received += len(buf)
        self.bar.update(len(buf))

    def restart(self) -> None:
        """Drop the partial bytes: the next body starts at byte 0."""
        self.fh.flush()
        self.fh.truncate(0)
        self.fh.seek(0)
        self.bar.update(-self.offset)
        self.offset = 0
        self.hasher = hashlib.sha256()

    def sync(self) -> None:
        """Make the file end exactly at ``offset`` (buffered bytes flushed, nothing unhashed kept)."""
        self.fh.flush()
        self.fh.truncate(self.offset)
        self.fh.seek(self.offset)

    def set_total(self, total: int | None) -> None:
        self.total = total
        if total is not None and total != self.counted_total:
            self.bar.add_total(total - (self.counted_total or 0))
            self.counted_total = total


def _fetch_locked(
    url: str,
    final: Path,
    part: Path,
    fh,
    opts: Options,
    bar: _Progress,
    stop: threading.Event,
    log: Callable[[str], None],
) -> ShardResult:
    meta = _read_meta(final)
    st = _Part(url, final, fh, bar)
    on_disk = os.fstat(fh.fileno()).st_size
    # A part whose origin we do not know (no sidecar from the response that
    # started it) cannot be resumed safely: it may hold another file's bytes.
    if on_disk and meta.get("url") == url and not meta.get("complete"):
        st.offset = on_disk
        st.hasher = _hash_file(part, limit=on_disk)  # a resumed shard's hash covers the old bytes too
        st.validator = meta.get("validator")
        bar.update(on_disk)
        st.set_total(meta.get("total"))
    st.sync()

    best = st.offset  # furthest point ever reached: new bytes reset the failure count
    failures = requests = 0
    started = time.monotonic()
    while True:
        if stop.is_set():
            raise _Stopped()
        retry_after: float | None = None
        requests += 1
        progress = True
        try:
            _attempt(st, opts, stop, started)
            _check_body(st, opts)
            break
        except _Restart as e:
            last_error = str(e)
            log(f"{url}: {e}; restarting from byte 0")
            st.restart()
            retry_after = 0.0
        except _Retryable as e:
            last_error = str(e)
            retry_after, progress = e.retry_after, e.progress
        if st.offset > best:
            best = st.offset
            if progress:
                failures = 0
        failures += 1
        _check_deadline(st, opts, started, last_error)
        if failures > opts.retries:
            kept = f"; {st.offset} bytes kept in {part} for the next run" if st.offset else ""
            raise ShardError(
                url,
                f"gave up after {requests} attempts ({opts.retries} retries without progress); last error: {last_error}{kept}",
            )
        delay = backoff_delay(failures, opts, retry_after)
        if opts.deadline:
            delay = max(0.0, min(delay, started + opts.deadline - time.monotonic()))
        log(f"{url}: {last_error}; retry {failures}/{opts.retries} in {delay:.2f}s from byte {st.offset}")
        if stop.wait(delay):
            raise _Stopped()

    # complete: verify, make durable, publish by rename, then record the hash
    st.sync()
    size = os.fstat(fh.fileno()).st_size
    if size != st.offset or (st.total is not None and size != st.total):
        raise ShardError(url, f"size check failed: {size} bytes on disk, expected {st.total}")
    os.fsync(fh.fileno())
    os.replace(part, final)
    digest = st.hasher.hexdigest()
    _write_complete_meta(url, final, digest, _read_meta(final))
    with contextlib.suppress(OSError):
        dfd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself must survive a crash, or the next run fetches again
        finally:
            os.close(dfd)
    bar.shard_done()
    return ShardResult(url, final, size, digest, fetched=st.received, requests=requests)


@contextlib.contextmanager
def _open(req: Request, timeout: float, token_env: str = "") -> Iterator[http.client.HTTPResponse]:
    """``urlopen`` that sorts failures into _Retryable (worth another try), _Restart and ShardError (final)."""
    try:
        resp = urlopen(req, timeout=timeout)
    except HTTPError as e:
        status, reason = e.code, e.reason
        hdrs: Any = e.headers or {}
        ra = retry_after_seconds(hdrs.get("Retry-After"))
        crange = hdrs.get("Content-Range")
        with contextlib.suppress(Exception):
            e.close()
        msg = f"HTTP {status} {reason}".rstrip()
        if 300 <= status < 400:  # urllib gives up on a loop (a URL seen 4 times) or after 10 redirects
            where = hdrs.get("Location")
            raise ShardError(
                req.full_url,
                f"redirect loop (or more than 10 redirects): the last answer was HTTP {status} to {where!r}",
            ) from None
        if status == 416 and req.has_header("Range"):
            raise _Restart(f"{msg} for {req.get_header('Range')} ({crange or 'no Content-Range'})") from None
        if _is_retryable_status(status):
            raise _Retryable(msg + (f" (Retry-After {ra:g}s)" if ra is not None else ""), ra) from None
        hint = ""
        if status in (401, 403):  # names the variable, never its value
            if req.has_header("Authorization"):
                hint = f"; the bearer token from ${token_env} was sent: is it valid for this repository?"
            elif token_env:
                hint = f"; no token was sent: ${token_env} is not set"
            else:
                hint = "; no token was sent (a gated dataset: sources.NAME.token_env: HF_TOKEN)"
        raise ShardError(req.full_url, f"{msg} (not retried: a client error will not go away){hint}") from None
    except http.client.InvalidURL as e:
        raise ShardError(req.full_url, f"invalid URL: {e}") from None
    except (URLError, OSError, http.client.HTTPException) as e:
        cause: object = e.reason if isinstance(e, URLError) else e
        raise _Retryable(f"{type(cause).__name__}: {cause}") from None
    with resp:
        yield resp


def _check_deadline(st: _Part, opts: Options, started: float, last_error: str) -> None:
    """ShardError once the shard has been at it longer than ``deadline`` (a trickle that always makes progress)."""
    if opts.deadline and time.monotonic() - started >= opts.deadline:
        kept = f"; {st.offset} bytes kept in {_part_path(st.final)} for the next run" if st.offset else ""
        raise ShardError(
            st.url,
            f"not complete {opts.deadline:g} s after its first request (deadline_s); "
            f"{st.offset} of {st.total if st.total is not None else '?'} bytes; last error: {last_error}{kept}",
        )


class _Rate:
    """Ends an attempt that receives less than ``min_rate`` bytes/s over a window of ``timeout`` seconds."""

    def __init__(self, opts: Options, started: float) -> None:
        self.opts, self.started = opts, started
        self.window_start = time.monotonic()
        self.window_bytes = 0

    def add(self, n: int) -> None:
        self.window_bytes += n
        now = time.monotonic()
        o = self.opts
        if o.deadline and now - self.started >= o.deadline:
            raise _Retryable(f"deadline of {o.deadline:g} s reached mid-body", progress=False)
        span = now - self.window_start
        if span < o.timeout:
            return
        rate = self.window_bytes / span
        if o.min_rate and rate < o.min_rate:
            raise _Retryable(
                f"transfer slower than min_rate_bytes_s {o.min_rate:g} ({rate:.0f} bytes/s over {span:.0f} s)",
                progress=False,
            )
        self.window_start, self.window_bytes = now, 0


def _check_body(st: _Part, opts: Options) -> None:
    """The complete body of a compressed source must start with a compression's magic bytes.

    An error page served with 200 (or a proxy's HTML) would otherwise be
    recorded as the shard, with its sha256, and fail every chunk run.
    """
    declared = _declared(st.url, opts)
    if declared == "none":
        return
    st.fh.seek(0)
    head = st.fh.read(8)
    st.fh.seek(st.offset)
    if sniff(head) == "none":
        st.restart()
        raise _Retryable(f"the body is not a {declared} file (it starts with {head!r}: an error page?)")


def _declared(url: str, opts: Options) -> str:
    """The compression the source's format, else the URL's suffix, promises for this shard."""
    return compression_of(urlsplit(url).path, opts.format or None)


def _attempt(st: _Part, opts: Options, stop: threading.Event, started: float | None = None) -> None:
    """One request, appending its body to the part. Returns when the shard is complete.

    Raises _Retryable / _Restart / ShardError / _Stopped; in every case the file
    on disk is synced to exactly the bytes hashed so far, so the next attempt
    (or the next run) resumes from a consistent state.
    """
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if st.offset:
        headers["Range"] = f"bytes={st.offset}-"
        if st.validator:
            headers["If-Range"] = st.validator
    req = Request(st.url, headers=headers)
    token = os.environ.get(opts.token_env) if opts.token_env else None
    if token:
        # unredirected: urllib copies ordinary headers onto a redirect's request, whatever its host; this one
        # goes to the URL's own host only (the Hub's resolve URL, not the storage host it redirects to)
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    rate = _Rate(opts, time.monotonic() if started is None else started)
    try:
        with _open(req, opts.timeout, opts.token_env) as resp:
            _start_body(st, resp, opts)
            while True:
                if stop.is_set():
                    raise _Stopped()
                # read1: whatever arrived, at most BLOCK. read() would block for a
                # full BLOCK and lose the bytes it had buffered when the read times out.
                buf = resp.read1(BLOCK)
                if not buf:
                    break
                st.append(buf)
                rate.add(len(buf))
                if st.total is not None and st.offset > st.total:
                    raise _Restart(f"server sent more than the announced {st.total} bytes")
    except _Retryable:
        st.sync()
        raise
    except (OSError, http.client.HTTPException) as e:
        # connection reset, read timeout, broken chunked encoding: keep what arrived
        st.sync()
        raise _Retryable(f"connection failed after {st.offset} bytes: {type(e).__name__}: {e}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            st.sync()
        raise
    st.sync()
    if st.total is not None and st.offset < st.total:
        # http.client returns b"" (no error) when a Content-Length body ends early
        raise _Retryable(f"connection closed after {st.offset} of {st.total} bytes")


def _start_body(st: _Part, resp: http.client.HTTPResponse, opts: Options) -> None:
    """Check the response status and headers against the part and get it ready for the body."""
    status = resp.status
    ctype = (resp.headers.get("Content-Type") or "").split(";")[0].strip().lower()
    declared = _declared(st.url, opts)
    if declared != "none" and (ctype.startswith("text/") or "html" in ctype):
        # an error page behind a 200 (a CDN's "rate limited", a login wall): a server error, retried
        raise _Retryable(f"HTTP {status} with Content-Type {ctype} for a {declared} shard (an error page?)")
    if status == 206:
        cr = _content_range(resp.headers.get("Content-Range"))
        if cr is None or cr[0] != st.offset:
            raise _Restart(f"HTTP 206 with Content-Range {resp.headers.get('Content-Range')!r} for bytes={st.offset}-")
        if cr[2] is not None:
            if st.total is not None and st.total != cr[2]:
                raise _Restart(f"size changed on the server from {st.total} to {cr[2]} bytes")
            st.set_total(cr[2])
        return
    if status != 200:
        raise ShardError(st.url, f"unexpected HTTP {status} {resp.reason}")
    if st.offset:
        # Range ignored, or If-Range said the file changed: this body is the whole file.
        st.restart()
    length = resp.headers.get("Content-Length")
    st.set_total(int(length) if length and length.strip().isdigit() else None)
    st.validator = _validator(resp.headers)
    # Recorded before the first body byte: a later run only resumes a part
    # whose origin (URL + validator) it knows.
    write_json(
        _meta_path(st.final),
        {
            "url": st.url,
            "total": st.total,
            "validator": st.validator,
            "etag": resp.headers.get("ETag"),
            "last_modified": resp.headers.get("Last-Modified"),
            "complete": False,
        },
    )


# ----------------------------------------------------------------- one chunk


def shard_path(dest: str | os.PathLike, url: str) -> Path:
    """The final local path of ``url`` under ``dest`` (host + URL path, see plan.url_to_relpath)."""
    scheme = urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url!r}")
    return Path(dest) / url_to_relpath(url)


def download_chunk(
    urls: list[str],
    dest: str | os.PathLike,
    manifest: str | os.PathLike,
    *,
    opts: Options = Options(),
    source: str = "",
    chunk: str = "",
    show_progress: bool = True,
) -> dict:
    """Fetch every URL into ``dest`` and write ``manifest``; return the manifest dict.

    Raises :class:`DownloadError` listing every shard that failed, after the
    others finished (their files stay, so the retry only fetches what is missing).
    """
    paths = [shard_path(dest, u) for u in urls]
    seen: dict[Path, str] = {}
    for u, p in zip(urls, paths):
        if p in seen:
            raise ValueError(f"{u} and {seen[p]} would both be stored as {p}")
        seen[p] = u
    manifest = Path(manifest)
    stop = threading.Event()
    t0 = time.perf_counter()
    results: list[ShardResult | None] = [None] * len(urls)
    errors: list[ShardError] = []
    desc = f"download {source}/{chunk}" if source or chunk else "download"
    with progress(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, enabled=show_progress) as tq:
        bar = _Progress(tq, len(urls))

        def job(i: int) -> None:
            try:
                results[i] = r = fetch_shard(urls[i], paths[i], opts, bar, stop, bar.write)
                if r.reused:
                    bar.add_total(r.size)
                    bar.update(r.size)
                    bar.shard_done()
            except ShardError as e:
                errors.append(e)
                bar.write(f"failed: {e}")
            except _Stopped:
                pass
            except Exception as e:  # e.g. permission denied under dest: still report which shard
                errors.append(ShardError(urls[i], f"{type(e).__name__}: {e}"))
                bar.write(f"failed: {errors[-1]}")

        pool = ThreadPoolExecutor(max_workers=max(1, min(opts.concurrency, len(urls))), thread_name_prefix="download")
        try:
            for f in [pool.submit(job, i) for i in range(len(urls))]:
                f.result()
        except BaseException:
            # Ctrl-C: workers leave at their next read (or read timeout); do not
            # wait for them here. Their .part files stay for the next run.
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    seconds = time.perf_counter() - t0
    if errors:
        order = {u: i for i, u in enumerate(urls)}
        errors.sort(key=lambda e: order.get(e.url, 0))
        raise DownloadError(errors, sum(r is not None for r in results), len(urls), Path(dest))
    done = [r for r in results if r is not None]
    base = manifest.parent
    man = {
        "source": source,
        "chunk": chunk,
        "shards": [r.manifest_entry(base) for r in done],
        "size": sum(r.size for r in done),
    }
    write_json(manifest, man)  # last: its existence means every shard above is complete
    man["_stats"] = {
        "fetched_bytes": sum(r.fetched for r in done),
        "requests": sum(r.requests for r in done),
        "reused": sum(r.reused for r in done),
        "seconds": round(seconds, 3),
    }
    return man


class DownloadError(StepFailed):
    """Some shards of the chunk failed; each line names a URL and its last status or error."""

    def __init__(self, errors: list[ShardError], n_done: int, n_total: int, dest: Path) -> None:
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(
            f"{len(errors)} of {n_total} shards failed ({n_done} complete shards kept under {dest} "
            f"and not fetched again on retry):\n{lines}"
        )
        self.errors = errors


# ----------------------------------------------------------------- CLI


HELP = """\
Download one chunk's shards over HTTP(S) into DEST and write the chunk's
manifest (url, path, size and sha256 of every shard) once all are complete.

Each shard is stored at DEST/<host>/<url path>, so the same URL always lands
in the same file. A shard whose final file exists is complete (files only
appear there by an atomic rename) and is never requested again.

Failures: 429 (waits for Retry-After, seconds or HTTP date, at most
--max-backoff), 408, 5xx, refused or dropped connections, timeouts and bodies
that end early are retried with exponential backoff (--backoff doubled per
failure, with jitter, capped by --max-backoff). A shard gives up after
--retries consecutive failures that brought no new bytes. Other 4xx
(404, 403, 410, ...) fail at once. Partial bodies are kept in <file>.part and
continued with an HTTP Range request (If-Range guards against a file that
changed on the server; a 200 answer restarts the shard from zero).

Verification: for a compressed shard (by --format, else the URL's suffix) an
HTML/text Content-Type, or a body that does not start with a compression's
magic bytes (an error page behind a 200), is retried like a server error and
then fails with the URL; the body's size must match Content-Length. An
attempt that averages less than --min-rate bytes/s over a --timeout window is
ended and counts as a failure even though bytes arrived; a shard not complete
--deadline seconds after its first request fails (its .part is kept). A
redirect loop (or more than 10 redirects) fails at once, named as such.

Exit status: 0 when every shard is complete and the manifest is written; 1
when any shard failed (each failure is listed with its URL and last status;
the completed shards stay for the retry and no manifest is written); 2 on
usage errors.
"""
