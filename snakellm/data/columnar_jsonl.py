"""A parquet or Arrow batch's jsonl lines, written from Arrow's buffers without Python strings.

The chunk job's columnar path (:func:`snakellm.data.chunk._columnar_shard`) spends most of its time outside
pyarrow's decoding in turning every text into a Python ``str`` (UTF-8 to UCS) and back (orjson: UCS to
UTF-8). :func:`records` hands the batch's Arrow buffers to a small C writer (``snakellm/data/_jsonl.c``, an
optional extension: an install without a C compiler leaves :data:`AVAILABLE` false and the chunk job on its
orjson path) that escapes each string as orjson escapes a ``str`` and checks its UTF-8 as Python's decoder
does. The lines are byte for byte those of ``orjson.dumps(record, option=OPT_APPEND_NEWLINE)``
(``tests/test_columnar_jsonl.py``); non-string columns are rendered by orjson itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from snakellm.errors import DataError

try:
    from snakellm.data import _jsonl
except ImportError:  # built without a C compiler: the chunk job keeps its orjson path
    _jsonl = None  # type: ignore[assignment]

AVAILABLE = _jsonl is not None
InvalidUTF8: type[Exception] = _jsonl.InvalidUTF8 if _jsonl is not None else DataError

# what the text's checks find (0: a document)
OK, NULL, EMPTY, TOO_LONG, SPACE = 0, 1, 2, 3, 4  # SPACE: starts with whitespace (str.isspace decides)


def _pa():
    import pyarrow as pa

    return pa


def strings(arr: Any) -> Any | None:
    """``arr`` as a utf8 / large_utf8 array (dictionary and view arrays decoded), or None for other types."""
    pa = _pa()
    t = arr.type
    if pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)):
        arr = arr.dictionary_decode()
    elif getattr(pa.types, "is_string_view", lambda _t: False)(t):
        arr = arr.cast(pa.string())
    return arr if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) else None


def text_codes(texts: Any, limit: int | None) -> np.ndarray:
    """Per row of a utf8 array: OK, NULL, EMPTY (empty or, as ``str.isspace`` says, only whitespace) or TOO_LONG
    (more than ``limit`` bytes of UTF-8). Only the texts that start with whitespace become Python strings."""
    assert _jsonl is not None
    pa = _pa()
    validity, offsets, data = texts.buffers()[:3]
    large = pa.types.is_large_string(texts.type)
    raw = _jsonl.text_codes(
        data if data is not None else b"",
        offsets,
        validity if texts.null_count else None,
        texts.offset,
        len(texts),
        large,
        -1 if limit is None else limit,
    )
    codes = np.frombuffer(raw, dtype=np.uint8).copy()
    for i in np.flatnonzero(codes == SPACE).tolist():
        v = texts[i].as_py()
        codes[i] = EMPTY if v.isspace() else TOO_LONG if limit is not None and len(v.encode()) > limit else OK
    return codes


def column(prefix: bytes, arr: Any, py: list[Any] | None = None) -> tuple:
    """The C writer's description of one column: ``prefix`` (``{"text":`` or ``,"url":``) and its values.

    Strings go as Arrow's buffers; any other type as orjson's rendering of its Python values, one per line
    (``py``: values to render instead of ``arr``'s, as the ids with generated ones filled in)."""
    pa = _pa()
    s = strings(arr) if py is None else None
    if s is not None:
        validity, offsets, data = s.buffers()[:3]
        kind = 0 if pa.types.is_string(s.type) else 1
        return (prefix, kind, data if data is not None else b"", offsets, validity if s.null_count else None, s.offset)
    # filled-in values may mix types (an integer id column, generated string ids): orjson renders each alone
    return (prefix, 2, rendered(arr.to_pylist(), arr.type) if py is None else rendered(py), None, None, 0)


def jsonable(v: object) -> object:
    """A column value orjson has no type for (bytes, Decimal, a time delta ...) as JSON can hold it."""
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).decode("utf-8", "backslashreplace")
    return str(v)


def rendered(py: list[Any], typ: Any = None) -> bytes:
    """orjson's JSON of each value (as ``orjson.dumps(value, default=jsonable)``), each ended by a newline;
    ``typ``, the Arrow type every value has (None: unknown)."""
    pa = _pa()
    if not py:
        return b""
    if typ is not None and (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)):
        # one orjson call for the column: numbers, booleans and null hold no comma
        return orjson.dumps(py)[1:-1].replace(b",", b"\n") + b"\n"
    dumps, opt = orjson.dumps, orjson.OPT_APPEND_NEWLINE
    return b"".join(dumps(v, default=jsonable, option=opt) for v in py)


def records(n: int, columns: list[tuple], skip: np.ndarray | None, buf: bytearray | None = None) -> memoryview:
    """The jsonl lines of the rows of ``columns`` (from :func:`column`) whose ``skip`` is 0, written into ``buf``
    (one bytearray for every batch of a chunk: a fresh buffer a batch costs a page fault every 4 KB); a view of
    them, to release before ``buf`` is used again.

    Raises :data:`InvalidUTF8` ``(column index, row)`` at the first string that is not UTF-8."""
    assert _jsonl is not None
    buf = bytearray() if buf is None else buf
    used = _jsonl.records(buf, n, columns, None if skip is None else skip.tobytes())
    return memoryview(buf)[:used]
