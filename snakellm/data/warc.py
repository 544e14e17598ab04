"""CommonCrawl WARC shards (``.warc.gz``, ``.warc``): HTML responses as documents, text by trafilatura.

The reader is warcio's ``ArchiveIterator`` over snakellm's own decompressor
(:func:`snakellm.io.readers.open_shard`), which fails on a gzip member cut
short. FastWARC was measured too: it is faster at parsing, but it needs a
seekable file (it panics on a stream), and on a truncated ``.warc.gz`` it stops
quietly after the last whole record: the rest of the file would be lost without
a word. Parsing is a few percent of the job either way; trafilatura's
extraction is the rest (scripts/bench_chunk.py --warc).

Every record ends up counted: response records of an HTML type with status 200
whose extraction has text become documents (``text``, ``id`` = WARC-Record-ID,
``url``, ``date``); other record types, other statuses, other content types and
empty extractions are skipped by reason (``.stats.json``'s ``skipped_by_reason``);
a record whose HTML cannot be decoded or extracted is quarantined with its
place (record number, record id, URL) and reason.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, BinaryIO

import orjson

from snakellm.io.readers import DamagedShardError, display, open_shard

HTML_TYPES = ("text/html", "application/xhtml+xml")
# datatrove's Trafilatura extractor's defaults (datatrove 0.10: favour_precision=True, deduplicate=True, no comments)
TRAFILATURA_OPTIONS: dict[str, Any] = {"favor_precision": True, "include_comments": False, "deduplicate": True}


def _mime(value: str | None) -> str:
    return (value or "").split(";")[0].strip().lower()


def _charset(ctype: str | None) -> str | None:
    for part in (ctype or "").split(";")[1:]:
        k, _, v = part.strip().partition("=")
        if k.strip().lower() == "charset" and v.strip():
            return v.strip().strip("\"'")
    return None


def extract(html: str) -> str | None:
    """The text trafilatura extracts from one HTML page, with datatrove's settings."""
    from trafilatura import extract as trafilatura_extract

    return trafilatura_extract(html, **TRAFILATURA_OPTIONS)


def _decode(body: bytes, ctype: str | None) -> str | None:
    """UTF-8 (as datatrove tries first), else the charset the response declares; None if neither decodes it."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        pass
    cs = _charset(ctype)
    if cs:
        with contextlib.suppress(LookupError, UnicodeDecodeError):
            return body.decode(cs)
    return None


def read_warc(t: Any, shard: str, key: str, fo: BinaryIO, exp: Any) -> dict:
    """Every record of one WARC shard into ``fo`` (documents), the quarantine and the skip counts of ``t``."""
    from warcio.archiveiterator import ArchiveIterator

    from snakellm.data.chunk import open_local, stat_shard
    from snakellm.data.planning import shard_identity
    from snakellm.io.readers import detect_compression

    logging.getLogger("trafilatura").setLevel(logging.CRITICAL)  # its per-page warnings would flood the log
    before = stat_shard(shard)
    with open_local(shard) as raw:
        comp = detect_compression(shard, "warc")
        fh = open_shard(shard, "warc", comp, raw)
        n = 0
        try:
            for n, rec in enumerate(ArchiveIterator(fh, arc2warc=True), start=1):
                _record(t, n, rec, key, fo)
        except DamagedShardError:
            raise
        except Exception as e:  # warcio's parse errors: a WARC damaged inside a whole gzip member
            raise DamagedShardError(f"{display(shard)}: not a readable WARC after record {n}: {e}") from None
        digest = raw.hexdigest()
    after = stat_shard(shard)
    was, now = shard_identity(before), shard_identity(after)
    if was != now:
        from snakellm.data.chunk import ShardFileError

        raise ShardFileError(f"shard {display(shard)} changed while it was read: run again")
    if exp is not None and digest != exp.sha256:
        from snakellm.data.chunk import ManifestMismatchError

        raise ManifestMismatchError(f"shard {display(shard)} ({exp.url}) has sha256 {digest}, not the manifest's")
    return {"compression": comp, "stat": was, "sha256": digest}


def _record(t: Any, n: int, rec: Any, key: str, fo: BinaryIO) -> None:
    t.lines += 1
    if rec.rec_type != "response":
        t.skipped["not_response"] += 1
        rec.content_stream().read()
        return
    body = rec.content_stream().read()
    t.bytes_in += len(body)
    status = rec.http_headers.get_statuscode() if rec.http_headers is not None else None
    if status != "200":
        t.skipped["not_200"] += 1
        return
    ctype = rec.http_headers.get_header("Content-Type")
    mime = _mime(rec.rec_headers.get_header("WARC-Identified-Payload-Type")) or _mime(ctype)
    if mime not in HTML_TYPES:
        t.skipped["not_html"] += 1
        return
    rid = rec.rec_headers.get_header("WARC-Record-ID")
    where = {"record": n, "id": rid, "url": rec.rec_headers.get_header("WARC-Target-URI")}
    html = _decode(body, ctype)
    if html is None:
        t.reject_at(where, "invalid_utf8", body[:1024].decode("utf-8", "backslashreplace"))
        return
    try:
        text = extract(html)
    except Exception as e:  # trafilatura/lxml on a page they cannot parse
        t.reject_at(where, "extraction_failed", html[:1024], error=f"{type(e).__name__}: {e}")
        return
    if not text or text.isspace():
        t.skipped["empty_extraction"] += 1
        return
    line = orjson.dumps(
        {key: text, "id": rid, "url": where["url"], "date": rec.rec_headers.get_header("WARC-Date")},
        option=orjson.OPT_APPEND_NEWLINE,
    )
    fo.write(line)
    t.bytes_out += len(line)
    t.docs += 1
