"""``snakellm chunk``: stream a chunk's shards into one validated jsonl file.

Every input line ends up in exactly one place: the chunk's ``.jsonl`` (one JSON
document per line, text under the configured key) or its ``.rejected.jsonl``
(shard, line number, reason and the raw content). ``.stats.json`` counts both.
The job verifies its own output before publishing it: the written files are
re-counted and accepted + rejected must equal the lines read, or it fails.
All three outputs appear atomically, the stats file last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import BinaryIO, Iterator

import orjson

from snakellm.io.atomic import atomic_group
from snakellm.io.readers import open_shard
from snakellm.io.progress import progress

FORMATS = ("jsonl", "jsonl.zst", "jsonl.gz", "text", "text-blocks")
REASONS = (
    "blank_line",
    "invalid_utf8",
    "invalid_unicode",
    "invalid_json",
    "not_object",
    "missing_key",
    "not_string",
    "empty_text",
)


class VerificationError(RuntimeError):
    pass


def _classify_bad_json(line: bytes) -> str:
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    try:
        json.loads(s)  # accepts lone surrogate escapes that orjson refuses
        return "invalid_unicode"
    except ValueError:
        return "invalid_json"


def _text_documents(path: str, fmt: str) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of the documents of a plain-text shard."""
    with open_shard(path) as fh:
        data = fh.read()
    if fmt == "text":
        yield 1, data
        return
    # text-blocks: documents separated by one or more blank lines
    block: list[bytes] = []
    start = 1
    for i, line in enumerate(data.splitlines(keepends=True), start=1):
        if line.strip():
            if not block:
                start = i
            block.append(line)
        elif block:
            yield start, b"".join(block)
            block = []
    if block:
        yield start, b"".join(block)


def _count_lines(path: Path) -> int:
    n = 0
    last = b"\n"
    with open(path, "rb") as fh:
        while buf := fh.read(1 << 24):
            n += buf.count(b"\n")
            last = buf[-1:]
    return n + (last != b"\n")


def _process_shard(shard: str, fmt: str, key: str, fo: BinaryIO, fr: BinaryIO) -> dict:
    """Validate one shard, writing accepted lines to ``fo`` and quarantined ones to ``fr``.

    Returns this shard's counts: lines, documents, bytes in/out and rejections by reason.
    """
    reasons: Counter[str] = Counter()
    lines = docs = bytes_in = bytes_out = 0
    dumps, loads, JSONDecodeError = orjson.dumps, orjson.loads, orjson.JSONDecodeError

    def reject(lineno: int, reason: str, raw: bytes) -> None:
        reasons[reason] += 1
        rec = {"shard": shard, "line": lineno, "reason": reason, "content": raw.decode("utf-8", "backslashreplace")}
        fr.write(dumps(rec) + b"\n")

    if fmt.startswith("jsonl"):
        with open_shard(shard, fmt) as fh:
            for lineno, line in enumerate(fh, start=1):
                lines += 1
                bytes_in += len(line)
                # Hot loop: no copies of the line on the accepted path (orjson ignores the
                # trailing newline; isspace() stops at the first non-space byte instead of
                # building a stripped copy).
                if line.isspace() or not line:
                    reject(lineno, "blank_line", line.rstrip(b"\r\n"))
                    continue
                try:
                    obj = loads(line)
                except JSONDecodeError:
                    body = line.rstrip(b"\r\n")
                    reject(lineno, _classify_bad_json(body), body)
                    continue
                if type(obj) is not dict:
                    reject(lineno, "not_object", line.rstrip(b"\r\n"))
                    continue
                text = obj.get(key)
                if text is None and key not in obj:
                    reject(lineno, "missing_key", line.rstrip(b"\r\n"))
                elif type(text) is not str:
                    reject(lineno, "not_string", line.rstrip(b"\r\n"))
                elif not text or text.isspace():
                    reject(lineno, "empty_text", line.rstrip(b"\r\n"))
                else:
                    if line[-1:] != b"\n" or line[-2:] == b"\r\n":
                        line = line.rstrip(b"\r\n") + b"\n"
                    fo.write(line)
                    bytes_out += len(line)
                    docs += 1
    else:
        for lineno, raw in _text_documents(shard, fmt):
            lines += 1
            bytes_in += len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                reject(lineno, "invalid_utf8", raw)
                continue
            if not text.strip():
                reject(lineno, "empty_text", raw)
                continue
            rec = dumps({key: text}) + b"\n"
            fo.write(rec)
            bytes_out += len(rec)
            docs += 1
    return {"shard": shard, "lines": lines, "documents": docs, "bytes_in": bytes_in,
            "bytes_out": bytes_out, "reasons": dict(reasons)}


def _shard_to_parts(job: tuple[str, str, str, str, str]) -> dict:
    """Worker: one shard into its own part files (concatenated in shard order afterwards)."""
    shard, fmt, key, part_out, part_rej = job
    with open(part_out, "wb", buffering=1 << 22) as fo, open(part_rej, "wb") as fr:
        return _process_shard(shard, fmt, key, fo, fr)


def _append_file(src: str, dst: BinaryIO) -> None:
    with open(src, "rb") as fh:
        shutil.copyfileobj(fh, dst, 1 << 22)
    os.unlink(src)


