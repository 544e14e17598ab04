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
