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
import io
import json
import os
import shutil
import stat as statmod
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import orjson

from snakellm.config.sections import COLUMNAR_FORMATS, SOURCE_FORMATS
from snakellm.data import columnar_jsonl as cj
from snakellm.data.columnar_jsonl import jsonable as _jsonable
from snakellm.data.planning import describe, shard_identity, split_slice
from snakellm.errors import DataError, StepFailed
from snakellm.io.atomic import atomic_group
from snakellm.io.progress import progress
from snakellm.io.readers import (
    BOM,
    DamagedShardError,
    HashingFile,
    TooLong,
    compression_of,
    detect_compression,
    display,
    shard_lines,
)

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
    "too_long",
    # parquet, arrow, warc (docs/data.md)
    "null_text",
    "unreadable_file",
    "damaged_file",
    "extraction_failed",
)


class VerificationError(StepFailed):
    """What the job wrote does not account for every line it read."""


class ManifestMismatchError(DataError):
    """A downloaded shard that is not what its manifest recorded (or is gone)."""


class ShardFileError(DataError):
    """A local shard that cannot be read: not found, not a regular file, no permission, changed while read."""


class RejectedFractionError(DataError):
    """A shard whose share of rejected lines is past ``max_rejected_fraction``: likely not the declared format."""


_KINDS = (
    (statmod.S_ISDIR, "a directory"),
    (statmod.S_ISFIFO, "a FIFO (named pipe)"),
    (statmod.S_ISCHR, "a character device"),
    (statmod.S_ISBLK, "a block device"),
    (statmod.S_ISSOCK, "a socket"),
)


def stat_shard(shard: str) -> os.stat_result:
    """The stat of a local shard, or ShardFileError saying exactly what is wrong with it (never just "not found")."""
    try:
        st = os.stat(shard)
    except FileNotFoundError:
        raise ShardFileError(f"shard not found: {display(shard)}") from None
    except OSError as e:
        raise ShardFileError(f"shard {display(shard)}: cannot stat it: {e.strerror}") from None
    if not statmod.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise ShardFileError(f"shard {display(shard)} is {kind}, not a regular file")
    return st


def open_local(shard: str) -> HashingFile:
    """Open a shard for reading, hashing it as it is read; PermissionError and the like named as such."""
    try:
        return HashingFile(shard)
    except PermissionError:
        raise ShardFileError(f"shard {display(shard)} cannot be read: permission denied") from None
    except OSError as e:
        raise ShardFileError(f"shard {display(shard)} cannot be read: {e.strerror}") from None


@dataclass(frozen=True)
class Expected:
    """What the download manifest recorded for a shard."""

    size: int
    sha256: str
    url: str = ""


def _sidecars(path: str) -> list[str]:
    return [path + ".meta.json"]


def check_against_manifest(shard: str, exp: Expected, hash_it: bool = True) -> None:
    """Size, then (``hash_it``) sha256, of a downloaded shard against its manifest, before it is read.

    A shard that does not match is removed (with its download sidecar): the
    workflow sees the missing shard at the next start and runs the chunk's
    download again, which fetches just that shard. Failing forever on a damaged
    copy would need a hand-made fix. The chunk job itself passes
    ``hash_it=False`` and compares the sha256 it computes while reading.
    """
    where = f" ({exp.url})" if exp.url else ""
    if not os.path.isfile(shard):
        raise ManifestMismatchError(
            f"shard {display(shard)}{where} listed in the manifest is missing (deleted after the download?); "
            "run again: the next run downloads it again"
        )
    size = os.path.getsize(shard)
    if size != exp.size:
        problem = f"is {size} bytes, the manifest recorded {exp.size}"
    else:
        if not hash_it:
            return
        h = hashlib.sha256()
        with open(shard, "rb") as fh:
            while buf := fh.read(1 << 22):
                h.update(buf)
        if h.hexdigest() == exp.sha256:
            return
        problem = f"has sha256 {h.hexdigest()}, the manifest recorded {exp.sha256}"
    removed = _remove_download(shard) if exp.url else ""
    raise ManifestMismatchError(f"shard {display(shard)}{where} {problem}{removed}")


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


