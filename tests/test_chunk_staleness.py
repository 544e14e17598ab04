"""Content-aware staleness of local shards and names of any bytes, proven by real ``snakemake`` runs.

Snakemake compares mtimes; a shard replaced by other content with an older
mtime (``cp -p``, ``rsync -a``, ``tar x``, ``mv`` of an older file) used to
leave its chunk stale with "Nothing to be done". The planner now compares each
shard's size, mtime, ctime and inode with what its chunk recorded and reruns
exactly that chunk.
"""

from __future__ import annotations

import json
import os

import pytest
import zstandard
from conftest import small_config

pytestmark = pytest.mark.slow

WIKI = [f"data/jsonl/wikitext/chunk-0000{i}" for i in range(3)]


def outputs(stem: str) -> set[str]:
    return {f"{stem}.jsonl", f"{stem}.stats.json", f"{stem}.rejected.jsonl"}


def test_shard_replaced_with_an_older_mtime_reruns_exactly_its_chunk(workspace):
    ws = workspace
    ws.write_config(small_config(ws.root))
    ws.run("data")
    ws.age()
    shard = ws.path("resources/corpus/wikitext/chunk2/example_train_1.jsonl.zst")  # in chunk-00001
    old = shard.stat()
    docs = [json.dumps({"text": f"replacement document {i}"}).encode() + b"\n" for i in range(3)]
    repl = ws.path("replacement.jsonl.zst")
    repl.write_bytes(zstandard.ZstdCompressor().compress(b"".join(docs)))
    # an older file moved over the shard: older mtime than the chunk's outputs
    os.utime(repl, ns=(old.st_atime_ns - 3600 * 10**9, old.st_mtime_ns - 3600 * 10**9))
    os.replace(repl, shard)
    assert shard.stat().st_mtime_ns < ws.path(f"{WIKI[1]}.jsonl").stat().st_mtime_ns
    before = ws.snapshot()
    dry = ws.run("-n", "data")
    assert "Nothing to be done" not in dry.stdout + dry.stderr
    assert "chunk2/example_train_1.jsonl.zst changed since its chunk was built" in dry.stderr
    ws.run("data")
    assert ws.changed(before) == outputs(WIKI[1]) | {"data/plan/wikitext/chunk-00001.list"}
    out = ws.path(f"{WIKI[1]}.jsonl").read_bytes()
    assert b"".join(docs) in out
    st = json.loads(ws.path(f"{WIKI[1]}.stats.json").read_text())
    rec = next(r for r in st["per_shard"] if r["shard"].endswith("chunk2/example_train_1.jsonl.zst"))
    assert rec["documents"] == 3 and rec["stat"]["inode"] == shard.stat().st_ino
    # and then it is up to date again
    ws.age()
    before = ws.snapshot()
    assert ws.nothing_to_do("data")
    assert ws.changed(before) == set()


def test_shard_names_with_any_bytes_go_through_the_workflow(workspace):
    """A name that is not UTF-8 stopped the workflow at planning (UnicodeEncodeError); '#' names were dropped."""
    ws = workspace
    odd = ws.path("odd")
    odd.mkdir()
    names = [b"#hash.jsonl", b"new\nline.jsonl", b"caf\xe9.jsonl", b"plain.jsonl"]
    for i, name in enumerate(names):
        with open(os.path.join(os.fsencode(odd), name), "wb") as fh:
            fh.write(json.dumps({"text": f"document {i}"}).encode() + b"\n")
    ws.write_config(
        {"sources": {"odd": {"kind": "local", "path": "odd/*.jsonl", "format": "jsonl", "shards_per_chunk": 2}}}
    )
    ws.run("data")
    texts = []
    for c in ("chunk-00000", "chunk-00001"):
        texts += [json.loads(x)["text"] for x in ws.path(f"data/jsonl/odd/{c}.jsonl").read_text().splitlines()]
    assert sorted(texts) == [f"document {i}" for i in range(4)]
    ws.age()
    assert ws.nothing_to_do("data")
    # a non-UTF-8 name replaced with other content: still compared, still rerun
    target = os.path.join(os.fsencode(odd), b"caf\xe9.jsonl")
    with open(target, "wb") as fh:
        fh.write(json.dumps({"text": "changed"}).encode() + b"\n")
    os.utime(target, ns=(0, 10**18))
    ws.run("data")
    texts = []
    for c in ("chunk-00000", "chunk-00001"):
        texts += [json.loads(x)["text"] for x in ws.path(f"data/jsonl/odd/{c}.jsonl").read_text().splitlines()]
    assert "changed" in texts and "document 2" not in texts


def _record(tmp_path, shard):
    """A chunk's stats.json recording one shard as the chunk job does (identity from one stat, sha256 of its bytes)."""
    import hashlib

    from snakellm.data.planning import shard_identity

    stats = tmp_path / "c.stats.json"
    rec = {
        "shard": str(shard),
        "stat": shard_identity(shard.stat()),
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
    stats.write_text(json.dumps({"per_shard": [rec]}))
    return stats


def test_a_copied_workspace_is_not_stale_but_other_bytes_are(tmp_path):
    """Copied with its timestamps (new inode and ctime, same size and mtime): the sha256 decides."""
    import shutil

    from snakellm.data.planning import stale_local_chunk

    shard = tmp_path / "a.jsonl"
    shard.write_bytes(b'{"text": "one"}\n{"text": "two"}\n')
    stats = _record(tmp_path, shard)
    assert stale_local_chunk(stats, [str(shard)]) is None
    was = shard.stat()
    copy = tmp_path / "copy.jsonl"
    shutil.copy2(shard, copy)
    os.replace(copy, shard)
    assert shard.stat().st_ino != was.st_ino and shard.stat().st_mtime_ns == was.st_mtime_ns
    assert stale_local_chunk(stats, [str(shard)]) is None
    # the same size and mtime, other bytes: stale, naming the shard
    shard.write_bytes(b'{"text": "one"}\n{"text": "TWO"}\n')
    os.utime(shard, ns=(was.st_atime_ns, was.st_mtime_ns))
    why = stale_local_chunk(stats, [str(shard)])
    assert why is not None and "a.jsonl changed since its chunk was built" in why
