"""Property-based tests of the input classes round 2 of the data stage covers (a sibling of test_chunk_fuzz.py).

* multi-stream compressed files (bz2, xz, gzip, zstd with checksums) with a byte
  flipped, cut anywhere, or followed by trailing bytes: the job either fails
  naming the shard (and leaves no output) or returns exactly the documents the
  intact streams hold: never fewer in silence;
* a shard replaced by other content with its mtime preserved, or rewritten in
  place with the mtime set back: the planner's check marks its chunk stale;
* shard names of arbitrary bytes: the list file gives back exactly the names
  and the chunk reads every shard.

CI runs SNAKELLM_FUZZ_EXAMPLES (default 150) examples per property, like test_chunk_fuzz.py.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import time

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snakellm.data import chunk as chunkmod
from snakellm.data import planning
from snakellm.io.readers import DamagedShardError
from snakellm.steps import chunk as chunkstep

EXAMPLES = int(os.environ.get("SNAKELLM_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
)

COMPRESS = {
    "bz2": bz2.compress,
    "xz": lambda b: lzma.compress(b, format=lzma.FORMAT_XZ),
    "gz": gzip.compress,
    "zst": zstandard.ZstdCompressor(write_checksum=True).compress,
}
PADDED = ("xz", "gz")  # zero bytes between streams are padding in these formats

docs = st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=5).map(
    lambda ts: [json.dumps({"text": t + "."}).encode() + b"\n" for t in ts]
)


@st.composite
def multistream(draw):
    """(suffix, file bytes, documents per stream, stream end offsets, damage applied or None)."""
    suffix = draw(st.sampled_from(sorted(COMPRESS)))
    streams = draw(st.lists(docs, min_size=1, max_size=4))
    blobs = [COMPRESS[suffix](b"".join(d)) for d in streams]
    ends, pos = [], 0
    for b in blobs:
        pos += len(b)
        ends.append(pos)
    data = bytearray(b"".join(blobs))
    damage = draw(st.sampled_from(["none", "flip", "cut", "trailing"]))
    if damage == "flip":
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
    elif damage == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "trailing":
        data += draw(st.one_of(st.binary(min_size=1, max_size=40), st.just(b'{"text": "appended"}\n')))
    return suffix, bytes(data), streams, ends, damage


@pytest.mark.slow  # 4.5 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
@FUZZ
@given(case=multistream())
def test_multistream_damage_fails_or_keeps_every_document(tmp_path_factory, case):
    suffix, data, streams, ends, damage = case
    d = tmp_path_factory.mktemp("ms")
    p = d / f"s.jsonl.{suffix}"
    p.write_bytes(data)
    out = d / "out" / "c.jsonl"
    everything = b"".join(b"".join(s) for s in streams)
    try:
        st_ = chunkmod.build_chunk([str(p)], str(out), fmt="jsonl", show_progress=False)
    except DamagedShardError as e:
        assert str(p) in str(e)
        assert not out.parent.exists() or not any(out.parent.iterdir()), "a failed job left output behind"
        assert damage != "none"
        return
    got = out.read_bytes()
    if damage == "cut" and len(data) in [0, *ends]:
        # cut exactly between streams: a valid, shorter file (or an empty one: read as plain, no lines)
        k = [0, *ends].index(len(data))
        assert got == b"".join(b"".join(s) for s in streams[:k])
        return
    if damage == "trailing" and suffix in PADDED and not data[ends[-1] :].strip(b"\0"):
        assert got == everything  # zero padding
        return
    # anything else that passes must be the intact content (a flip in a field no decoder checks)
    assert damage in ("none", "flip"), f"{damage} passed: {st_['documents']} documents"
    assert got == everything


names = st.binary(min_size=1, max_size=12).filter(lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))


@pytest.mark.slow  # 2.4 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
@FUZZ
@given(raw_names=st.lists(names, min_size=1, max_size=4, unique=True))
def test_any_byte_string_name_survives_the_list_and_the_chunk(tmp_path_factory, raw_names):
    d = tmp_path_factory.mktemp("names")
    paths = []
    for i, name in enumerate(raw_names):
        full = os.path.join(os.fsencode(d), name)
        with open(full, "wb") as fh:
            fh.write(json.dumps({"text": f"doc {i}"}).encode() + b"\n")
        paths.append(os.fsdecode(full))
    lst = d / "c.list"
    planning.write_shard_list(lst, paths)
    assert planning.read_shard_list(lst) == paths
    rc = chunkstep.main(["--shard-list", str(lst), "-o", str(d / "out" / "c.jsonl"), "--no-progress"])
    assert rc == 0
    assert (d / "out" / "c.jsonl").read_bytes() == b"".join(
        json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(len(paths))
    )
    stats = json.loads((d / "out" / "c.stats.json").read_text())
    assert planning.stale_local_chunk(d / "out" / "c.stats.json", paths) is None
    assert [s["shard"] for s in stats["per_shard"]] == paths


@pytest.mark.slow  # ~4 s, mostly waiting for mtimes to tick: the slow tier (fast-tier budget)
@FUZZ
@given(old=docs, new=docs, how=st.sampled_from(["replace", "in_place"]), same_size=st.booleans())
def test_an_mtime_preserving_change_marks_the_chunk_stale(tmp_path_factory, old, new, how, same_size):
    d = tmp_path_factory.mktemp("stale")
    p = d / "s.jsonl"
    body_old, body_new = b"".join(old), b"".join(new)
    if same_size:  # the hardest case: same size and same mtime, other bytes
        body_new = (body_new + b" " * len(body_old))[: len(body_old)]
        if body_new == body_old:
            body_new = body_old[:-1] + (b"!" if body_old[-1:] != b"!" else b"?")
    elif body_new == body_old:  # unchanged bytes are rightly not stale: this test is about changed ones
        body_new += b'{"text": "changed"}\n'
    p.write_bytes(body_old)
    chunkmod.build_chunk([str(p)], str(d / "out" / "c.jsonl"), fmt="jsonl", show_progress=False)
    stats = d / "out" / "c.stats.json"
    assert planning.stale_local_chunk(stats, [str(p)]) is None
    before = p.stat()
    time.sleep(0.02)  # past the kernel's coarse timestamp tick, as any real replacement is
    if how == "replace":  # cp -p / rsync -a / mv of an older file: a new inode with the old mtime
        tmp = d / "new"
        tmp.write_bytes(body_new)
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(tmp, p)
    else:  # rewritten in place, mtime set back: only the ctime tells
        with open(p, "r+b") as fh:
            fh.truncate(0)
            fh.write(body_new)
        os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert p.stat().st_mtime_ns == before.st_mtime_ns
    why = planning.stale_local_chunk(stats, [str(p)])
    assert why is not None and str(p) in why
    shutil.rmtree(d)