def _text_documents(
    path: str, fmt: str, counts: Counter[str], raw: io.RawIOBase, comp: str, max_doc: int | None
) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of the documents of a plain-text shard (a leading BOM dropped).

    Read line by line with the same limit as jsonl: a document past
    ``max_doc`` bytes comes out as a :class:`TooLong` head, never held whole.
    """
    limit = max_doc if max_doc is not None else 1 << 62
    block: list[bytes] = []
    size = dropped = 0  # bytes of the current document (held, and dropped beyond the limit)
    start = 1
    lineno = 0
    for lineno, line in enumerate(shard_lines(path, fmt, comp, raw, max_line=max_doc), start=1):
        if lineno == 1 and line.startswith(BOM) and type(line) is bytes:
            line = line[len(BOM) :]
            counts["boms_stripped"] += 1
        n = line.size if type(line) is TooLong else len(line)
        if fmt == "text-blocks" and not line.strip() and type(line) is bytes:
            if block or dropped:
                yield start, _document(block, size, dropped)
            block, size, dropped = [], 0, 0
            continue
        if not block and not dropped:
            start = lineno
        if dropped or size + n > limit or type(line) is TooLong:
            if not dropped:  # past the limit: keep the head, count the rest
                block, dropped, size = [(b"".join(block) + bytes(line[:1024]))[:1024]], size + n, 0
            else:
                dropped += n
            continue
        block.append(line)
        size += n
    if block or dropped or (fmt == "text" and lineno == 0):
        yield start, _document(block, size, dropped)


def _document(block: list[bytes], size: int, dropped: int) -> bytes:
    """The document of a text shard: its bytes, or a TooLong head once it passed the limit."""
    if dropped:
        return TooLong(block[0], dropped)
    return b"".join(block)


def _count_lines(path: Path) -> int:
    n = 0
    last = b"\n"
    with open(path, "rb") as fh:
        while buf := fh.read(1 << 24):
            n += buf.count(b"\n")
            last = buf[-1:]
    return n + (last != b"\n")


@dataclass(frozen=True)
class Fields:
    """What a columnar shard's record keeps (``sources.<name>.id_key`` / ``columns``; None: every column)."""

    id_key: str = "id"
    columns: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Limits:
    """Per-source limits (``sources.<name>.max_document_bytes`` / ``max_rejected_fraction``; None: none)."""

    max_document_bytes: int | None = None
    max_rejected_fraction: float | None = None


ALARM_MIN_LINES = 10  # a shard this short is judged by its lines alone, never by the fraction


class _Tally:
    """The counts of one shard, and its quarantine writer."""

    def __init__(self, shard: str, fr: BinaryIO) -> None:
        # orjson refuses lone surrogates: a name with undecodable bytes is recorded with \xNN escapes
        self.label = shard.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        self.fr = fr
        self.reasons: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.lines = self.docs = self.bytes_in = self.bytes_out = 0
        self.buf = bytearray()  # the columnar batches' jsonl, reused batch after batch (columnar_jsonl.records)

    def reject(self, lineno: int, reason: str, raw: bytes, **extra: object) -> None:
        self.reasons[reason] += 1
        if type(raw) is TooLong:
            extra = {**extra, "bytes": raw.size, "content_truncated_to": len(raw)}
        rec = {
            "shard": self.label,
            "line": lineno,
            "reason": reason,
            **extra,
            "content": raw.decode("utf-8", "backslashreplace"),
        }
        self.fr.write(orjson.dumps(rec) + b"\n")

    def reject_at(self, where: dict, reason: str, content: str, **extra: object) -> None:
        """Quarantine a record that is no line (a parquet row, a WARC record): ``where`` says which."""
        self.reasons[reason] += 1
        rec = {"shard": self.label, **where, "reason": reason, **extra, "content": content}
        self.fr.write(orjson.dumps(rec, default=_jsonable) + b"\n")


