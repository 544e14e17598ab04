"""The C writer of columnar jsonl records (snakellm/data/_jsonl.c) against orjson, and the chunk job's two paths.

Every line it writes must be byte for byte ``orjson.dumps(record, option=OPT_APPEND_NEWLINE)``, and it must
accept exactly the strings Python's UTF-8 decoder accepts; the chunk job must write the same jsonl, quarantine
and stats through it as through its orjson path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snakellm.data import columnar_jsonl as cj
from snakellm.data.chunk import Limits, build_chunk

OPT = orjson.OPT_APPEND_NEWLINE


def test_the_install_built_the_c_writer():
    """The editable install compiles it (pyproject.toml's ext-modules); without it the stage is ~1.4x slower."""
    assert cj.AVAILABLE, "snakellm/data/_jsonl.c was not built: pip install -e . needs a C compiler"


def _lines(tbl: pa.Table, first: str) -> bytes:
    """The C writer's lines for every row of a one-batch table, ``first`` its first column."""
    batch = tbl.combine_chunks().to_batches()[0]
    names = batch.schema.names
    prefixes = [b"{" + orjson.dumps(first) + b":", *(b"," + orjson.dumps(n) + b":" for n in names[1:])]
    cols = [cj.column(p, batch.column(j)) for j, p in enumerate(prefixes)]
    return cj.records(batch.num_rows, cols, None)


def _orjson(tbl: pa.Table) -> bytes:
    return b"".join(orjson.dumps(r, default=cj.jsonable, option=OPT) for r in tbl.to_pylist())


CHARS = st.characters(blacklist_categories=["Cs"])  # every code point a str holds that UTF-8 can write


@pytest.mark.slow  # hypothesis / every code point: 0.5-1.5 s, and the fast tier's 90 s has little room
@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(CHARS, max_size=40), min_size=1, max_size=8), st.lists(st.text(max_size=5), max_size=3))
def test_strings_are_escaped_as_orjson_escapes_them(texts, urls):
    tbl = pa.table({"text": texts, "url": (urls + [""] * len(texts))[: len(texts)]})
    assert _lines(tbl, "text") == _orjson(tbl)
    big = pa.table({"text": pa.array(texts, type=pa.large_string())})
    assert _lines(big, "text") == _orjson(big)


@pytest.mark.slow  # hypothesis / every code point: 0.5-1.5 s, and the fast tier's 90 s has little room
@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=24))
def test_utf8_is_accepted_exactly_when_python_decodes_it(raw):
    arr = pa.Array.from_buffers(
        pa.string(), 1, [None, pa.py_buffer(bytes(4) + len(raw).to_bytes(4, "little")), pa.py_buffer(raw)]
    )
    cols = [cj.column(b'{"text":', arr)]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(cj.InvalidUTF8) as e:
            cj.records(1, cols, None)
        assert e.value.args == (0, 0)
        return
    assert cj.records(1, cols, None) == orjson.dumps({"text": text}, option=OPT)


@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
def test_every_control_character_and_boundary_code_point():
    points = [*range(0x00, 0x81), 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFD, 0xFFFF, 0x10000, 0x10FFFF, 0x2028, 0x3000]
    tbl = pa.table({"text": [chr(c) + "ab" + chr(c) for c in points] + ["x" * 17 + '"' + "y" * 9]})
    assert _lines(tbl, "text") == _orjson(tbl)


@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
def test_nulls_slices_dictionaries_and_other_types_as_orjson_renders_them():
    import datetime as dt
    import decimal

    n = 9
    tbl = pa.table(
        {
            "text": [f"doc {i} \u00e9\n" for i in range(n)],
            "maybe": [None if i % 3 == 0 else f"v{i}" for i in range(n)],
            "lang": pa.array(["en", "fr", "en"] * 3).dictionary_encode(),
            "score": [0.1 * i if i != 4 else float("nan") for i in range(n)],
            "count": pa.array([None if i == 2 else 2**40 + i for i in range(n)], type=pa.int64()),
            "small": pa.array(list(range(n)), type=pa.uint8()),
            "flag": [i % 2 == 0 for i in range(n)],
            "tags": [[f"t{i}", '"q"'] for i in range(n)],
            "meta": [{"k": i, "s": "a,b"} for i in range(n)],
            "when": [dt.datetime(2024, 1, 1 + i, 12, 30) for i in range(n)],
            "money": pa.array([decimal.Decimal(f"{i}.25") for i in range(n)], type=pa.decimal128(6, 2)),
            "blob": [bytes([i, 0xFF]) for i in range(n)],
        }
    )
    assert _lines(tbl, "text") == _orjson(tbl)
    sliced = tbl.slice(2, 5)  # arrays with an offset into their buffers
    assert _lines(sliced, "text") == _orjson(sliced.combine_chunks())
    batch = sliced.to_batches()[0]
    cols = [cj.column(b'{"text":', batch.column(0)), cj.column(b',"count":', batch.column(4))]
    skip = pa.array([0, 1, 0, 1, 0], type=pa.uint8()).to_numpy()
    want = [r for r, s in zip(sliced.select(["text", "count"]).to_pylist(), skip, strict=True) if not s]
    assert cj.records(5, cols, skip) == b"".join(orjson.dumps(r, option=OPT) for r in want)


