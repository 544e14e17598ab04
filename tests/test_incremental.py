"""Incremental rebuilds of the data stage, proven by real `snakemake` runs.

Each test builds the data stage of a small config once, changes one thing, and
checks by output mtimes exactly which chunks were rebuilt.
"""

from __future__ import annotations

import json
import shutil

import pytest
import zstandard
from conftest import small_config

pytestmark = pytest.mark.slow

WIKI = [f"data/jsonl/wikitext/chunk-0000{i}" for i in range(3)]
BOTCHAN = "data/jsonl/botchan/chunk-00000"


def outputs(stem: str) -> set[str]:
    return {f"{stem}.jsonl", f"{stem}.stats.json", f"{stem}.rejected.jsonl"}


@pytest.fixture
def built(workspace):
    workspace.write_config(small_config(workspace.root))
    workspace.run("data")
    workspace.age()
    return workspace


def test_first_build_has_every_document_and_rerun_has_nothing_to_do(built):
    total = 0
    for stem in WIKI:
        st = json.loads(built.path(f"{stem}.stats.json").read_text())
        assert st["rejected"] == 0
        total += st["documents"]
    assert total == 62  # every WikiText-2 test article
    assert json.loads(built.path(f"{BOTCHAN}.stats.json").read_text())["documents"] == 149
    before = built.snapshot()
    assert built.nothing_to_do("data")
    built.run("data")
    assert built.changed(before) == set()


def test_modifying_one_shard_reruns_exactly_its_chunk(built):
    before = built.snapshot()
    # chunk-00001 holds chunk1/example_train_6,7 and chunk2/example_train_0..3
    shard = built.path("resources/corpus/wikitext/chunk2/example_train_1.jsonl.zst")
    docs = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
    extra = json.dumps({"text": "an added document"}).encode() + b"\n" + b"not json\n"
    shard.write_bytes(zstandard.ZstdCompressor().compress(docs + extra))
    built.run("data")
    # the planner saw the shard differ from what the chunk recorded: the chunk's list got a note
    # naming it (that is what reruns the chunk), nothing else moved
    assert built.changed(before) == outputs(WIKI[1]) | {"data/plan/wikitext/chunk-00001.list"}
    assert "chunk2/example_train_1.jsonl.zst changed" in built.path("data/plan/wikitext/chunk-00001.list").read_text()
    st = json.loads(built.path(f"{WIKI[1]}.stats.json").read_text())
    assert st["rejected_by_reason"] == {"invalid_json": 1}
    rej = json.loads(built.path(f"{WIKI[1]}.rejected.jsonl").read_text())
    assert rej["shard"].endswith("chunk2/example_train_1.jsonl.zst") and rej["reason"] == "invalid_json"


def test_appending_a_shard_reruns_only_the_last_chunk(built):
    before = built.snapshot()
    src = built.path("resources/corpus/wikitext/chunk2/example_train_7.jsonl.zst")
    shutil.copy(src, built.path("resources/corpus/wikitext/chunk2/example_train_8.jsonl.zst"))
    built.run("data")
    # the shard list file of the last chunk changed with it (the job reads its shards from there)
    assert built.changed(before) == outputs(WIKI[2]) | {"data/plan/wikitext/chunk-00002.list"}
    st = json.loads(built.path(f"{WIKI[2]}.stats.json").read_text())
    assert st["shards"] == 5 and st["per_shard"][-1]["shard"].endswith("example_train_8.jsonl.zst")


def test_changing_shards_per_chunk_reruns_only_that_source(built):
    cfg = built.read_config()
    cfg["sources"]["wikitext"]["shards_per_chunk"] = 4  # 16 shards -> 4 chunks
    built.write_config(cfg)
    before = built.snapshot()
    built.run("data")
    changed = built.changed(before)
    lists = {f"data/plan/wikitext/chunk-0000{i}.list" for i in range(4)}
    assert changed == set().union(lists, *(outputs(f"data/jsonl/wikitext/chunk-0000{i}") for i in range(4)))
    assert not any("botchan" in p for p in changed)
    assert built.nothing_to_do("data")


def test_unrelated_config_edit_reruns_nothing(built):
    cfg = built.read_config()
    cfg["download"] = {"retries": 3}
    cfg["sources"]["botchan"]["weight"] = 2.0  # a blend weight: no data-stage output depends on it
    built.write_config(cfg)
    before = built.snapshot()
    built.run("data")
    assert built.changed(before) == set()