def _jsonl_lines(t: _Tally, lines: Iterator[bytes], key: str, fo: BinaryIO) -> None:
    """Validate jsonl lines into ``fo`` (accepted, as read) and the quarantine (everything else)."""
    loads, JSONDecodeError = orjson.loads, orjson.JSONDecodeError
    reject, counts = t.reject, t.counts
    for lineno, line in enumerate(lines, start=1):
        t.lines += 1
        if type(line) is TooLong:  # longer than max_document_bytes: only its head was kept
            t.bytes_in += line.size
            reject(lineno, "too_long", line)
            continue
        t.bytes_in += len(line)
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
            t.bytes_out += len(line)
            t.docs += 1


def _mediawiki_pages(t: _Tally, shard: str, raw: io.RawIOBase, comp: str, key: str, fo: BinaryIO, lim: Limits) -> None:
    from snakellm.data.mediawiki import iter_pages  # mwparserfromhell only where it is needed

    for page in iter_pages(shard, comp, raw=raw, max_page_bytes=lim.max_document_bytes):
        t.lines += 1
        t.bytes_in += page.bytes_in
        if page.skip:
            t.skipped[page.skip] += 1
            continue
        if not page.text.strip():
            t.reject(page.number, "empty_text", page.wikitext.encode(), title=page.title, id=page.id)
            continue
        rec = orjson.dumps({key: page.text, "title": page.title, "id": page.id}) + b"\n"
        fo.write(rec)
        t.bytes_out += len(rec)
        t.docs += 1


def _text_shard(
    t: _Tally, shard: str, fmt: str, raw: io.RawIOBase, comp: str, key: str, fo: BinaryIO, lim: Limits
) -> None:
    for lineno, doc in _text_documents(shard, fmt, t.counts, raw, comp, lim.max_document_bytes):
        t.lines += 1
        if type(doc) is TooLong:
            t.bytes_in += doc.size
            t.reject(lineno, "too_long", doc)
            continue
        t.bytes_in += len(doc)
        try:
            text = doc.decode("utf-8")
        except UnicodeDecodeError:
            t.reject(lineno, "invalid_utf8", doc)
            continue
        if not text.strip():
            t.reject(lineno, "empty_text", doc)
            continue
        rec = orjson.dumps({key: text}) + b"\n"
        fo.write(rec)
        t.bytes_out += len(rec)
        t.docs += 1


def _columnar_shard(
    t: _Tally, entry: str, fmt: str, key: str, fo: BinaryIO, lim: Limits, fields: Fields, downloaded: bool
) -> dict:
    """The rows of a parquet file (or of a row-group slice of one) or an Arrow shard as jsonl records.

    Each record: the text under ``key``, ``id`` (the ``id_key`` column; ``{shard}/{row}`` where the file has none,
    as datatrove does), then the other columns (``columns``: only those). A file that cannot be opened (no footer)
    is quarantined as one ``unreadable_file`` record; one damaged past its start fails the job naming it.
    """
    from snakellm.data import columnar as col

    path, units = split_slice(entry)
    try:
        c = col.open_columnar(path, fmt)
    except DamagedShardError as e:
        if downloaded:
            raise
        t.lines += 1
        t.reject_at({"row_groups": list(units) if units else None}, "unreadable_file", str(e))
        print(f"snakellm chunk: warning: {e}; quarantined as unreadable_file", file=sys.stderr)
        return {"schema": None}
    try:
        col.check_columns(c, key, list(fields.columns) if fields.columns is not None else None)
        names = c.names
        id_key = fields.id_key
        keep = [n for n in (fields.columns if fields.columns is not None else names) if n not in (key, id_key)]
        if "id" in keep:
            raise col.ColumnError(
                f"{display(path)}: column 'id' would overwrite the record's id (id_key is {id_key!r}); "
                "list the columns to keep (sources.NAME.columns) without it"
            )
        has_id = id_key in names
        read = [key, *([id_key] if has_id else []), *keep]
        shape = _Shape(fmt, key, read, keep, has_id, lim.max_document_bytes)
        last_unit, row = -1, 0
        for unit, batch in c.batches(read, units):
            if fmt == "parquet" and unit != last_unit:
                row, last_unit = c.offsets[unit], unit
            t.bytes_in += batch.nbytes
            if not (cj.AVAILABLE and _arrow_batch(t, batch, shape, unit, row, fo)):
                _python_batch(t, batch, shape, unit, row, fo)
            row += batch.num_rows
        return {"schema": col.schema_of(c)}
    finally:
        c.close()