def build_chunk(
    shards: list[str],
    out: str,
    *,
    fmt: str,
    key: str = "text",
    rejected: str | None = None,
    stats: str | None = None,
    source: str = "",
    chunk: str = "",
    workers: int = 1,
    show_progress: bool = True,
) -> dict:
    """Concatenate and validate ``shards`` into ``out``; return the stats dict.

    With ``workers > 1`` shards are validated in parallel processes, each into
    hidden part files next to the output, which are then appended in shard order:
    the output is byte-identical to the sequential one.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out_p = Path(out)
    rej_p = Path(rejected) if rejected else out_p.with_name(out_p.name.removesuffix(".jsonl") + ".rejected.jsonl")
    stats_p = Path(stats) if stats else out_p.with_name(out_p.name.removesuffix(".jsonl") + ".stats.json")
    for s in shards:
        if not os.path.isfile(s):
            raise FileNotFoundError(f"shard not found: {s}")

    t0 = time.perf_counter()
    total_size = sum(os.path.getsize(s) for s in shards)
    per_shard: list[dict] = []
    workers = max(1, min(workers, len(shards)))

    with atomic_group(out_p, rej_p, stats_p) as (tmp_out, tmp_rej, tmp_stats):
        with open(tmp_out, "wb", buffering=1 << 22) as fo, open(tmp_rej, "wb") as fr, progress(
            total=total_size, unit="B", unit_scale=True, desc=f"chunk {source}/{chunk}", enabled=show_progress
        ) as bar:
            if workers == 1:
                for shard in shards:
                    per_shard.append(_process_shard(shard, fmt, key, fo, fr))
                    bar.update(os.path.getsize(shard))
            else:
                parts = [(f"{tmp_out}.{i}.part", f"{tmp_rej}.{i}.part") for i in range(len(shards))]
                jobs = [(s, fmt, key, po, pr) for s, (po, pr) in zip(shards, parts)]
                try:
                    with ProcessPoolExecutor(workers) as pool:
                        # map() yields in shard order; parts are appended as soon as their turn comes
                        for (po, pr), res in zip(parts, pool.map(_shard_to_parts, jobs)):
                            _append_file(po, fo)
                            _append_file(pr, fr)
                            per_shard.append(res)
                            bar.update(os.path.getsize(res["shard"]))
                finally:
                    for po, pr in parts:
                        for p in (po, pr):
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(p)

        reasons: Counter[str] = Counter()
        for r in per_shard:
            shard_reasons = r.pop("reasons")
            reasons.update(shard_reasons)
            r["rejected"] = sum(shard_reasons.values())
        lines_read = sum(r["lines"] for r in per_shard)
        docs = sum(r["documents"] for r in per_shard)
        bytes_in = sum(r.pop("bytes_in") for r in per_shard)
        bytes_out = sum(r.pop("bytes_out") for r in per_shard)

        # Verification: what is on disk must account for every line read.
        written = _count_lines(tmp_out)
        quarantined = _count_lines(tmp_rej)
        n_rej = sum(reasons.values())
        if written != docs or quarantined != n_rej or docs + n_rej != lines_read:
            raise VerificationError(
                f"chunk {out}: read {lines_read} lines but wrote {written} documents "
                f"(counted {docs}) and {quarantined} rejected (counted {n_rej})"
            )
        seconds = time.perf_counter() - t0
        result = {
            "source": source,
            "chunk": chunk,
            "format": fmt,
            "key": key,
            "shards": len(shards),
            "lines_read": lines_read,
            "documents": docs,
            "rejected": n_rej,
            "rejected_by_reason": {r: reasons[r] for r in REASONS if reasons[r]},
            "bytes_in_compressed": total_size,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "seconds": round(seconds, 3),
            "mb_per_s": round(bytes_in / 1e6 / seconds, 1) if seconds > 0 else None,
            "per_shard": per_shard,
        }
        tmp_stats.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _read_manifest(path: str) -> list[str]:
    with open(path) as fh:
        man = json.load(fh)
    base = Path(path).parent
    return [str(base / s["path"]) if not os.path.isabs(s["path"]) else s["path"] for s in man["shards"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="snakellm chunk",
        description="Concatenate a chunk's shards (zstd, gzip or plain) into one validated jsonl file, "
        "quarantining bad lines with their shard, line number and reason.",
    )
    p.add_argument("shards", nargs="*", help="shard files in chunk order (a *.manifest.json stands for the shards it lists)")
    p.add_argument("--manifest", action="append", default=[], help="download manifest(s) listing the shards")
    p.add_argument("-o", "--output", required=True, help="the chunk's .jsonl")
    p.add_argument("--rejected", help="default: {output stem}.rejected.jsonl")
    p.add_argument("--stats", help="default: {output stem}.stats.json")
    p.add_argument("--format", default="jsonl", choices=FORMATS, help="shard format (default jsonl)")
    p.add_argument("--key", default="text", help="JSON key holding the document text (default text)")
    p.add_argument("--source", default="", help="source name, recorded in the stats")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the stats")
    p.add_argument("--threads", type=int, default=1, help="validate shards in this many processes (default 1)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    # The chunk rule passes its input as is: for an http source that is the
    # download manifest, which stands for the shards it lists.
    shards: list[str] = []
    for s in a.shards:
        shards.extend(_read_manifest(s) if s.endswith(".manifest.json") else [s])
    for m in a.manifest:
        shards.extend(_read_manifest(m))
    if not shards:
        p.error("no shards given (positional files or --manifest)")
    try:
        st = build_chunk(
            shards, a.output, fmt=a.format, key=a.key, rejected=a.rejected, stats=a.stats,
            source=a.source, chunk=a.chunk, workers=a.threads, show_progress=not a.no_progress,
        )
    except (FileNotFoundError, ValueError, VerificationError) as e:
        print(f"snakellm chunk: error: {e}", file=sys.stderr)
        return 1
    print(
        f"{a.output}: {st['documents']} documents, {st['rejected']} rejected "
        f"{st['rejected_by_reason'] or ''} from {st['lines_read']} lines in {st['shards']} shards, "
        f"{st['bytes_in'] / 1e6:.1f} MB at {st['mb_per_s']} MB/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
