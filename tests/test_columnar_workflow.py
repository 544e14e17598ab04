"""Parquet and Arrow sources in real Snakemake runs: row-group chunks, curation and tokenization as for jsonl,
and rewriting one file reruns only its own chunks. The FineWeb example plans (`snakemake -n`) on a CPU.

Over a minute (about 100 s on 2 shared cores): one build of four sources through curation and tokenization,
then the rebuild after one file is rewritten; the rerun set is the point, so it cannot be split smaller.
"""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest
from columnar_helpers import make_corpus
from conftest import REPO

pytestmark = pytest.mark.slow


def _config() -> dict:
    return {
        "sources": {
            "fw": {
                "kind": "local",
                "path": "corpus/fineweb/*.parquet",
                "format": "parquet",
                "row_groups_per_chunk": 2,
                "curate": {"exact": True},
            },
            "saved": {"kind": "local", "path": "corpus/saved", "format": "arrow", "shards_per_chunk": 4},
            "renamed": {
                "kind": "local",
                "path": "corpus/renamed/*.parquet",
                "format": "parquet",
                "key": "content",
                "columns": ["url"],
                "shards_per_chunk": 1,
            },  # fmt: skip
            "cut": {"kind": "local", "path": "corpus/cut/*.parquet", "format": "parquet", "row_groups_per_chunk": 2},
        },
        "tokenizers": {
            "gpt2": {
                "kind": "gpt2-bpe",
                "vocab_file": "resources/tokenizers/gpt2/vocab.json",
                "merges_file": "resources/tokenizers/gpt2/merges.txt",
                "vocab_size": 50257,
            }
        },
        "tokenize": {"tokenizers": ["gpt2"], "threads": 1},
    }


def _stats(ws, source: str) -> dict[str, dict]:
    return {p.stem.removesuffix(".stats"): json.loads(p.read_text()) for p in ws.path(f"data/jsonl/{source}").glob("*.stats.json")}  # fmt: skip


def test_parquet_workflow_chunks_tokenizes_and_reruns_only_the_rewritten_file(workspace):
    ws = workspace
    corpus = make_corpus(ws.root / "corpus")
    shutil.copytree(REPO / "resources" / "tokenizers", ws.root / "resources" / "tokenizers")
    ws.write_config(_config())
    ws.run("data/tokens/gpt2/blend.json")
    fw = _stats(ws, "fw")
    # one chunk per 2 row groups of each file (3, 5, 7, 4 row groups)
    assert len(fw) == 2 + 3 + 4 + 2
    rows = sum(pq.read_metadata(p).num_rows for p, _, _ in corpus["files"])
    nulls = sum(r["text"] is None for _, _, rs in corpus["files"] for r in rs)
    assert sum(s["documents"] for s in fw.values()) == rows - nulls
    assert sum(s["rejected_by_reason"].get("null_text", 0) for s in fw.values()) == nulls
    assert sum(s["documents"] for s in _stats(ws, "saved").values()) == 50
    (ren,) = _stats(ws, "renamed").values()
    assert ren["documents"] == 30 and ren["key"] == "content"
    (cut,) = _stats(ws, "cut").values()
    assert cut["rejected_by_reason"] == {"unreadable_file": 1}
    # tokenized like any jsonl chunk (curated first for fw)
    tok = json.loads(ws.path("data/tokens/gpt2/fw/chunk-00000_text_document.stats.json").read_text())
    kept = ws.path("data/curated/fw/chunk-00000.jsonl").read_text().splitlines()
    removed = ws.path("data/curated/fw/chunk-00000.removed.jsonl").read_text().splitlines()
    assert tok["documents"] == len(kept) and len(kept) + len(removed) == fw["chunk-00000"]["documents"]
    ws.age()
    assert ws.nothing_to_do("data/tokens/gpt2/blend.json")

    # rewrite one file (same row groups, one text changed): only its own chunks rerun
    victim, n_rg, _ = corpus["files"][2]
    tbl = pq.read_table(victim)
    texts = tbl["text"].to_pylist()
    texts[0] = "a rewritten first document"
    import pyarrow as pa

    tbl = tbl.set_column(0, "text", pa.array(texts, pa.string()))
    pq.write_table(tbl, victim, row_group_size=-(-tbl.num_rows // n_rg), compression="gzip")
    before = ws.snapshot()
    ws.run("data")
    changed = {p for p in ws.changed(before) if p.startswith("data/jsonl/")}
    mine = [f"chunk-{i:05d}" for i in range(5, 9)]  # file 2's four chunks (after 2 + 3 of files 0 and 1)
    assert changed == {f"data/jsonl/fw/{c}{ext}" for c in mine for ext in (".jsonl", ".stats.json", ".rejected.jsonl")}
    first = ws.path("data/jsonl/fw/chunk-00005.jsonl").read_text().splitlines()[0]
    assert json.loads(first)["text"] == "a rewritten first document"


def test_fineweb_example_plans_on_a_cpu(workspace):
    shutil.copytree(REPO / "resources" / "tokenizers", workspace.root / "resources" / "tokenizers")
    shutil.copy(REPO / "config" / "examples" / "fineweb-parquet.yaml", workspace.config_path)
    out = workspace.run("-n").stdout
    stats = out.split("Job stats:", 1)[1]
    counts = {ln.split()[0]: int(ln.split()[1]) for ln in stats.splitlines()[3:] if len(ln.split()) == 2 and ln.split()[1].isdigit()}  # fmt: skip
    assert counts["download"] == counts["chunk"] == counts["tokenize"] == 14
    lst = workspace.path("data/plan/fineweb-edu/chunk-00013.list").read_text()
    assert "/resolve/87f09149ef4734204d70ed1d046ddc9ca3f2b8f9/sample/10BT/013_00000.parquet" in lst
    assert "--token-env HF_TOKEN" in workspace.run("-n", "-p", "data").stdout