@dataclass(frozen=True)
class _Shape:
    """What a columnar shard's batches hold: the columns read (text, id, kept) and the record's shape."""

    fmt: str
    key: str
    read: list[str]
    keep: list[str]
    has_id: bool
    limit: int | None


def _where(shape: _Shape, unit: int, r: int) -> dict:
    return {"row": r, **({"row_group": unit} if shape.fmt == "parquet" else {"batch": unit})}


def _reject_row(t: _Tally, shape: _Shape, where: dict, rec_all: dict, reason: str) -> None:
    """Quarantine one row that is no document (null, not a string, empty, too long), as both paths do."""
    text = rec_all[shape.key]
    if reason == "too_long":
        size = len(text.encode("utf-8"))
        t.reject_at(where, "too_long", text[:1024], bytes=size, content_truncated_to=1024)
    else:
        t.reject_at(where, reason, orjson.dumps(rec_all, default=_jsonable).decode())


def _python_batch(t: _Tally, batch, shape: _Shape, unit: int, row: int, fo: BinaryIO) -> None:
    """One batch's records through Python values and orjson (no C writer, or a text column of another type)."""
    read, keep, limit, key = shape.read, shape.keep, shape.limit, shape.key
    try:
        cols, bad = [batch.column(j).to_pylist() for j in range(len(read))], {}
    except UnicodeDecodeError:  # pyarrow does not check UTF-8: find the rows
        bad = _invalid_utf8_rows(batch, shape)
        cols = [[None if i in bad else v.as_py() for i, v in enumerate(batch.column(j))] for j in range(len(read))]
    texts, ids, others = cols[0], cols[1] if shape.has_id else None, cols[1 + shape.has_id :]
    dumps, label, write = orjson.dumps, t.label, fo.write
    for i, text in enumerate(texts):
        r = row + i
        t.lines += 1
        if i in bad:
            _reject_utf8(t, batch, shape, _where(shape, unit, r), i, bad[i])
            continue
        if (
            type(text) is not str
            or not text
            or text.isspace()
            or (limit is not None and len(text) * 4 > limit and len(text.encode("utf-8")) > limit)
        ):
            rec_all = {n: v[i] for n, v in zip(read, cols, strict=True)}
            if text is None:
                reason = "null_text"
            elif type(text) is not str:
                reason = "not_string"
            elif not text or text.isspace():
                reason = "empty_text"
            else:
                reason = "too_long"
            _reject_row(t, shape, _where(shape, unit, r), rec_all, reason)
            continue
        doc_id = ids[i] if ids is not None else None
        if doc_id is None:
            doc_id = f"{label}/{r}"
            t.counts["ids_generated"] += 1
        rec = {key: text, "id": doc_id}
        for name, v in zip(keep, others, strict=True):
            rec[name] = v[i]
        line = dumps(rec, default=_jsonable, option=orjson.OPT_APPEND_NEWLINE)
        write(line)
        t.bytes_out += len(line)
        t.docs += 1


def _invalid_utf8_rows(batch, shape: _Shape) -> dict[int, str]:
    """Row -> the first column whose string is not UTF-8 there (pyarrow does not check it)."""
    bad: dict[int, str] = {}
    for name, arr in zip(shape.read, batch.columns, strict=True):
        if cj.strings(arr) is None:
            continue
        for i, v in enumerate(arr):
            if i not in bad:
                try:
                    v.as_py()
                except UnicodeDecodeError:
                    bad[i] = name
    return bad


def _reject_utf8(t: _Tally, batch, shape: _Shape, where: dict, i: int, name: str) -> None:
    """Quarantine a row whose string in column ``name`` is not UTF-8, that string's bytes \\xNN-escaped."""
    import pyarrow as pa

    raw = batch.column(shape.read.index(name)).cast(pa.binary())[i].as_py()
    t.reject_at(where, "invalid_utf8", raw.decode("utf-8", "backslashreplace"), column=name)