NASTY = [
    "plain",
    None,
    "",
    "   \t\r\n",
    "\u3000\u00a0\x1c",  # whitespace to str.isspace
    "\u200b",  # not whitespace to str.isspace
    " lead space",
    "x" * 3000,  # too long at max_document_bytes 2000
    "é" * 900,  # 1,800 bytes: under 2000
    "é" * 1100,  # 2,200 bytes: over
    'quote " backslash \\ tab \t nul \x00 del \x7f',
    "emoji 🦊 CJK 漢字",
]


def _nasty_parquet(path: Path, with_id: bool) -> None:
    rows = len(NASTY)
    cols: dict = {"text": NASTY, "url": [f"https://e.org/{i}" for i in range(rows)], "n": list(range(rows))}
    if with_id:
        cols["id"] = [None if i % 4 == 1 else f"id-{i}" for i in range(rows)]
    tbl = pa.table(cols)
    # two rows whose bytes are not UTF-8 (pyarrow writes them unchecked): one in the text, one in the url
    text = tbl.column("text").combine_chunks()
    url = tbl.column("url").combine_chunks()
    bad_text = _with_bytes(text, 0, b"bad \xff text")
    bad_url = _with_bytes(url, 2, b"https://e.org/\xc0\xaf")
    tbl = tbl.set_column(0, "text", bad_text).set_column(1, "url", bad_url)
    pq.write_table(tbl, path, row_group_size=5)


def _with_bytes(arr: pa.Array, i: int, raw: bytes) -> pa.Array:
    """``arr`` with its i-th value replaced by raw bytes (no UTF-8 check)."""
    vals = [v.as_py().encode() if v.is_valid else None for v in arr]
    vals[i] = raw
    b = pa.array(vals, type=pa.binary())
    validity, offsets, data = b.buffers()
    return pa.Array.from_buffers(pa.string(), len(b), [validity, offsets, data], null_count=b.null_count)


def _chunk(tmp: Path, paths: list[Path], fmt: str, c_writer: bool, monkeypatch) -> dict:
    monkeypatch.setattr(cj, "AVAILABLE", c_writer)
    out = tmp / ("c" if c_writer else "py")
    out.mkdir()
    st_ = build_chunk(
        [str(p) for p in paths],
        str(out / "chunk.jsonl"),
        fmt=fmt,
        show_progress=False,
        limits=Limits(max_document_bytes=2000),
    )
    return {
        "jsonl": (out / "chunk.jsonl").read_bytes(),
        "rejected": (out / "chunk.rejected.jsonl").read_bytes(),
        "stats": st_,
    }


@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
@pytest.mark.parametrize("with_id", [True, False])
def test_the_chunk_job_writes_the_same_bytes_through_both_paths(tmp_path, monkeypatch, with_id):
    p = tmp_path / "nasty.parquet"
    _nasty_parquet(p, with_id)
    c = _chunk(tmp_path, [p], "parquet", True, monkeypatch)
    py = _chunk(tmp_path, [p], "parquet", False, monkeypatch)
    assert c["jsonl"] == py["jsonl"]
    assert c["rejected"] == py["rejected"]
    drop = {"seconds", "mb_per_s"}
    assert {k: v for k, v in c["stats"].items() if k not in drop} == {
        k: v for k, v in py["stats"].items() if k not in drop
    }
    rejected = [json.loads(x) for x in c["rejected"].splitlines()]
    reasons = {(r["row"], r["reason"]) for r in rejected}
    assert reasons == {
        (0, "invalid_utf8"),
        (1, "null_text"),
        (2, "invalid_utf8"),  # empty, and its url is not UTF-8: any string that is not UTF-8 is the reason
        (3, "empty_text"),
        (4, "empty_text"),
        (7, "too_long"),
        (9, "too_long"),
    }
    assert next(r for r in rejected if r["row"] == 0) == {
        "shard": str(p),
        "row": 0,
        "row_group": 0,
        "reason": "invalid_utf8",
        "column": "text",
        "content": "bad \\xff text",
    }
    assert next(r for r in rejected if r["row"] == 2)["column"] == "url"
    docs = [json.loads(x) for x in c["jsonl"].splitlines()]
    assert [d["text"] for d in docs] == [NASTY[i] for i in (5, 6, 8, 10, 11)]
    want_ids = [f"id-{i}" if with_id and i % 4 != 1 else f"{p}/{i}" for i in (5, 6, 8, 10, 11)]
    assert [d["id"] for d in docs] == want_ids
    assert c["stats"]["ids_generated"] == sum(1 for i in want_ids if i.startswith(str(p)))


