"""The data stage of an ``http`` source, end to end: real ``snakemake``, real local HTTP server.

A SlimPajama-style URL template (``chunk{1..2}/example_train_{0..7}.jsonl.zst``)
points at tests/httpserver.py serving the shipped WikiText shards; the
workflow downloads per chunk (one job per chunk, manifests with sha256), builds
the chunk jsonl from the manifests, and a rerun neither schedules a job nor
sends a request.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import zstandard
from conftest import REPO
from httpserver import ShardServer

from snakellm.data.planning import url_to_relpath

pytestmark = pytest.mark.slow

TEMPLATE = "chunk{1..2}/example_train_{0..7}.jsonl.zst"
# natural order, 6 per chunk: chunk-00000 = chunk1/0..5, chunk-00001 = chunk1/6,7 + chunk2/0..3, chunk-00002 = chunk2/4..7
CHUNKS = {
    "chunk-00000": [f"chunk1/example_train_{i}.jsonl.zst" for i in range(6)],
    "chunk-00001": [f"chunk1/example_train_{i}.jsonl.zst" for i in (6, 7)]
    + [f"chunk2/example_train_{i}.jsonl.zst" for i in range(4)],
    "chunk-00002": [f"chunk2/example_train_{i}.jsonl.zst" for i in range(4, 8)],
}
TARGETS = [f"data/jsonl/web/{c}.jsonl" for c in CHUNKS]


def documents(raw: bytes) -> int:
    """Valid documents in a shard, counted independently of snakellm chunk."""
    text = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    return sum(1 for line in text.splitlines() if line.strip() and json.loads(line).get("text", "").strip())


@pytest.fixture
def srv(tmp_path):
    root = tmp_path / "www"
    shutil.copytree(REPO / "resources" / "corpus" / "wikitext", root)
    with ShardServer(root) as s:
        yield s


@pytest.fixture
def ws(workspace, srv):
    workspace.write_config(
        {
            "sources": {
                "web": {
                    "kind": "http",
                    "url": srv.url(TEMPLATE),
                    "format": "jsonl.zst",
                    "shards_per_chunk": 6,
                }
            },
            "download": {"concurrency": 4, "retries": 3, "backoff_s": 0.01, "max_backoff_s": 0.05, "timeout_s": 10},
        }
    )
    return workspace


def test_http_source_downloads_chunks_and_a_rerun_fetches_nothing(ws, srv):
    # faults on the way: the workflow must still come out right
    srv.inject(CHUNKS["chunk-00001"][3], {"status": 429, "headers": {"Retry-After": "0"}}, {"status": 503})
    half = (srv.root / CHUNKS["chunk-00002"][1]).stat().st_size // 2
    srv.inject(CHUNKS["chunk-00002"][1], {"drop_after": half})
    ws.run(*TARGETS)

    total_docs = 0
    for chunk, rels in CHUNKS.items():
        man = json.loads(ws.path(f"data/raw/web/{chunk}.manifest.json").read_text())
        assert [s["url"] for s in man["shards"]] == [srv.url(r) for r in rels]
        for rel, entry in zip(rels, man["shards"]):
            want = (srv.root / rel).read_bytes()
            local = ws.path(f"data/raw/web/{entry['path']}")
            assert local == ws.path("data/raw/web/shards") / url_to_relpath(srv.url(rel))
            assert local.read_bytes() == want
            assert (entry["size"], entry["sha256"]) == (len(want), hashlib.sha256(want).hexdigest())
        stats = json.loads(ws.path(f"data/jsonl/web/{chunk}.stats.json").read_text())
        expected = sum(documents((srv.root / r).read_bytes()) for r in rels)
        assert stats["documents"] == expected and stats["rejected"] == 0
        lines = ws.path(f"data/jsonl/web/{chunk}.jsonl").read_bytes().splitlines()
        assert len(lines) == expected and all(json.loads(x)["text"].strip() for x in lines)
        total_docs += expected
    assert total_docs == 62  # every WikiText-2 test article
    assert len(srv.seen()) == 16 + 2 + 1  # each shard once, plus the 429, the 503 and the resumed tail
    assert [r.range for r in srv.seen(CHUNKS["chunk-00002"][1])] == [None, f"bytes={half}-"]
    # the report's download table counts those retries (from the download jobs' logs)
    ws.run("results/report/data/web.download.html")
    page = ws.path("results/report/data/web.download.html").read_text()
    assert '<td>total</td><td class="num">16</td>' in page  # 16 shards
    assert re.search(r'<td class="num">19</td><td class="num">3</td>', page)  # 19 requests, 3 retries
    assert "HTTP 429" in page and "HTTP 503" in page

    ws.age()
    before = ws.snapshot()
    srv.clear()
    assert ws.nothing_to_do(*TARGETS)
    ws.run(*TARGETS)
    assert ws.changed(before) == set()
    assert srv.seen() == [], "a rerun sent requests"

    # re-planning (4 shards per chunk instead of 6) reruns the jobs but fetches nothing:
    # shards live by URL, not by chunk
    cfg = ws.read_config()
    cfg["sources"]["web"]["shards_per_chunk"] = 4
    ws.write_config(cfg)
    ws.run(*[f"data/jsonl/web/chunk-0000{i}.jsonl" for i in range(4)])
    assert srv.seen() == [], "re-planning chunks downloaded shards again"
    mans = [json.loads(ws.path(f"data/raw/web/chunk-0000{i}.manifest.json").read_text()) for i in range(4)]
    assert [len(m["shards"]) for m in mans] == [4, 4, 4, 4]
    assert (
        sum(json.loads(ws.path(f"data/jsonl/web/chunk-0000{i}.stats.json").read_text())["documents"] for i in range(4))
        == 62
    )


def test_failed_shard_fails_its_job_naming_the_url_and_the_retry_fetches_only_it(ws, srv):
    missing = CHUNKS["chunk-00000"][2]
    data = (srv.root / missing).read_bytes()
    (srv.root / missing).unlink()
    proc = ws.run(*TARGETS, "--keep-going", check=False)
    assert proc.returncode != 0
    log = ws.path("logs/download/web/chunk-00000.log").read_text()
    assert f"{srv.url(missing)}: HTTP 404" in log
    assert not ws.path("data/raw/web/chunk-00000.manifest.json").exists()
    assert ws.path("data/jsonl/web/chunk-00001.jsonl").exists()  # the other chunks went through
    shards = ws.path("data/raw/web/shards")
    for rel in CHUNKS["chunk-00000"]:
        assert (shards / url_to_relpath(srv.url(rel))).exists() == (rel != missing)

    (srv.root / missing).write_bytes(data)
    srv.clear()
    ws.run(*TARGETS)
    assert [r.path for r in srv.seen()] == ["/" + missing]
    assert json.loads(ws.path("data/jsonl/web/chunk-00000.stats.json").read_text())["documents"] == sum(
        documents((srv.root / r).read_bytes()) for r in CHUNKS["chunk-00000"]
    )


def test_deleted_or_damaged_shard_is_fetched_again_by_the_next_run(ws, srv):
    ws.run(*TARGETS)
    shards = ws.path("data/raw/web/shards")
    gone = CHUNKS["chunk-00001"][2]
    (shards / url_to_relpath(srv.url(gone))).unlink()  # deleted by hand
    ws.age()
    before = ws.snapshot()
    srv.clear()
    ws.run(*TARGETS)  # the next run: no "shard not found", it downloads it again
    assert [r.path for r in srv.seen()] == ["/" + gone]
    changed = ws.changed(before)
    assert "data/jsonl/web/chunk-00001.jsonl" in changed and "data/jsonl/web/chunk-00000.jsonl" not in changed

    # same size, other bytes (a flipped bit on disk): the chunk job fails naming the shard and
    # its URL, removes the copy, and the run after that downloads it again
    bad = shards / url_to_relpath(srv.url(CHUNKS["chunk-00002"][0]))
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 1
    bad.write_bytes(bytes(raw))
    ws.path("data/jsonl/web/chunk-00002.jsonl").unlink()
    proc = ws.run(*TARGETS, check=False)
    assert proc.returncode != 0
    log = ws.path("logs/chunk/web/chunk-00002.log").read_text()
    assert str(bad.relative_to(ws.root)) in log and srv.url(CHUNKS["chunk-00002"][0]) in log and "sha256" in log
    assert "the next run downloads it again" in log and not bad.exists()
    assert not ws.path("data/jsonl/web/chunk-00002.jsonl").exists()
    srv.clear()
    ws.run(*TARGETS)
    assert [r.path for r in srv.seen()] == ["/" + CHUNKS["chunk-00002"][0]]
    assert bad.read_bytes() == (srv.root / CHUNKS["chunk-00002"][0]).read_bytes()
    dry = ws.run("-n", *TARGETS)
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout


def test_damaged_body_with_a_matching_content_length_is_fetched_again_by_the_next_run(ws, srv):
    """A server sent a cut-short file with a 200 and its own Content-Length: the download took it as complete
    (its sha256 went into the manifest) and the chunk job failed on it at every run, never fetching it again."""
    rel = CHUNKS["chunk-00000"][1]
    good = (srv.root / rel).read_bytes()
    (srv.root / rel).write_bytes(good[: len(good) // 2])  # what the server has, for now
    proc = ws.run(*TARGETS, "--keep-going", check=False)
    assert proc.returncode != 0
    log = ws.path("logs/chunk/web/chunk-00000.log").read_text()
    local = ws.path("data/raw/web/shards") / url_to_relpath(srv.url(rel))
    assert "truncated zstd data" in log and srv.url(rel) in log and "the next run downloads it again" in log
    assert not local.exists() and not ws.path("data/jsonl/web/chunk-00000.jsonl").exists()
    assert ws.path("data/jsonl/web/chunk-00001.jsonl").exists()
    (srv.root / rel).write_bytes(good)  # the server is fixed
    srv.clear()
    ws.run(*TARGETS)
    assert [r.path for r in srv.seen()] == ["/" + rel]
    assert local.read_bytes() == good
    stats = json.loads(ws.path("data/jsonl/web/chunk-00000.stats.json").read_text())
    assert stats["documents"] == sum(documents((srv.root / r).read_bytes()) for r in CHUNKS["chunk-00000"])