def _arrow_batch(t: _Tally, batch, shape: _Shape, unit: int, row: int, fo: BinaryIO) -> bool:
    """One batch's records by the C writer (:mod:`snakellm.data.columnar_jsonl`), byte for byte what
    :func:`_python_batch` writes; False (nothing done) when its text column holds no strings."""
    texts = cj.strings(batch.column(0))
    if texts is None or shape.key == "id":
        return False
    n = batch.num_rows
    codes = cj.text_codes(texts, shape.limit)
    names = [shape.key, shape.read[1] if shape.has_id else "id", *shape.keep]
    first, *rest = [orjson.dumps(k) for k in [shape.key, "id", *shape.keep]]
    prefixes = [b"{" + first + b":", *(b"," + k + b":" for k in rest)]
    id_col, generated = _ids(t, batch, shape, row, prefixes[1])
    columns = [cj.column(prefixes[0], texts), id_col]
    columns += [cj.column(p, batch.column(1 + shape.has_id + j)) for j, p in enumerate(prefixes[2:])]
    bad: dict[int, str] = {}
    while True:
        try:
            out = cj.records(n, columns, codes, t.buf)
            break
        except cj.InvalidUTF8 as e:  # quarantined below; the batch is written again without that row
            j, i = e.args
            bad[i], codes[i] = names[j], 255
    t.lines += n
    for i in np.flatnonzero(codes).tolist():
        where = _where(shape, unit, row + i)
        if i in bad:
            _reject_utf8(t, batch, shape, where, i, bad[i])
            continue
        try:
            rec_all = batch.slice(i, 1).to_pylist()[0]
        except UnicodeDecodeError:  # another of its columns is not UTF-8: that is its reason, as on the other path
            _reject_utf8(t, batch, shape, where, i, _invalid_utf8_rows(batch.slice(i, 1), shape)[0])
            continue
        reason = {cj.NULL: "null_text", cj.EMPTY: "empty_text", cj.TOO_LONG: "too_long"}[int(codes[i])]
        _reject_row(t, shape, where, rec_all, reason)
    if generated is not None:
        t.counts["ids_generated"] += int(np.count_nonzero(generated & (codes == 0)))
    with out:
        fo.write(out)
        t.bytes_out += len(out)
    t.docs += n - int(np.count_nonzero(codes))
    return True


def _ids(t: _Tally, batch, shape: _Shape, row: int, prefix: bytes) -> tuple[tuple, np.ndarray | None]:
    """The id column for the C writer, and which rows got a generated ``{shard}/{row}`` id (None: none)."""
    import pyarrow as pa

    n = batch.num_rows
    if not shape.has_id:
        gen = pa.array([f"{t.label}/{row + i}" for i in range(n)], type=pa.string())
        return cj.column(prefix, gen), np.ones(n, dtype=bool)
    ids = batch.column(1)
    if not ids.null_count:
        return cj.column(prefix, ids), None
    nulls = ids.is_null().to_numpy(zero_copy_only=False)
    py = ids.to_pylist()
    for i in np.flatnonzero(nulls).tolist():
        py[i] = f"{t.label}/{row + i}"
    return cj.column(prefix, ids, py), nulls


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while buf := fh.read(1 << 22):
            h.update(buf)
    return h.hexdigest()


