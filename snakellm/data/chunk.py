"""``snakellm chunk``: stream a chunk's shards into one validated jsonl file.

Every input line ends up in exactly one place: the chunk's ``.jsonl`` (one JSON
document per line, text under the configured key) or its ``.rejected.jsonl``
(shard, line number, reason and the raw content). ``.stats.json`` counts both.
The job verifies its own output before publishing it: the written files are
re-counted and accepted + rejected must equal the lines read, or it fails.
All three outputs appear atomically, the stats file last.

Nothing is lost silently: a shard is decompressed by what its magic bytes say
(a mismatch with the source's format is counted in the stats), a truncated or
corrupt shard fails the job naming it (never a short read), a downloaded shard
must match the size and sha256 its manifest recorded, a UTF-8 byte-order mark
at the start of a line is stripped (and counted), and lines end at ``\n``,
``\r\n`` or a lone ``\r``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from snakellm.config.sections import SOURCE_FORMATS
from snakellm.errors import StepFailed
from snakellm.io.atomic import atomic_group
from snakellm.io.progress import progress
from snakellm.io.readers import BOM, compression_of, detect_compression, open_shard, shard_lines

FORMATS = SOURCE_FORMATS
REASONS = (
    "blank_line",
    "invalid_utf8",
    "invalid_unicode",
    "invalid_json",
    "unsupported_json",
    "not_object",
    "missing_key",
    "not_string",
    "empty_text",
)


class VerificationError(StepFailed, RuntimeError):
    pass


class ManifestMismatchError(StepFailed, RuntimeError):
    """A downloaded shard that is not what its manifest recorded (or is gone)."""


@dataclass(frozen=True)
class Expected:
    """What the download manifest recorded for a shard."""

    size: int
    sha256: str
    url: str = ""


def _sidecars(path: str) -> list[str]:
    return [path + ".meta.json"]


def check_against_manifest(shard: str, exp: Expected) -> None:
    """Size, then sha256, of a downloaded shard against its manifest, before it is read.

    A shard that does not match is removed (with its download sidecar): the
    workflow sees the missing shard at the next start and runs the chunk's
    download again, which fetches just that shard. Failing forever on a damaged
    copy would need a hand-made fix.
    """
    where = f" ({exp.url})" if exp.url else ""
    if not os.path.isfile(shard):
        raise ManifestMismatchError(
            f"shard {shard}{where} listed in the manifest is missing (deleted after the download?); "
            "run again: the next run downloads it again"
        )
    size = os.path.getsize(shard)
    if size != exp.size:
        problem = f"is {size} bytes, the manifest recorded {exp.size}"
    else:
        h = hashlib.sha256()
        with open(shard, "rb") as fh:
            while buf := fh.read(1 << 22):
                h.update(buf)
        if h.hexdigest() == exp.sha256:
            return
        problem = f"has sha256 {h.hexdigest()}, the manifest recorded {exp.sha256}"
    removed = ""
    if exp.url:
        for p in [shard, *_sidecars(shard)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        removed = "; removed it: the next run downloads it again"
    raise ManifestMismatchError(f"shard {shard}{where} {problem}{removed}")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _classify_bad_json(line: bytes) -> str:
    """Why orjson refused a line: not UTF-8, not JSON, a lone surrogate, or valid JSON it cannot hold."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    try:
        obj = json.loads(s, parse_constant=_no_constant)  # NaN/Infinity: not JSON (RFC 8259)
    except (ValueError, RecursionError):
        return "invalid_json"
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "invalid_unicode"  # a lone surrogate escape (\ud800): no UTF-8 text can hold it
    # e.g. 1e400 (beyond a double) or nesting deeper than 1024: valid JSON that orjson, and
    # therefore the tokenize step, cannot read; quarantined under its own reason
    return "unsupported_json"


