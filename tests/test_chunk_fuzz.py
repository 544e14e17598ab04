"""Property-based test of ``snakellm chunk``: nothing is ever lost silently.

Hypothesis builds chunks of 1-3 shards from valid and invalid JSON lines and
arbitrary bytes, joined with mixed line endings (LF, CRLF, lone CR), with or
without UTF-8 byte-order marks and a final newline, stored plain, gzip, bzip2,
zstd (one frame or several, with or without checksums), possibly truncated at
any byte and possibly under a format/name that says another compression. For
every case: either the job fails naming the damaged shard (and leaves no
output), or accepted + rejected = lines of every shard, every accepted line is a
JSON object with a non-empty string under the key, every rejected line is
recorded with its shard, line number and reason, and the output equals what a
slow reference reader (one-shot decompression, a regex line split, the
standard library's json) gives.

CI runs SNAKELLM_FUZZ_EXAMPLES (default 150) examples, well under a minute;
for a longer hunt: ``SNAKELLM_FUZZ_EXAMPLES=20000 pytest tests/test_chunk_fuzz.py``.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import re

import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snakellm.data import chunk as chunkmod
from snakellm.io.readers import DamagedShardError, compression_of

EXAMPLES = int(os.environ.get("SNAKELLM_FUZZ_EXAMPLES", "150"))
BOM = b"\xef\xbb\xbf"
KEY = "text"

# ----------------------------------------------------------------- generation

texts = st.text(min_size=0, max_size=40)
valid_doc = st.builds(lambda t, a: json.dumps({KEY: t + "x"}, ensure_ascii=a).encode(), texts, st.booleans())
any_doc = st.builds(
    lambda d, a: json.dumps(d, ensure_ascii=a).encode(),
    st.dictionaries(
        st.sampled_from([KEY, "meta", "id"]),
        st.one_of(texts, st.integers(), st.none(), st.lists(st.integers(), max_size=2)),
        max_size=3,
    ),
    st.booleans(),
)
json_value = st.builds(
    lambda v: json.dumps(v).encode(), st.one_of(st.integers(), texts, st.lists(st.integers(), max_size=3), st.none())
)
tricky = st.sampled_from(
    [
        b'{"text": "lone \\ud800 surrogate"}',
        b'{"text": "ok", "x": NaN}',
        b'{"text": "big", "x": 1e400}',
        b'{"text": "   "}',
        b'{"text": ""}',
        b"",
        b"   ",
        b"\t",
        b'{"text": "caf\xe9"}',
        b"\xff\xfe{}",
        b'{"text": "a"} trailing',
        b'{"text": "\\u2028 line separator"}',
        b'{"text": "x"}\x00',
        BOM + b'{"text": "inner bom"}',
        b"\x0b",
        b'{"text": "tab\\tand\\nnewline escaped"}',
        b"[1, 2]",
        b'"just a string"',
    ]
)
raw_bytes = st.binary(max_size=30)
line = st.one_of(valid_doc, valid_doc, any_doc, json_value, tricky, raw_bytes)
ending = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def shard_body(draw) -> bytes:
    lines = draw(st.lists(line, max_size=12))
    parts = [draw(st.sampled_from([b"", BOM])) if draw(st.booleans()) else b""]
    for i, ln in enumerate(lines):
        parts.append(ln)
        if i < len(lines) - 1 or draw(st.booleans()):  # sometimes no final newline
            parts.append(draw(ending))
    return b"".join(parts)


@st.composite
def shard(draw) -> tuple[str, bytes]:
    """(file suffix, stored bytes)."""
    body = draw(shard_body())
    comp = draw(st.sampled_from(["none", "gzip", "bz2", "zstd", "zstd-multi", "zstd-checksum"]))
    if comp == "gzip":
        blob = gzip.compress(body, mtime=0)
    elif comp == "bz2":
        blob = bz2.compress(body)
    elif comp.startswith("zstd"):
        c = zstandard.ZstdCompressor(write_checksum=comp == "zstd-checksum", write_content_size=draw(st.booleans()))
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3))) if comp == "zstd-multi" else []
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        blob = b"".join(c.compress(p) for p in pieces)
    else:
        blob = body
    if draw(st.integers(0, 3)) == 0:  # a download or copy cut short, at any byte
        blob = blob[: draw(st.integers(0, len(blob)))]
    # the name usually matches the data, sometimes not (a .gz in a zstd source)
    named = {"none": ".jsonl", "gzip": ".jsonl.gz", "bz2": ".jsonl.bz2"}.get(comp, ".jsonl.zst")
    suffix = draw(st.sampled_from([named, named, ".jsonl", ".jsonl.zst", ".jsonl.gz"]))
    return suffix, blob


# ----------------------------------------------------------------- the slow reference reader


def ref_decompress(blob: bytes, declared: str) -> bytes:
    """One-shot decompression by magic bytes; DamagedShardError where the data is damaged."""
    if blob[:4] == b"\x28\xb5\x2f\xfd":
        out, rest = b"", blob
        while rest:
            obj = zstandard.ZstdDecompressor().decompressobj()
            try:
                out += obj.decompress(rest)
            except zstandard.ZstdError as e:
                raise DamagedShardError(f"corrupt zstd: {e}") from None
            if not obj.eof:
                raise DamagedShardError("truncated zstd")
            rest = obj.unused_data
        return out
    if blob[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(blob)
        except (EOFError, OSError) as e:
            raise DamagedShardError(f"gzip: {e}") from None
    if blob[:3] == b"BZh" and blob[3:4].isdigit():
        try:
            return bz2.decompress(blob)
        except (EOFError, OSError, ValueError) as e:
            raise DamagedShardError(f"bz2: {e}") from None
    if declared != "none":
        raise DamagedShardError(f"not {declared}")
    return blob


def _finite(x: str) -> float:
    v = float(x)
    if v in (float("inf"), float("-inf")):
        raise OverflowError(x)
    return v


def ref_classify(body: bytes) -> tuple[str | None, bytes]:
    """(reason or None, the line as it must appear) for one line without its terminator."""
    if body.startswith(BOM):
        body = body[3:]
    if not body.strip():
        return "blank_line", body
    try:
        s = body.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8", body
    try:
        obj = json.loads(s, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)), parse_float=_finite)
    except OverflowError:
        return "unsupported_json", body
    except ValueError:
        return "invalid_json", body
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "invalid_unicode", body
    if not isinstance(obj, dict):
        return "not_object", body
    if KEY not in obj:
        return "missing_key", body
    if not isinstance(obj[KEY], str):
        return "not_string", body
    if not obj[KEY].strip():
        return "empty_text", body
    return None, body


def ref_lines(data: bytes) -> list[bytes]:
    parts = re.split(rb"\r\n|\r|\n", data)
    return parts[:-1] if parts and parts[-1] == b"" else parts


# ----------------------------------------------------------------- the property


@pytest.mark.slow  # hypothesis's 150 examples: ~6 s; the fast tier's 90 s has no room
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(shards=st.lists(shard(), min_size=1, max_size=3), fmt=st.sampled_from(["jsonl", "jsonl.zst", "jsonl.gz"]))
def test_chunk_never_loses_a_line_silently(tmp_path_factory, shards, fmt):
    d = tmp_path_factory.mktemp("fuzz")
    paths = []
    for i, (suffix, blob) in enumerate(shards):
        p = d / f"shard{i}{suffix}"
        p.write_bytes(blob)
        paths.append(str(p))
    out = d / "out" / "c.jsonl"

    # the reference: what must come out, or which shard must fail
    want_out, want_rej, damaged = b"", [], None
    per_shard_lines = []
    for p, (_, blob) in zip(paths, shards, strict=True):
        try:
            data = ref_decompress(blob, compression_of(p, fmt))
        except DamagedShardError:
            damaged = p
            break
        lines = ref_lines(data)
        per_shard_lines.append(len(lines))
        for n, body in enumerate(lines, start=1):
            reason, kept = ref_classify(body)
            if reason is None:
                want_out += kept + b"\n"
            else:
                want_rej.append((p, n, reason, kept.decode("utf-8", "backslashreplace")))

    if damaged is not None:
        with pytest.raises(DamagedShardError) as err:
            chunkmod.build_chunk(paths, str(out), fmt=fmt, key=KEY, show_progress=False)
        assert damaged in str(err.value)
        assert not out.parent.exists() or not any(out.parent.iterdir()), "a failed job left output behind"
        return

    st_ = chunkmod.build_chunk(paths, str(out), fmt=fmt, key=KEY, show_progress=False)
    got = out.read_bytes()
    rejected = [orjson.loads(x) for x in (d / "out" / "c.rejected.jsonl").read_bytes().splitlines()]
    assert [s["lines"] for s in st_["per_shard"]] == per_shard_lines
    assert st_["documents"] + st_["rejected"] == st_["lines_read"] == sum(per_shard_lines)
    for x in got.splitlines():
        obj = orjson.loads(x)
        assert type(obj) is dict and isinstance(obj[KEY], str) and obj[KEY].strip()
    assert got == want_out
    assert [(r["shard"], r["line"], r["reason"], r["content"]) for r in rejected] == want_rej