def _remove_download(shard: str) -> str:
    """Remove a downloaded shard (and its sidecar) so that the next run fetches it again."""
    for p in [shard, *_sidecars(shard)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    return "; removed it: the next run downloads it again"


def _read_columnar(
    t: _Tally, entry: str, fmt: str, key: str, fo: BinaryIO, lim: Limits, fields: Fields, exp: Expected | None
) -> dict:
    """A parquet/Arrow shard (or row-group slice) read by pyarrow; its identity, sha256 (of the slice) and schema."""
    from snakellm.data.columnar import content_digest

    path, units = split_slice(entry)
    before = stat_shard(path)
    try:
        got = _columnar_shard(t, entry, fmt, key, fo, lim, fields, exp is not None)
    except DamagedShardError as e:
        if exp is None:
            raise
        raise DamagedShardError(f"{e} (downloaded from {exp.url}){_remove_download(path)}") from None
    # a download is checked against its manifest's sha256; a local file gets the cheaper content digest
    digest = _sha256_file(path) if exp is not None else content_digest(path, units)
    after = stat_shard(path)
    was, now = shard_identity(before), shard_identity(after)
    if was != now:
        diff = ", ".join(f"{k} {was[k]} -> {v}" for k, v in now.items() if was[k] != v)
        raise ShardFileError(f"shard {describe(entry)} changed while it was read ({diff}): run again")
    if exp is not None and digest != exp.sha256:
        raise ManifestMismatchError(
            f"shard {display(path)} ({exp.url}) has sha256 {digest}, the manifest recorded {exp.sha256}"
            f"{_remove_download(path)}"
        )
    if exp is not None:
        return {"compression": "none", "stat": was, "sha256": digest, **got}
    return {"compression": "none", "stat": was, "digest": digest, **got}


def _read_shard(
    t: _Tally, shard: str, fmt: str, key: str, fo: BinaryIO, lim: Limits, exp: Expected | None, fields: Fields
) -> dict:
    """Read one shard through to its last byte; return its compression, identity and sha256."""
    if fmt in COLUMNAR_FORMATS:
        return _read_columnar(t, shard, fmt, key, fo, lim, fields, exp)
    if fmt == "warc":
        from snakellm.data.warc import read_warc

        return read_warc(t, shard, key, fo, exp)
    before = stat_shard(shard)
    with open_local(shard) as raw:
        try:
            comp = detect_compression(shard, fmt)
            if fmt.startswith("jsonl"):
                _jsonl_lines(t, shard_lines(shard, fmt, comp, raw, lim.max_document_bytes), key, fo)
            elif fmt == "mediawiki":
                _mediawiki_pages(t, shard, raw, comp, key, fo, lim)
            else:
                _text_shard(t, shard, fmt, raw, comp, key, fo, lim)
        except DamagedShardError as e:
            if exp is None:
                raise
            # a download that is damaged: fetch it again next time, even when its sha256 is the
            # manifest's (the server sent a damaged file, or an error page, with a 200)
            digest = raw.hexdigest()
            if digest != exp.sha256:
                raise ManifestMismatchError(
                    f"shard {display(shard)} ({exp.url}) has sha256 {digest}, the manifest recorded "
                    f"{exp.sha256}{_remove_download(shard)}"
                ) from None
            raise DamagedShardError(f"{e} (downloaded from {exp.url}){_remove_download(shard)}") from None
        digest = raw.hexdigest()
    after = stat_shard(shard)
    was, now = shard_identity(before), shard_identity(after)
    if was != now:
        diff = ", ".join(f"{k} {was[k]} -> {v}" for k, v in now.items() if was[k] != v)
        raise ShardFileError(
            f"shard {display(shard)} changed while it was read ({diff}): its documents may be a mix; run again"
        )
    if exp is not None and digest != exp.sha256:
        raise ManifestMismatchError(
            f"shard {display(shard)} ({exp.url}) has sha256 {digest}, the manifest recorded {exp.sha256}"
            f"{_remove_download(shard)}"
        )
    return {"compression": comp, "stat": was, "sha256": digest}


def _alarm(t: _Tally, shard: str, fmt: str, lim: Limits) -> None:
    """Fail on a shard whose lines are mostly rejected: likely an HTML page or another format saved under this name."""
    frac = lim.max_rejected_fraction
    rejected = sum(t.reasons.values())
    if frac is None or t.lines < ALARM_MIN_LINES or rejected <= frac * t.lines:
        return
    top, n = t.reasons.most_common(1)[0]
    raise RejectedFractionError(
        f"shard {display(shard)}: {rejected} of {t.lines} lines rejected ({rejected / t.lines:.0%}; "
        f"most as {top}: {n}), more than max_rejected_fraction {frac:g}: is it really {fmt}? "
        "(a source that expects this sets max_rejected_fraction: 1)"
    )


def _process_shard(
    shard: str,
    fmt: str,
    key: str,
    fo: BinaryIO,
    fr: BinaryIO,
    expected: Expected | None = None,
    limits: Limits = Limits(),
    fields: Fields = Fields(),
) -> dict:
    """Validate one shard, writing accepted lines to ``fo`` and quarantined ones to ``fr``.

    Returns this shard's counts: lines, documents, bytes in/out, rejections by
    reason, the compression found, what was repaired (BOMs, line endings) and
    its identity (size, mtime_ns, ctime_ns, inode, as the planner compares
    them at every start; sha256). Raises ShardFileError / DamagedShardError /
    ManifestMismatchError / RejectedFractionError naming the shard.
    """
    if expected is not None:
        check_against_manifest(shard, expected, hash_it=False)
    path, units = split_slice(shard)
    t = _Tally(path, fr)
    ident = _read_shard(t, shard, fmt, key, fo, limits, expected, fields)
    _alarm(t, shard, fmt, limits)
    extra = {"row_groups": list(units)} if units is not None else {}
    if "schema" in ident:
        extra["schema"] = ident["schema"]
    return {
        "shard": path,
        **extra,
        "compression": ident["compression"],
        "lines": t.lines,
        "documents": t.docs,
        "bytes_in": t.bytes_in,
        "bytes_out": t.bytes_out,
        "reasons": dict(t.reasons),
        "skipped": dict(t.skipped),
        **t.counts,
        "stat": ident["stat"],
        **({"sha256": ident["sha256"]} if "sha256" in ident else {"digest": ident["digest"]}),
    }


def _shard_to_parts(job: tuple[str, str, str, str, str, Expected | None, Limits, Fields]) -> dict:
    """Worker: one shard into its own part files (concatenated in shard order afterwards)."""
    shard, fmt, key, part_out, part_rej, exp, limits, fields = job
    with open(part_out, "wb", buffering=1 << 22) as fo, open(part_rej, "wb") as fr:
        return _process_shard(shard, fmt, key, fo, fr, exp, limits, fields)


def _append_file(src: str, dst: BinaryIO) -> None:
    with open(src, "rb") as fh:
        shutil.copyfileobj(fh, dst, 1 << 22)
    os.unlink(src)


def _shards_in_parallel(
    jobs: list[tuple[str, str, str, Expected | None, Limits, Fields]],
    workers: int,
    tmp_out: str,
    tmp_rej: str,
    fo: BinaryIO,
    fr: BinaryIO,
) -> Iterator[dict]:
    """Each shard's record, in shard order, its part files appended to ``fo``/``fr`` as soon as its turn comes.

    Workers write hidden part files next to the output so the result is byte-identical to the
    sequential run; the parts are removed whatever happens.
    """
    parts = [(f"{tmp_out}.{i}.part", f"{tmp_rej}.{i}.part") for i in range(len(jobs))]
    full = [
        (s, fmt, key, po, pr, exp, limits, fields)
        for (s, fmt, key, exp, limits, fields), (po, pr) in zip(jobs, parts, strict=True)
    ]
    try:
        with ProcessPoolExecutor(workers) as pool:
            # map() yields in shard order; parts are appended as soon as their turn comes
            for (po, pr), res in zip(parts, pool.map(_shard_to_parts, full), strict=True):
                _append_file(po, fo)
                _append_file(pr, fr)
                yield res
    finally:
        for po, pr in parts:
            for p in (po, pr):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)