def _text_documents(path: str, fmt: str, counts: Counter[str]) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of the documents of a plain-text shard (a leading BOM dropped)."""
    with open_shard(path, fmt) as fh:
        data = fh.read()
    if data.startswith(BOM):
        data = data[len(BOM) :]
        counts["boms_stripped"] += 1
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


def _process_shard(
    shard: str, fmt: str, key: str, fo: BinaryIO, fr: BinaryIO, expected: Expected | None = None
) -> dict:
    """Validate one shard, writing accepted lines to ``fo`` and quarantined ones to ``fr``.

    Returns this shard's counts: lines, documents, bytes in/out, rejections by
    reason, the compression found and what was repaired (BOMs, line endings).
    Raises DamagedShardError / ManifestMismatchError naming the shard.
    """
    if expected is not None:
        check_against_manifest(shard, expected)
    elif not os.path.isfile(shard):
        raise FileNotFoundError(f"shard not found: {shard}")
    reasons: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    lines = docs = bytes_in = bytes_out = 0
    dumps, loads, JSONDecodeError = orjson.dumps, orjson.loads, orjson.JSONDecodeError
    comp = detect_compression(shard, fmt)

    def reject(lineno: int, reason: str, raw: bytes, **extra: object) -> None:
        reasons[reason] += 1
        rec = {
            "shard": shard,
            "line": lineno,
            "reason": reason,
            **extra,
            "content": raw.decode("utf-8", "backslashreplace"),
        }
        fr.write(dumps(rec) + b"\n")

    if fmt.startswith("jsonl"):
        for lineno, line in enumerate(shard_lines(shard, fmt, comp), start=1):
            lines += 1
            bytes_in += len(line)
            if line.startswith(BOM):  # a file exported on Windows (or several of them concatenated)
                line = line[3:]
                counts["boms_stripped"] += 1
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
                    counts["line_endings_normalized"] += 1
                fo.write(line)
                bytes_out += len(line)
                docs += 1
    elif fmt == "mediawiki":
        from snakellm.data.mediawiki import iter_pages  # mwparserfromhell only where it is needed

        for page in iter_pages(shard, comp):
            lines += 1
            bytes_in += page.bytes_in
            if page.skip:
                skipped[page.skip] += 1
                continue
            if not page.text.strip():
                reject(page.number, "empty_text", page.wikitext.encode(), title=page.title, id=page.id)
                continue
            rec = dumps({key: page.text, "title": page.title, "id": page.id}) + b"\n"
            fo.write(rec)
            bytes_out += len(rec)
            docs += 1
    else:
        for lineno, raw in _text_documents(shard, fmt, counts):
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
    res = {
        "shard": shard,
        "compression": comp,
        "lines": lines,
        "documents": docs,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "reasons": dict(reasons),
        "skipped": dict(skipped),
        **counts,
    }
    if expected is not None:
        res["sha256"] = expected.sha256  # checked above
    return res


def _shard_to_parts(job: tuple[str, str, str, str, str, Expected | None]) -> dict:
    """Worker: one shard into its own part files (concatenated in shard order afterwards)."""
    shard, fmt, key, part_out, part_rej, exp = job
    with open(part_out, "wb", buffering=1 << 22) as fo, open(part_rej, "wb") as fr:
        return _process_shard(shard, fmt, key, fo, fr, exp)


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
    expected: dict[str, Expected] | None = None,
) -> dict:
    """Concatenate and validate ``shards`` into ``out``; return the stats dict.

    With ``workers > 1`` shards are validated in parallel processes, each into
    hidden part files next to the output, which are then appended in shard order:
    the output is byte-identical to the sequential one. ``expected`` maps a
    downloaded shard to what its manifest recorded; it is checked before the
    shard is read.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out_p = Path(out)
    rej_p = Path(rejected) if rejected else out_p.with_name(out_p.name.removesuffix(".jsonl") + ".rejected.jsonl")
    stats_p = Path(stats) if stats else out_p.with_name(out_p.name.removesuffix(".jsonl") + ".stats.json")
    expected = expected or {}
    for s in shards:
        if not os.path.isfile(s) and s not in expected:
            raise FileNotFoundError(f"shard not found: {s}")

    t0 = time.perf_counter()
    total_size = sum(os.path.getsize(s) if os.path.isfile(s) else expected[s].size for s in shards)
    per_shard: list[dict] = []
    workers = max(1, min(workers, len(shards)))

    with atomic_group(out_p, rej_p, stats_p) as (tmp_out, tmp_rej, tmp_stats):
        with (
            open(tmp_out, "wb", buffering=1 << 22) as fo,
            open(tmp_rej, "wb") as fr,
            progress(
                total=total_size, unit="B", unit_scale=True, desc=f"chunk {source}/{chunk}", enabled=show_progress
            ) as bar,
        ):
            if workers == 1:
                for shard in shards:
                    per_shard.append(_process_shard(shard, fmt, key, fo, fr, expected.get(shard)))
                    bar.update(os.path.getsize(shard))
            else:
                parts = [(f"{tmp_out}.{i}.part", f"{tmp_rej}.{i}.part") for i in range(len(shards))]
                jobs = [(s, fmt, key, po, pr, expected.get(s)) for s, (po, pr) in zip(shards, parts, strict=True)]
                try:
                    with ProcessPoolExecutor(workers) as pool:
                        # map() yields in shard order; parts are appended as soon as their turn comes
                        for (po, pr), res in zip(parts, pool.map(_shard_to_parts, jobs), strict=True):
                            _append_file(po, fo)
                            _append_file(pr, fr)
                            per_shard.append(res)
                            bar.update(os.path.getsize(res["shard"]) if os.path.isfile(res["shard"]) else 0)
                finally:
                    for po, pr in parts:
                        for p in (po, pr):
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(p)

        reasons: Counter[str] = Counter()
        skipped: Counter[str] = Counter()
        repaired: Counter[str] = Counter()
        for r in per_shard:
            shard_reasons = r.pop("reasons")
            reasons.update(shard_reasons)
            r["rejected"] = sum(shard_reasons.values())
            skipped.update(r["skipped"])
            if not r["skipped"]:
                del r["skipped"]
            repaired.update({k: r[k] for k in ("boms_stripped", "line_endings_normalized") if k in r})
        declared = {s: compression_of(s, fmt) for s in shards}
        mismatched = [r["shard"] for r in per_shard if r["compression"] != declared[r["shard"]]]
        for s in mismatched[:10]:
            print(
                f"snakellm chunk: note: {s} is {next(r['compression'] for r in per_shard if r['shard'] == s)}, "
                f"not {declared[s]} as format {fmt} and its name say; read as what it is",
                file=sys.stderr,
            )
        lines_read = sum(r["lines"] for r in per_shard)
        docs = sum(r["documents"] for r in per_shard)
        bytes_in = sum(r.pop("bytes_in") for r in per_shard)
        bytes_out = sum(r.pop("bytes_out") for r in per_shard)

        # Verification: what is on disk must account for every line read.
        written = _count_lines(tmp_out)
        quarantined = _count_lines(tmp_rej)
        n_rej = sum(reasons.values())
        n_skip = sum(skipped.values())
        if written != docs or quarantined != n_rej or docs + n_rej + n_skip != lines_read:
            raise VerificationError(
                f"chunk {out}: read {lines_read} lines but wrote {written} documents "
                f"(counted {docs}), {quarantined} rejected (counted {n_rej}) and skipped {n_skip}"
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
            "skipped": n_skip,  # mediawiki: redirects and pages outside the article namespace
            "skipped_by_reason": dict(sorted(skipped.items())),
            "boms_stripped": repaired["boms_stripped"],
            "line_endings_normalized": repaired["line_endings_normalized"],
            "compression": dict(sorted(Counter(r["compression"] for r in per_shard).items())),
            "compression_mismatches": len(mismatched),
            "bytes_in_compressed": total_size,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "seconds": round(seconds, 3),
            "mb_per_s": round(bytes_in / 1e6 / seconds, 1) if seconds > 0 else None,
            "per_shard": per_shard,
        }
        tmp_stats.write_text(json.dumps(result, indent=2) + "\n")
    return result


def read_shard_list(path: str) -> list[str]:
    """A shard list file: one path per line (blank lines and ``#`` comments ignored).

    The workflow passes shard lists this way: a chunk of thousands of shards
    does not fit in one command-line argument (Linux caps one at 128 KiB).
    """
    with open(path, encoding="utf-8") as fh:
        return [s for s in (line.rstrip("\n") for line in fh) if s.strip() and not s.startswith("#")]


def _read_manifest(path: str) -> list[tuple[str, Expected | None]]:
    """The shards a download manifest lists, each with the size and sha256 recorded for it."""
    with open(path) as fh:
        man = json.load(fh)
    base = Path(path).parent
    out: list[tuple[str, Expected | None]] = []
    for s in man["shards"]:
        p = s["path"] if os.path.isabs(s["path"]) else str(base / s["path"])
        exp = Expected(int(s["size"]), s["sha256"], s.get("url", "")) if "sha256" in s and "size" in s else None
        out.append((p, exp))
    return out
