"""Parquet, Arrow and WARC sources: every valid row arrives exactly, bad input is quarantined and counted.

The corpus is FineWeb-shaped (tests/columnar_helpers.py): files of 3-7 row groups in four codecs, many scripts,
CRLF, a 240 KB document, null texts, a renamed text column, a file cut short, a ``save_to_disk`` directory.
The documents are compared with pyarrow's own reading and with datatrove's ``ParquetReader`` /
``WarcReader`` + ``Trafilatura``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from columnar_helpers import make_corpus

from snakellm.data import planning
from snakellm.data.chunk import Fields, build_chunk
from snakellm.data.columnar import ColumnError, iter_rows
from snakellm.io.readers import DamagedShardError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fineweb")
    return root, make_corpus(root)


def _plan(root: Path, per: int, cache: Path | None = None, glob: str = "fineweb/*.parquet") -> dict:
    spec = {"kind": "local", "path": str(root / glob), "format": "parquet", "row_groups_per_chunk": per}
    return planning.plan_source(spec, cache_dir=cache)


def _records(path: Path) -> list[dict]:
    return [orjson.loads(ln) for ln in path.read_bytes().splitlines()]


def test_row_group_chunks_hold_every_valid_row_exactly(corpus, tmp_path):
    root, c = corpus
    plan = _plan(root, 2)
    # one chunk per 2 row groups of each file, never two files in one chunk
    assert len(plan) == sum(-(-n // 2) for _, n, _ in c["files"])
    got: list[dict] = []
    rejected: list[dict] = []
    nulls = 0
    for name, entries in plan.items():
        assert len(entries) == 1
        st = build_chunk(entries, str(tmp_path / f"{name}.jsonl"), fmt="parquet", show_progress=False)
        got += _records(tmp_path / f"{name}.jsonl")
        rejected += _records(tmp_path / f"{name}.rejected.jsonl")
        nulls += st["rejected_by_reason"].get("null_text", 0)
        assert st["documents"] + st["rejected"] == st["lines_read"]
    expected = []
    for p, _, _ in c["files"]:
        tbl = pq.read_table(p)
        expected += [(t, i) for t, i in zip(tbl["text"].to_pylist(), tbl["id"].to_pylist(), strict=True)]
    assert [(r["text"], r["id"]) for r in got] == [(t, i) for t, i in expected if t is not None]
    assert nulls == sum(t is None for t, _ in expected) > 0
    assert {r["reason"] for r in rejected} == {"null_text"}
    assert all(r["shard"].endswith(".parquet") and "row" in r and "row_group" in r for r in rejected)
    assert any(len(r["text"]) > 240_000 for r in got)  # the 240 KB document, one like any other
    assert any("\r\n" in r["text"] for r in got)  # CRLF inside a text is kept as it is
    # the other columns are the record's fields
    assert set(got[0]) == {"text", "id", "dump", "url", "language_score", "token_count"}


def test_columns_keeps_only_those_and_renamed_text_column(corpus, tmp_path):
    root, c = corpus
    out = tmp_path / "r.jsonl"
    with pytest.raises(ColumnError, match=r"no text column \(key\) 'text'; its columns are 'content', 'id'"):
        build_chunk([str(c["renamed"])], str(out), fmt="parquet", show_progress=False)
    st = build_chunk(
        [str(c["renamed"])],
        str(out),
        fmt="parquet",
        key="content",
        fields=Fields(columns=("url",)),
        show_progress=False,
    )
    recs = _records(out)
    tbl = pq.read_table(c["renamed"])
    assert [r["content"] for r in recs] == tbl["content"].to_pylist() and st["documents"] == 30
    assert set(recs[0]) == {"content", "id", "url"}
    with pytest.raises(ColumnError, match="no column 'nope'"):
        build_chunk([str(c["renamed"])], str(out), fmt="parquet", key="content", fields=Fields(columns=("nope",)))


def test_cut_file_is_quarantined_and_counted(corpus, tmp_path):
    root, c = corpus
    # planned by row group, a file without a footer is one chunk of the whole file ...
    plan = _plan(root, 2, glob="cut/*.parquet")
    assert list(plan.values()) == [[str(c["cut"])]]
    st = build_chunk(plan["chunk-00000"], str(tmp_path / "c.jsonl"), fmt="parquet", show_progress=False)
    # ... whose job quarantines it, named, and counts it
    assert st["rejected_by_reason"] == {"unreadable_file": 1} and st["documents"] == 0
    (rec,) = _records(tmp_path / "c.rejected.jsonl")
    assert rec["shard"] == str(c["cut"]) and "no footer" in rec["content"]


def test_save_to_disk_directory_is_read_as_arrow(corpus, tmp_path):
    root, c = corpus
    spec = {"kind": "local", "path": str(c["saved"]), "format": "arrow", "shards_per_chunk": 8}
    (shards,) = planning.plan_source(spec).values()
    assert [Path(s).name for s in shards] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    st = build_chunk(shards, str(tmp_path / "a.jsonl"), fmt="arrow", workers=2, show_progress=False)
    recs = _records(tmp_path / "a.jsonl")
    assert [(r["text"], r["id"]) for r in recs] == [(r["text"], r["id"]) for r in c["saved_rows"]]
    assert st["documents"] == 50 and st["ids_generated"] == 0
    # the row reader on its own (what SFT data in parquet/arrow uses)
    assert [r["id"] for s in shards for r in iter_rows(s, "arrow")] == [r["id"] for r in c["saved_rows"]]


def test_arrow_ipc_file_and_generated_ids(tmp_path):
    import pyarrow as pa

    tbl = pa.table({"text": ["a", None, "c"], "n": [1, 2, 3]})
    p = tmp_path / "f.arrow"
    with pa.ipc.new_file(str(p), tbl.schema) as w:
        w.write_table(tbl, max_chunksize=2)
    st = build_chunk([str(p)], str(tmp_path / "o.jsonl"), fmt="arrow", show_progress=False)
    recs = _records(tmp_path / "o.jsonl")
    assert recs == [{"text": "a", "id": f"{p}/0", "n": 1}, {"text": "c", "id": f"{p}/2", "n": 3}]
    assert st["ids_generated"] == 2 and st["rejected_by_reason"] == {"null_text": 1}
    # an Arrow stream cut short fails the job naming the file
    s = tmp_path / "s.arrow"
    with pa.ipc.new_stream(str(s), tbl.schema) as w:
        for _ in range(50):
            w.write_table(tbl)
    s.write_bytes(s.read_bytes()[:-700])
    with pytest.raises(DamagedShardError, match="s.arrow: record batch"):
        build_chunk([str(s)], str(tmp_path / "s.jsonl"), fmt="arrow", show_progress=False)


def test_schema_change_between_files_is_counted(tmp_path):
    import pyarrow as pa

    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": ["x"], "id": ["1"], "url": ["u"]}), a)
    pq.write_table(pa.table({"text": ["y"], "id": [2], "lang": ["en"]}), b)
    st = build_chunk([str(a), str(b)], str(tmp_path / "o.jsonl"), fmt="parquet", show_progress=False)
    assert st["schema_changes"] == [{"shard": str(b), "added": ["lang"], "removed": ["url"], "retyped": ["id"]}]
    assert _records(tmp_path / "o.jsonl") == [
        {"text": "x", "id": "1", "url": "u"},
        {"text": "y", "id": 2, "lang": "en"},
    ]


def test_footer_cache_plans_unchanged_files_without_reading_them(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    calls = []
    real = planning._footer_row_groups
    monkeypatch.setattr(planning, "_footer_row_groups", lambda p: calls.append(p) or real(p))
    first = _plan(root, 3, tmp_path)
    assert len(calls) == 4 and (tmp_path / planning.FOOTERS).exists()
    calls.clear()
    assert _plan(root, 3, tmp_path) == first and calls == []
    # a rewritten file's footer is read again; only it
    copy = tmp_path / "fw"
    shutil.copytree(root / "fineweb", copy)
    _plan(copy, 3, tmp_path, glob="*.parquet")
    calls.clear()
    victim = sorted(copy.glob("*.parquet"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data)
    os.utime(victim, ns=(1, 1))
    _plan(copy, 3, tmp_path, glob="*.parquet")
    assert calls == [str(victim)]


def test_slices_are_stale_only_when_their_file_changed(corpus, tmp_path):
    root, c = corpus
    fw = tmp_path / "fw"
    shutil.copytree(root / "fineweb", fw)
    plan = _plan(fw, 2, glob="*.parquet")
    for name, entries in plan.items():
        build_chunk(entries, str(tmp_path / f"{name}.jsonl"), fmt="parquet", show_progress=False)
    stale = {n for n, e in plan.items() if planning.stale_local_chunk(tmp_path / f"{n}.stats.json", e)}
    assert stale == set()
    # a copy with the same mtimes (new inodes, ctimes) is the same content: nothing is stale
    moved = tmp_path / "moved"
    shutil.copytree(fw, moved)
    shutil.rmtree(fw)
    moved.rename(fw)
    stale = {n for n, e in plan.items() if planning.stale_local_chunk(tmp_path / f"{n}.stats.json", e)}
    assert stale == set()
    # rewriting one file makes only its own chunks stale
    victim = sorted(fw.glob("*.parquet"))[2]
    tbl = pq.read_table(victim)
    pq.write_table(tbl, victim, row_group_size=-(-tbl.num_rows // 7), compression="zstd")
    stale = {n for n, e in plan.items() if planning.stale_local_chunk(tmp_path / f"{n}.stats.json", e)}
    assert stale == {n for n, e in plan.items() if planning.split_slice(e[0])[0] == str(victim)}
    assert len(stale) == 4


def test_same_documents_as_datatrove_parquet_reader(corpus, tmp_path):
    from datatrove.pipeline.readers import ParquetReader

    root, c = corpus
    folder = root / "fineweb"
    ours = []
    for p, _, _ in c["files"]:
        build_chunk([str(p)], str(tmp_path / "o.jsonl"), fmt="parquet", show_progress=False)
        ours += [(r["text"], r["id"]) for r in _records(tmp_path / "o.jsonl")]
    theirs = [(d.text, d.id) for d in ParquetReader(str(folder), glob_pattern="*.parquet")()]
    # datatrove drops null texts without a word (its adapter makes them ""; empty documents are skipped)
    assert ours == theirs


def _warc(path: Path, pages: list[tuple[str, str, bytes]], gz: bool = True) -> None:
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as fh:
        w = WARCWriter(fh, gzip=gz)
        w.write_record(w.create_warcinfo_record(path.name, {"software": "test"}))
        for url, status_ctype, body in pages:
            status, ctype = status_ctype.split("|")
            hh = StatusAndHeaders(status, [("Content-Type", ctype)], protocol="HTTP/1.1")
            w.write_record(w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=hh))


def _page(i: int) -> bytes:
    para = " ".join(f"Sentence {j} of page {i} talks about topic {i * 7 % 13} at some length." for j in range(12))
    return (
        f"<html><head><title>Page {i}</title></head><body><nav>menu home about</nav><article><h1>Heading {i}</h1>"
        f"<p>{para}</p><p>Второй абзац {i}: 敏捷的棕色狐狸。</p></article><footer>(c) site</footer></body></html>"
    ).encode()


@pytest.mark.slow  # 1.5 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_warc_documents_skips_and_datatrove_equality(tmp_path):
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.readers import WarcReader

    ok = "200 OK|text/html; charset=utf-8"
    pages = [(f"https://example.org/{i}", ok, _page(i)) for i in range(12)]
    pages.insert(3, ("https://example.org/img.png", "200 OK|image/png", b"\x89PNG...."))
    pages.insert(5, ("https://example.org/gone", "404 Not Found|text/html", _page(99)))
    pages.insert(7, ("https://example.org/empty", ok, b"<html><body></body></html>"))
    (tmp_path / "in").mkdir()
    p = tmp_path / "in" / "CC-MAIN-x.warc.gz"
    _warc(p, pages)
    st = build_chunk([str(p)], str(tmp_path / "w.jsonl"), fmt="warc", show_progress=False)
    recs = _records(tmp_path / "w.jsonl")
    assert st["documents"] == 12 and len(recs) == 12
    assert st["skipped_by_reason"] == {"empty_extraction": 1, "not_200": 1, "not_html": 1, "not_response": 1}
    assert recs[0]["url"] == "https://example.org/0" and recs[0]["id"].startswith("<urn:uuid:") and recs[0]["date"]
    assert "Sentence 3 of page 0" in recs[0]["text"] and "menu home" not in recs[0]["text"]
    # datatrove's WarcReader + Trafilatura (its defaults) on the same file: the same texts and ids (datatrove
    # keeps the 404 page: it does not look at the status)
    dt = [d for d in Trafilatura()(WarcReader(str(tmp_path / "in"))()) if d.metadata.get("url") != pages[5][0]]
    assert [(r["text"], r["id"], r["url"]) for r in recs] == [(d.text, d.id, d.metadata["url"]) for d in dt]
    # a .warc.gz cut inside a gzip member fails the job naming the file
    cut = tmp_path / "cut.warc.gz"
    data = p.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DamagedShardError, match="cut.warc.gz: truncated gzip data"):
        build_chunk([str(cut)], str(tmp_path / "c.jsonl"), fmt="warc", show_progress=False)
    # an uncompressed .warc reads alike
    plain = tmp_path / "p.warc"
    _warc(plain, pages[:3], gz=False)
    st = build_chunk([str(plain)], str(tmp_path / "p.jsonl"), fmt="warc", show_progress=False)
    assert st["documents"] == 3


def test_config_checks_name_the_setting():
    from snakellm.config.checks import ConfigError, check_sources

    def cfg(**kw):
        return {"sources": {"s": {"kind": "local", "path": "x", "format": "parquet", **kw}}}

    with pytest.raises(ConfigError, match="sources.s: set exactly one of shards_per_chunk"):
        check_sources(cfg())
    with pytest.raises(ConfigError, match="sources.s: set exactly one"):
        check_sources(cfg(shards_per_chunk=1, row_groups_per_chunk=2))
    with pytest.raises(ConfigError, match="sources.s.row_groups_per_chunk: only local parquet"):
        check_sources({"sources": {"s": {"kind": "local", "path": "x", "format": "arrow", "row_groups_per_chunk": 2}}})
    with pytest.raises(ConfigError, match="sources.s.columns: only parquet and arrow"):
        check_sources({"sources": {"s": {"kind": "local", "path": "x", "format": "jsonl", "shards_per_chunk": 1,
                                         "columns": ["a"]}}})  # fmt: skip
    check_sources(cfg(row_groups_per_chunk=2))


def test_stats_json_is_json(corpus, tmp_path):
    root, c = corpus
    p, _, _ = c["files"][0]
    build_chunk([str(p)], str(tmp_path / "o.jsonl"), fmt="parquet", show_progress=False)
    st = json.loads((tmp_path / "o.stats.json").read_text())
    assert st["per_shard"][0]["schema"]["text"] == "string"


def test_too_long_and_not_string_texts_are_quarantined(tmp_path):
    import pyarrow as pa

    from snakellm.data.chunk import Limits

    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["ok", "y" * 5000, "  \r\n", ""], "id": ["1", "2", "3", "4"]}), p)
    st = build_chunk([str(p)], str(tmp_path / "o.jsonl"), fmt="parquet", limits=Limits(1000), show_progress=False)
    assert st["rejected_by_reason"] == {"too_long": 1, "empty_text": 2} and st["documents"] == 1
    long = next(r for r in _records(tmp_path / "o.rejected.jsonl") if r["reason"] == "too_long")
    assert long["bytes"] == 5000 and len(long["content"]) == 1024 and long["row"] == 1
    q = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": [1, 2], "id": ["a", "b"]}), q)
    st = build_chunk([str(q)], str(tmp_path / "n.jsonl"), fmt="parquet", show_progress=False)
    assert st["rejected_by_reason"] == {"not_string": 2}
