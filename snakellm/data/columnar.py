"""Parquet and Arrow IPC shards, read with pyarrow one row group (parquet) or record batch (Arrow) at a time.

The readers here are the one place a columnar file is opened: the chunk job
(:func:`read_columnar` into its jsonl and quarantine), and anything that wants
a file's rows as dicts (:func:`iter_rows`: SFT data in parquet, say). Memory
stays bounded by the largest row group or batch: a 50 GB file of 1 MB row
groups holds about one row group at a time; Arrow files are memory-mapped.

No ``datasets`` import: ``save_to_disk`` writes Arrow IPC *stream* files
(``data-00000-of-00004.arrow``), which pyarrow reads as they are; IPC *file*
shards (``ARROW1`` magic) are told apart by their first bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from snakellm.errors import DataError
from snakellm.io.readers import DamagedShardError, display

ARROW_MAGIC = b"ARROW1"
STRING_TYPES = ("string", "large_string", "string_view")
BATCH_ROWS = 4096  # rows converted to Python objects at a time


class ColumnError(DataError):
    """A column the source's settings name that a file does not have (the message lists the ones it has)."""


def _pa():
    import pyarrow as pa

    return pa


def is_arrow_file(path: str) -> bool:
    """An Arrow IPC *file* (random access, ``ARROW1`` magic) rather than a stream."""
    with open(path, "rb") as fh:
        return fh.read(6) == ARROW_MAGIC


@dataclass
class Columnar:
    """One open parquet or Arrow file: its schema and its units (row groups or record batches) with row offsets."""

    path: str
    fmt: str
    schema: Any
    units: int  # row groups (parquet, Arrow file) ; -1: an Arrow stream (batches counted as read)
    offsets: list[int] = field(default_factory=list)  # first row of each unit (parquet)
    _pf: Any = None
    _mm: Any = None
    # pyarrow's CPU pool decodes a row group's columns in parallel; the chunk job runs its files in processes
    threads: bool = False

    @property
    def names(self) -> list[str]:
        return list(self.schema.names)

    def batches(self, columns: list[str] | None, units: tuple[int, int] | None = None) -> Iterator[tuple[int, Any]]:
        """(unit index, record batch) of the given units (half-open range; None: all), one unit in memory at a time."""
        pa = _pa()
        if self.fmt == "parquet":
            lo, hi = units if units is not None else (0, self.units)
            for i in range(lo, hi):
                try:
                    tbl = self._pf.read_row_group(i, columns=columns, use_threads=self.threads)
                except (OSError, pa.ArrowException) as e:
                    raise DamagedShardError(f"{display(self.path)}: row group {i} cannot be read: {e}") from None
                for b in tbl.to_batches(max_chunksize=BATCH_ROWS):
                    yield i, b
            return
        reader = self._pf
        i = 0
        try:
            if self.units >= 0:  # IPC file
                for i in range(self.units):
                    b = reader.get_batch(i)
                    yield i, b if columns is None else b.select(columns)
            else:
                for i, b in enumerate(reader):
                    yield i, b if columns is None else b.select(columns)
        except (OSError, pa.ArrowException) as e:
            raise DamagedShardError(f"{display(self.path)}: record batch {i} cannot be read: {e}") from None

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()


def open_columnar(path: str, fmt: str) -> Columnar:
    """Open a parquet or Arrow file by its footer / schema; DamagedShardError naming it when it has none."""
    pa = _pa()
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            # memory-mapped, as Arrow files are: pyarrow then decompresses the pages where the map has them (no
            # copy through a read buffer; ~2% of the chunk stage's CPU on parquet, docs/benchmarks.md)
            pf = pq.ParquetFile(path, memory_map=True)
            md = pf.metadata
            offsets, row = [], 0
            for i in range(md.num_row_groups):
                offsets.append(row)
                row += md.row_group(i).num_rows
            return Columnar(path, fmt, pf.schema_arrow, md.num_row_groups, offsets, pf)
        mm = pa.memory_map(path, "r")
        if is_arrow_file(path):
            r = pa.ipc.open_file(mm)
            return Columnar(path, fmt, r.schema, r.num_record_batches, [], r, mm)
        r = pa.ipc.open_stream(mm)
        return Columnar(path, fmt, r.schema, -1, [], r, mm)
    except (OSError, pa.ArrowException) as e:
        what = "parquet file (no footer: cut short?)" if fmt == "parquet" else "Arrow IPC file or stream"
        raise DamagedShardError(f"{display(path)}: not a readable {what}: {e}") from None


