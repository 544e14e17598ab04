"""What a successful run ends with (issue 42): the data stage's counts by source, the chunk that lost the
largest share, and the report command (snakellm.report.summary, the Snakefile's onsuccess)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snakellm.io.log import plural
from snakellm.report.summary import REPORT_COMMAND, data_summary, success_lines

REPO = Path(__file__).resolve().parent.parent


def _write(path, **stats):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stats))


def test_the_summary_counts_each_source_and_names_the_chunk_that_lost_most(tmp_path):
    _write(tmp_path / "data/jsonl/web/chunk-00000.stats.json", documents=95, rejected=5)
    _write(tmp_path / "data/jsonl/web/chunk-00001.stats.json", documents=40, rejected=10)
    _write(tmp_path / "data/curated/web/chunk-00001.stats.json", documents=30, removed=10)
    _write(tmp_path / "data/jsonl/books/chunk-00000.stats.json", documents=1, rejected=0)
    line = data_summary(["web", "books", "not-built-yet"], tmp_path)
    assert line == (
        "data: web 150 documents read, 15 rejected, 10 removed; books 1 document read, 0 rejected, 0 removed; "
        "most lost: web/chunk-00001, 20 of 50 "
        "(data/jsonl/web/chunk-00001.rejected.jsonl and data/curated/web/chunk-00001.removed.jsonl)"
    )
    assert data_summary(["books"], tmp_path).endswith("; nothing rejected or removed")
    assert data_summary(["none"], tmp_path) is None
    lines = success_lines(["web"], tmp_path)
    assert lines[0].startswith("snakellm: data: web") and REPORT_COMMAND in lines[1]
    assert success_lines([], tmp_path) == [lines[1]]  # no data stage: the report command alone


def test_a_schema_change_between_chunks_of_a_parquet_source_is_named_at_the_end(tmp_path):
    """Three parquet files of one source, one chunk each (the chunk job sees one file, so no chunk's stats can
    tell): the run's closing lines name the two whose columns differ from the first file's, and how."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from snakellm.data.chunk import build_chunk

    files = {
        "a.parquet": {"text": ["one", "two"], "id": ["a1", "a2"], "url": ["u1", "u2"]},
        "b.parquet": {"text": ["three"], "id": ["b1"], "url": ["u3"], "score": [0.5]},
        "c.parquet": {"text": ["four"], "id": [7]},
    }
    out = tmp_path / "data" / "jsonl" / "web"
    out.mkdir(parents=True)
    for i, (name, cols) in enumerate(files.items()):
        pq.write_table(pa.table(cols), tmp_path / name)
        stem = out / f"chunk-{i:05d}"
        build_chunk(
            [str(tmp_path / name)],
            f"{stem}.jsonl",
            fmt="parquet",
            stats=f"{stem}.stats.json",
            source="web",
            chunk=stem.name,
            show_progress=False,
        )
    lines = success_lines(["web"], tmp_path)
    note = [x for x in lines if "schema" in x]
    assert len(note) == 1, lines
    assert note[0].startswith("snakellm: note: source web: 2 files with another schema than its first file (")
    assert "a.parquet" in note[0].split("(", 1)[1].split(")", 1)[0]
    assert "b.parquet adds 'score' (data/jsonl/web/chunk-00001.stats.json)" in note[0]
    assert "c.parquet drops 'url'; retypes 'id' (string -> int64) (data/jsonl/web/chunk-00002.stats.json)" in note[0]
    assert not [x for x in success_lines(["other"], tmp_path) if "schema" in x]


def test_plural():
    assert plural(1, "shard") == "1 shard" and plural(2, "shard") == "2 shards" and plural(0, "rank") == "0 ranks"
    assert plural(1234, "prompt") == "1234 prompts"


@pytest.mark.slow  # the default workflow (shared)
def test_the_default_run_ends_with_the_summary_and_the_report_command_and_prints_only_ours(default_workflow):
    ws = default_workflow
    out = ws.first_run
    lines = success_lines(["wikitext", "botchan"], ws.root)
    ours = [line for line in out.stderr.splitlines() if line.startswith("snakellm: ")]
    assert ours[-2:] == lines
    # docs/reports.md quotes these two lines
    doc = (REPO / "docs/reports.md").read_text()
    assert all(line in doc for line in lines), lines
    # nothing of lm-eval's (or any library's) own on the terminal: the jobs' output goes to their logs
    assert "bootstrapping" not in out.stdout + out.stderr and out.stdout.strip() == "", out.stdout[-2000:]