def _sum_shard_counts(per_shard: list[dict]) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Rejected, skipped and repaired counts over all shards; each shard's record keeps only its totals.

    (Per-shard reasons would repeat the chunk's table once per shard in the stats file.)
    """
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
    return reasons, skipped, repaired


def _note_compression_mismatches(shards: list[str], per_shard: list[dict], fmt: str) -> list[str]:
    """Shards whose bytes are not the compression their name and format declare, with a note for the first 10.

    They are read as what they are; the note tells the user the source's config or names are off.
    """
    declared = {split_slice(s)[0]: compression_of(split_slice(s)[0], fmt) for s in shards}
    mismatched = [r["shard"] for r in per_shard if r["compression"] != declared[r["shard"]]]
    for s in mismatched[:10]:
        print(
            f"snakellm chunk: note: {display(s)} is {next(r['compression'] for r in per_shard if r['shard'] == s)}, "
            f"not {declared[s]} as format {fmt} and its name say; read as what it is",
            file=sys.stderr,
        )
    return mismatched


def _columnar_stats(per_shard: list[dict], fmt: str) -> dict:
    """parquet/arrow: ids made up for rows without one, and files whose schema is not the chunk's first file's
    (each named with the columns added, removed or retyped: their records carry other fields)."""
    if fmt not in COLUMNAR_FORMATS:
        return {}
    from snakellm.data.columnar import schema_diff

    changes = []
    first: dict | None = None
    for r in per_shard:
        sch = r.get("schema")
        if sch is None:
            continue
        if first is None:
            first = sch
            continue
        if sch != first:
            changes.append({"shard": r["shard"], **schema_diff(first, sch)})
    for ch in changes[:10]:
        print(f"snakellm chunk: note: {display(ch['shard'])} has another schema than the chunk's first file: {ch}")
    return {"ids_generated": sum(r.get("ids_generated", 0) for r in per_shard), "schema_changes": changes}


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
    limits: Limits = Limits(),
    fields: Fields = Fields(),
) -> dict:
    """Concatenate and validate ``shards`` into ``out``; return the stats dict.

    With ``workers > 1`` shards are validated in parallel processes, each into
    hidden part files next to the output, which are then appended in shard order:
    the output is byte-identical to the sequential one. ``expected`` maps a
    downloaded shard to what its manifest recorded; it is checked before the
    shard is read. ``limits`` caps documents and the share of rejected lines per shard.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out_p = Path(out)
    rej_p = Path(rejected) if rejected else out_p.with_name(out_p.name.removesuffix(".jsonl") + ".rejected.jsonl")
    stats_p = Path(stats) if stats else out_p.with_name(out_p.name.removesuffix(".jsonl") + ".stats.json")
    expected = expected or {}
    sizes = {s: expected[s].size if s in expected else stat_shard(split_slice(s)[0]).st_size for s in shards}

    t0 = time.perf_counter()
    total_size = sum(sizes.values())
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
                    per_shard.append(_process_shard(shard, fmt, key, fo, fr, expected.get(shard), limits, fields))
                    bar.update(sizes[shard])
            else:
                jobs = [(s, fmt, key, expected.get(s), limits, fields) for s in shards]
                for shard, res in zip(shards, _shards_in_parallel(jobs, workers, str(tmp_out), str(tmp_rej), fo, fr)):
                    per_shard.append(res)
                    bar.update(sizes[shard])

        reasons, skipped, repaired = _sum_shard_counts(per_shard)
        mismatched = _note_compression_mismatches(shards, per_shard, fmt)
        lines_read = sum(r["lines"] for r in per_shard)
        docs = sum(r["documents"] for r in per_shard)
        bytes_in = sum(r.pop("bytes_in") for r in per_shard)
        bytes_out = sum(r.pop("bytes_out") for r in per_shard)

        # Verification: what is on disk must account for every line read.
        written = _written_documents(tmp_out, out, fmt, docs, bytes_out)
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
            **_columnar_stats(per_shard, fmt),
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


def _written_documents(tmp_out: Path, out: str, fmt: str, docs: int, bytes_out: int) -> int:
    """The documents the chunk file holds (its lines); a columnar or WARC chunk's size must be its records' sum."""
    if fmt in COLUMNAR_FORMATS or fmt == "warc":
        # every record is one orjson line (JSON has no raw newline): the file's size must be their sum
        size = os.path.getsize(tmp_out)
        if size != bytes_out:
            raise VerificationError(f"chunk {out}: wrote {bytes_out} bytes of records but the file has {size}")
        return docs
    return _count_lines(tmp_out)


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