def check_columns(c: Columnar, key: str, columns: list[str] | None) -> None:
    """The text column, and every column ``columns`` names, exist in the file; else ColumnError listing its columns."""
    names = c.names
    missing = [n for n in [key, *(columns or [])] if n not in names]
    if missing:
        which = "text column (key)" if missing[0] == key else "column"
        raise ColumnError(
            f"{display(c.path)}: no {which} {missing[0]!r}; its columns are {', '.join(map(repr, names)) or 'none'} "
            f"(set sources.NAME.{'key' if missing[0] == key else 'columns'})"
        )


def iter_rows(
    path: str, fmt: str = "parquet", columns: list[str] | None = None, units: tuple[int, int] | None = None
) -> Iterator[dict[str, Any]]:
    """Every row of a parquet/Arrow file as a dict of Python values, in file order (bounded memory).

    The reader for anything that wants rows (SFT examples in parquet): no validation beyond the file's own.
    """
    c = open_columnar(path, fmt)
    try:
        if columns is not None:
            missing = [n for n in columns if n not in c.names]
            if missing:
                raise ColumnError(f"{display(path)}: no column {missing[0]!r}; its columns are {c.names}")
        for _, b in c.batches(columns, units):
            yield from b.to_pylist()
    finally:
        c.close()


def schema_of(c: Columnar) -> dict[str, str]:
    """Column name -> type, as the stats record a file's schema."""
    return {f.name: str(f.type) for f in c.schema}


def schema_diff(first: dict[str, str], sch: dict[str, str]) -> dict[str, list[str]]:
    """How a file's schema (:func:`schema_of`) differs from ``first``: the columns added, removed and retyped."""
    return {
        "added": sorted(set(sch) - set(first)),
        "removed": sorted(set(first) - set(sch)),
        "retyped": sorted(k for k in set(sch) & set(first) if sch[k] != first[k]),
    }


DIGEST = "xxh3_128"  # what a local columnar chunk records of its file: a 30x cheaper pass than sha256


def content_digest(path: str, units: tuple[int, int] | None = None) -> str:
    """``xxh3_128:<hex>`` of what a chunk of a local parquet/Arrow file depends on: the whole file, or, for a
    row-group slice, its row groups' bytes and the footer.

    A chunk of row groups 4..7 of a 50 GB file records this instead of a digest of the whole file, so planning
    after a copy (new inodes, same mtimes) reads only the slice again. xxh3 (not sha256: downloads keep the
    manifest's sha256) because the chunk job pays for this pass on every file: it is not a read pyarrow makes.
    """
    import xxhash

    size = os.path.getsize(path)
    ranges = [(0, size)]
    if units is not None:
        import pyarrow.parquet as pq

        md = pq.read_metadata(path)
        start, end = None, 0
        for i in range(*units):
            rg = md.row_group(i)
            for j in range(rg.num_columns):
                col = rg.column(j)
                first = col.data_page_offset
                if col.has_dictionary_page and col.dictionary_page_offset:
                    first = min(first, col.dictionary_page_offset)
                start = first if start is None else min(start, first)
                end = max(end, first + col.total_compressed_size)
        with open(path, "rb") as fh:
            fh.seek(size - 8)
            footer_len = int.from_bytes(fh.read(4), "little")
        ranges = [(size - 8 - footer_len, size)]
        if start is not None:
            ranges.insert(0, (start, end))
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        for a, b in ranges:
            fh.seek(a)
            left = b - a
            while left > 0:
                buf = fh.read(min(left, 1 << 22))
                if not buf:
                    break
                h.update(buf)
                left -= len(buf)
    return f"{DIGEST}:{h.hexdigest()}"