@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
def test_a_url_that_is_not_utf8_quarantines_its_row_naming_the_column(tmp_path, monkeypatch):
    tbl = pa.table({"text": ["a", "b", "c"], "url": ["u0", "u1", "u2"]})
    tbl = tbl.set_column(1, "url", _with_bytes(tbl.column("url").combine_chunks(), 1, b"u\xed\xa0\x80"))
    p = tmp_path / "u.parquet"
    pq.write_table(tbl, p)
    for c_writer in (True, False):
        got = _chunk(tmp_path, [p], "parquet", c_writer, monkeypatch)
        assert [json.loads(x)["text"] for x in got["jsonl"].splitlines()] == ["a", "c"]
        (rej,) = [json.loads(x) for x in got["rejected"].splitlines()]
        assert (rej["row"], rej["reason"], rej["column"], rej["content"]) == (
            1,
            "invalid_utf8",
            "url",
            "u\\xed\\xa0\\x80",
        )


@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
def test_arrow_stream_shards_through_both_paths(tmp_path, monkeypatch):
    tbl = pa.table({"content": ["x\ny", None, "z"], "id": ["a", "b", None], "k": [1, 2, 3]})
    p = tmp_path / "data-00000-of-00001.arrow"
    with pa.OSFile(str(p), "wb") as fh, pa.ipc.new_stream(fh, tbl.schema) as w:
        w.write_table(tbl, max_chunksize=2)
    outs = []
    for c_writer in (True, False):
        monkeypatch.setattr(cj, "AVAILABLE", c_writer)
        d = tmp_path / f"o{c_writer}"
        d.mkdir()
        build_chunk([str(p)], str(d / "c.jsonl"), fmt="arrow", key="content", show_progress=False)
        outs.append(((d / "c.jsonl").read_bytes(), (d / "c.rejected.jsonl").read_bytes()))
    assert outs[0] == outs[1]
    assert [json.loads(x) for x in outs[0][0].splitlines()] == [
        {"content": "x\ny", "id": "a", "k": 1},
        {"content": "z", "id": f"{p}/2", "k": 3},
    ]
    assert os.path.getsize(tmp_path / "oTrue" / "c.jsonl") == len(outs[0][0])


@pytest.mark.slow  # hypothesis / every code point: 0.5-1.5 s, and the fast tier's 90 s has little room
@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
def test_blank_texts_are_the_ones_str_isspace_calls_blank_over_every_code_point():
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    alone = pa.array([chr(c) for c in points])
    codes = cj.text_codes(alone, None)
    want = [cj.EMPTY if chr(c).isspace() else cj.OK for c in points]
    assert codes.tolist() == want
    assert sum(w == cj.EMPTY for w in want) == 29  # str.isspace's set: \t..\r, \x1c..\x1f, ' ', U+0085 ... U+3000
    mixed = pa.array(["\u3000\u2028 x", " \t", None, "", "\u00a0" * 10, "x" * 11, " " + "x" * 11])
    assert cj.text_codes(mixed, 10).tolist() == [cj.OK, cj.EMPTY, cj.NULL, cj.EMPTY, cj.EMPTY, cj.TOO_LONG, cj.TOO_LONG]


@pytest.mark.skipif(not cj.AVAILABLE, reason="the C writer is not built")
def test_a_special_byte_at_every_position_of_the_eight_byte_words():
    specials = ['"', "\\", "\n", "\x01", "\x1f", " ", "\x7f", "é", "漢", "🦊", "\u2028"]
    texts = ["a" * pos + ch + "b" * (19 - pos) + ch for pos in range(20) for ch in specials]
    tbl = pa.table({"text": texts})
    assert _lines(tbl, "text") == _orjson(tbl)
