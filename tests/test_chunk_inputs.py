"""``snakellm chunk`` on inputs that used to pass quietly or fail with a traceback naming nothing.

Every case uses real files (FIFOs, directories, names with a newline or bytes
that are not UTF-8, multi-stream files made by concatenating real streams, a
``zstd --long=31`` file from the zstd command when it is installed) and checks
that the job either counts every line exactly or fails naming the shard and
leaves no output.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zstandard

from snakellm.data import chunk as chunkmod
from snakellm.data import planning
from snakellm.io.readers import DamagedShardError
from snakellm.steps import chunk as chunkstep

DOCS = [json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(10)]


def _build(tmp_path: Path, shards: list[str], fmt: str = "jsonl", **kw) -> dict:
    return chunkmod.build_chunk(shards, str(tmp_path / "out" / "c.jsonl"), fmt=fmt, show_progress=False, **kw)


def _no_output(tmp_path: Path) -> bool:
    out = tmp_path / "out"
    return not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------- multi-stream compression


COMPRESS = {"bz2": bz2.compress, "xz": lambda b: lzma.compress(b, format=lzma.FORMAT_XZ), "gz": gzip.compress}


@pytest.mark.parametrize("suffix", ["bz2", "xz", "gz"])
def test_concatenated_streams_are_read_to_the_end(tmp_path, suffix):
    comp = COMPRESS[suffix]
    p = tmp_path / f"s.jsonl.{suffix}"
    p.write_bytes(comp(b"".join(DOCS[:5])) + comp(b"".join(DOCS[5:])))
    st = _build(tmp_path, [str(p)])
    assert st["documents"] == 10 and st["rejected"] == 0
    assert (tmp_path / "out" / "c.jsonl").read_bytes() == b"".join(DOCS)


@pytest.mark.parametrize("suffix", ["bz2", "xz", "gz"])
def test_damaged_second_stream_fails_naming_shard_and_offset(tmp_path, suffix):
    """`cat a.bz2 b.bz2` with b's header damaged: was exit 0 with 5 of 10 documents (bz2, xz)."""
    comp = COMPRESS[suffix]
    a, b = comp(b"".join(DOCS[:5])), bytearray(comp(b"".join(DOCS[5:])))
    b[1] ^= 0xFF  # the second stream's magic
    p = tmp_path / f"s.jsonl.{suffix}"
    p.write_bytes(a + bytes(b))
    with pytest.raises(DamagedShardError) as err:
        _build(tmp_path, [str(p)])
    assert str(p) in str(err.value) and f"byte {len(a)}" in str(err.value), err.value
    assert _no_output(tmp_path)


@pytest.mark.parametrize("suffix", ["bz2", "xz", "gz"])
def test_plain_lines_after_a_stream_fail(tmp_path, suffix):
    """A bz2 stream followed by plain jsonl lines: the lines used to vanish."""
    a = COMPRESS[suffix](b"".join(DOCS[:5]))
    p = tmp_path / f"s.jsonl.{suffix}"
    p.write_bytes(a + b"".join(DOCS[5:]))
    with pytest.raises(DamagedShardError) as err:
        _build(tmp_path, [str(p)])
    assert str(p) in str(err.value) and f"byte {len(a)}" in str(err.value), err.value


@pytest.mark.parametrize("suffix", ["xz", "gz"])
def test_zero_padding_between_streams_is_allowed_where_the_format_allows_it(tmp_path, suffix):
    comp = COMPRESS[suffix]
    p = tmp_path / f"s.jsonl.{suffix}"
    p.write_bytes(comp(b"".join(DOCS[:5])) + b"\0" * 8 + comp(b"".join(DOCS[5:])) + b"\0" * 4)
    assert _build(tmp_path, [str(p)])["documents"] == 10


def test_truncated_bz2_stream_in_the_middle_of_a_multistream_file_fails(tmp_path):
    a, b = bz2.compress(b"".join(DOCS[:5])), bz2.compress(b"".join(DOCS[5:]))
    p = tmp_path / "s.jsonl.bz2"
    p.write_bytes(a + b[: len(b) // 2])
    with pytest.raises(DamagedShardError, match="truncated bzip2"):
        _build(tmp_path, [str(p)])


def test_zstd_long_window_is_valid_input(tmp_path):
    """A valid `zstd --long=31` file was called corrupt ("Frame requires too much memory")."""
    body = b"".join(DOCS) * 2000
    p = tmp_path / "s.jsonl.zst"
    if shutil.which("zstd"):
        src = tmp_path / "s.jsonl"
        src.write_bytes(body)
        # from stdin: no content size in the frame, so the decoder must accept the 2 GiB window
        with open(src, "rb") as fin, open(p, "wb") as fout:
            subprocess.run(["zstd", "-q", "--long=31", "-c"], stdin=fin, stdout=fout, check=True)
    else:
        params = zstandard.ZstdCompressionParameters.from_level(3, window_log=31, enable_ldm=True)
        cctx = zstandard.ZstdCompressor(compression_params=params)
        with open(p, "wb") as fh, cctx.stream_writer(fh, closefd=False) as w:
            w.write(body)
    header = zstandard.get_frame_parameters(p.read_bytes()[:18])
    assert header.window_size == 1 << 31
    with pytest.raises(zstandard.ZstdError, match="too much memory"):  # what the default decoder says
        zstandard.ZstdDecompressor().decompressobj().decompress(p.read_bytes())
    assert _build(tmp_path, [str(p)], fmt="jsonl.zst")["documents"] == 20000


# ----------------------------------------------------------------- max_document_bytes


@pytest.mark.parametrize("suffix", ["", ".zst", ".gz", ".bz2"])
def test_too_long_lines_are_quarantined_with_their_size(tmp_path, suffix):
    big = json.dumps({"text": "x" * 5000}).encode() + b"\n"
    crlf = json.dumps({"text": "y" * 3000}).encode() + b"\r\n"
    tail = json.dumps({"text": "z" * 2000}).encode()  # the last line, no newline
    body = DOCS[0] + big + DOCS[1] + crlf + DOCS[2] + tail
    comp = {"": bytes, ".zst": zstandard.ZstdCompressor().compress, ".gz": gzip.compress, ".bz2": bz2.compress}
    p = tmp_path / f"s.jsonl{suffix}"
    p.write_bytes(comp[suffix](body))
    st = _build(tmp_path, [str(p)], limits=chunkmod.Limits(max_document_bytes=1000))
    assert (st["documents"], st["rejected"], st["lines_read"]) == (3, 3, 6)
    assert st["rejected_by_reason"] == {"too_long": 3}
    assert (tmp_path / "out" / "c.jsonl").read_bytes() == DOCS[0] + DOCS[1] + DOCS[2]
    rej = [json.loads(x) for x in (tmp_path / "out" / "c.rejected.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r["reason"], r["bytes"]) for r in rej] == [
        (2, "too_long", len(big)),
        (4, "too_long", len(crlf)),
        (6, "too_long", len(tail)),
    ]
    assert all(len(r["content"]) <= 1024 and r["content"].startswith('{"text": "') for r in rej)
    assert st["bytes_in"] == len(body)


def test_too_long_line_split_over_many_blocks_and_cr_endings(tmp_path):
    """A line of 3 MiB (three read blocks) ended by a lone CR at a block edge, then more lines."""
    from snakellm.io.readers import READ_SIZE

    line = b'{"text": "' + b"a" * (3 * READ_SIZE - 12) + b'"\r'  # ends exactly at a block edge
    assert len(line) == 3 * READ_SIZE
    p = tmp_path / "s.jsonl"
    p.write_bytes(line + b"\n" + DOCS[0] + line + DOCS[1])
    st = _build(tmp_path, [str(p)], limits=chunkmod.Limits(max_document_bytes=1 << 20))
    assert (st["documents"], st["rejected_by_reason"], st["lines_read"]) == (2, {"too_long": 2}, 4)
    rej = [json.loads(x) for x in (tmp_path / "out" / "c.rejected.jsonl").read_bytes().splitlines()]
    assert [r["bytes"] for r in rej] == [len(line) + 1, len(line)]


def test_text_formats_honour_max_document_bytes(tmp_path):
    blocks = tmp_path / "b.txt"
    blocks.write_bytes(b"short one\n\n" + b"long " * 400 + b"\nstill long\n\nlast\n")
    whole = tmp_path / "w.txt"
    whole.write_bytes(b"w" * 5000)
    st = _build(tmp_path, [str(blocks)], fmt="text-blocks", limits=chunkmod.Limits(max_document_bytes=1000))
    assert (st["documents"], st["rejected_by_reason"]) == (2, {"too_long": 1})
    shutil.rmtree(tmp_path / "out")
    st = _build(tmp_path, [str(whole)], fmt="text", limits=chunkmod.Limits(max_document_bytes=1000))
    assert (st["documents"], st["rejected_by_reason"]) == (0, {"too_long": 1})


BOMB_CHILD = textwrap.dedent(
    """
    import resource, sys, json
    from snakellm.data import chunk
    limit = int(sys.argv[3]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    st = chunk.build_chunk([sys.argv[1]], sys.argv[2], fmt="jsonl", show_progress=False,
                           limits=chunk.Limits(max_document_bytes=64 << 20))
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of a large pytest process would
    # report its parent's peak (750 MiB in the full suite) instead of its own.
    peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) >> 10
    print(json.dumps({"rejected": st["rejected_by_reason"], "documents": st["documents"], "peak_mib": peak}))
    """
)


@pytest.mark.slow  # ~5 s for both: the slow tier (fast-tier budget)
@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_decompression_bomb_is_read_in_bounded_memory(tmp_path, suffix):
    """A small file that expands to a 1.25 GiB line: was a MemoryError traceback; now quarantined as too_long.

    The job runs in a child process whose address space is capped (RLIMIT_AS) well below the line's size.
    """
    p = tmp_path / f"bomb.jsonl{suffix}"
    zero = b"\0" * (1 << 24)
    with open(p, "wb") as fh:
        w = (
            zstandard.ZstdCompressor(level=1).stream_writer(fh)
            if suffix == ".zst"
            else gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=1)
        )
        w.write(DOCS[0])
        for _ in range(80):  # 1.25 GiB of zeros, past the 900 MiB the child may map
            w.write(zero)
        w.write(b"\n" + DOCS[1])
        w.close()
    assert p.stat().st_size < (8 << 20 if suffix == ".zst" else 16 << 20)
    out = tmp_path / "out" / "c.jsonl"
    env = dict(os.environ, PYTHONPATH=str(Path(chunkmod.__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", BOMB_CHILD, str(p), str(out), "900"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.splitlines()[-1])
    assert res["rejected"] == {"too_long": 1} and res["documents"] == 2
    assert res["peak_mib"] < 600, res
    assert out.read_bytes() == DOCS[0] + DOCS[1]


# ----------------------------------------------------------------- the per-shard alarm


HTML = (
    b"<!DOCTYPE html>\n<html>\n<head><title>503</title></head>\n<body>\n"
    + b"<p>Service unavailable</p>\n" * 12
    + b"</body></html>\n"
)


def test_an_html_page_saved_as_jsonl_fails_naming_the_shard_and_its_top_reason(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"".join(DOCS) + b"not json\n")  # 1 of 11 rejected: fine
    page = tmp_path / "page.jsonl"
    page.write_bytes(HTML)
    with pytest.raises(chunkmod.RejectedFractionError) as err:
        _build(tmp_path, [str(good), str(page)], limits=chunkmod.Limits(max_rejected_fraction=0.5))
    msg = str(err.value)
    assert str(page) in msg and "invalid_json" in msg and "17 of 17" in msg, msg
    assert _no_output(tmp_path)
    # a source that expects it turns the alarm off
    st = _build(tmp_path, [str(good), str(page)], limits=chunkmod.Limits(max_rejected_fraction=1.0))
    assert (st["documents"], st["rejected"]) == (10, 18)


def test_the_alarm_needs_at_least_ten_lines(tmp_path):
    p = tmp_path / "short.jsonl"
    p.write_bytes(b"x\n" * 9)
    st = _build(tmp_path, [str(p)], limits=chunkmod.Limits(max_rejected_fraction=0.5))
    assert st["rejected"] == 9


def test_cli_alarm_exit_status_and_message(tmp_path, capsys):
    page = tmp_path / "page.jsonl"
    page.write_bytes(HTML)
    rc = chunkstep.main(
        [str(page), "-o", str(tmp_path / "out" / "c.jsonl"), "--max-rejected-fraction", "0.5", "--no-progress"]
    )
    assert rc == 1
    assert f"shard {page}: 17 of 17 lines rejected" in capsys.readouterr().err


# ----------------------------------------------------------------- local-file problems, named


def test_fifo_directory_and_missing_shard_are_named_as_such(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    for path, what in [
        (fifo, "is a FIFO (named pipe), not a regular file"),
        (d, "is a directory"),
        (tmp_path / "gone.jsonl", "shard not found"),
    ]:
        with pytest.raises(chunkmod.ShardFileError) as err:
            _build(tmp_path, [str(path)])
        assert what in str(err.value) and str(path) in str(err.value)
    dev = Path("/dev/null")
    with pytest.raises(chunkmod.ShardFileError, match="/dev/null is a character device"):
        _build(tmp_path, [str(dev)])


def test_unreadable_shard_is_named(tmp_path):
    """Was a PermissionError traceback. Root reads any file: as root, the job runs as `nobody` in a child."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="snakellm-perm-"))
    try:
        d.chmod(0o777)
        p = d / "secret.jsonl"
        p.write_bytes(DOCS[0])
        p.chmod(0)
        # everything imported first: `nobody` may not read the interpreter's own library
        child = "import os, sys, argparse, json\nfrom snakellm.steps import chunk\n"
        child += "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\nsys.exit(chunk.main(sys.argv[1:]))"
        env = dict(os.environ, PYTHONPATH=str(Path(chunkmod.__file__).resolve().parents[2]))
        proc = subprocess.run(
            [sys.executable, "-c", child, str(p), "-o", str(d / "out" / "c.jsonl"), "--no-progress"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 1, proc.stderr
        assert f"snakellm chunk: error: shard {p} cannot be read: permission denied" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


ODD_NAMES = ["#hash.jsonl", "new\nline.jsonl", os.fsdecode(b"caf\xe9.jsonl"), '"quoted".jsonl', " lead.jsonl"]


def test_any_name_a_filesystem_allows_goes_through_the_list_and_the_chunk(tmp_path, capsys):
    paths = []
    for i, name in enumerate(ODD_NAMES):
        p = tmp_path / "in" / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(DOCS[i] + b"not json\n")
        paths.append(str(p))
    lst = tmp_path / "c.list"
    planning.write_shard_list(lst, paths)
    text = lst.read_text(encoding="ascii")
    assert all(line.startswith(('"', "#")) for line in text.splitlines())
    assert planning.read_shard_list(lst) == paths
    rc = chunkstep.main(["--shard-list", str(lst), "-o", str(tmp_path / "out" / "c.jsonl"), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "c.jsonl").read_bytes() == b"".join(DOCS[: len(ODD_NAMES)])
    rej = [json.loads(x) for x in (tmp_path / "out" / "c.rejected.jsonl").read_bytes().splitlines()]
    assert [r["shard"] for r in rej][:2] == paths[:2]
    assert rej[2]["shard"].endswith("caf\\xe9.jsonl")  # undecodable bytes as escapes, never a crash
    stats = json.loads((tmp_path / "out" / "c.stats.json").read_text())
    assert [s["shard"] for s in stats["per_shard"]] == paths  # exact names, for the planner's check
    # an error about such a name stays on one line and names it unambiguously
    os.unlink(paths[1])
    rc = chunkstep.main(["--shard-list", str(lst), "-o", str(tmp_path / "out2" / "c.jsonl"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "shard not found: " + ascii(paths[1]) in err


@pytest.mark.slow  # 1.3 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_a_shard_changed_while_read_fails_naming_it(tmp_path, monkeypatch):
    """A shard rewritten during its chunk job: the old documents used to stay in the output."""
    from snakellm.io import readers

    p = tmp_path / "s.jsonl"
    p.write_bytes(b"".join(DOCS) * 50000)
    real = readers.HashingFile.readinto
    calls = []

    def readinto_then_append(self, b):  # another process appends while the job reads
        n = real(self, b)
        if not calls:
            calls.append(n)
            with open(p, "ab") as fh:
                fh.write(DOCS[0])
        return n

    monkeypatch.setattr(readers.HashingFile, "readinto", readinto_then_append)
    with pytest.raises(chunkmod.ShardFileError, match=f"shard {p} changed while it was read"):
        _build(tmp_path, [str(p)])
    assert _no_output(tmp_path)


def test_stats_record_each_shards_identity_and_sha256(tmp_path):
    import hashlib

    p = tmp_path / "s.jsonl.gz"
    p.write_bytes(gzip.compress(b"".join(DOCS)))
    st = _build(tmp_path, [str(p)])
    rec = st["per_shard"][0]
    s = p.stat()
    assert rec["stat"] == {"size": s.st_size, "mtime_ns": s.st_mtime_ns, "ctime_ns": s.st_ctime_ns, "inode": s.st_ino}
    assert rec["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert planning.stale_local_chunk(tmp_path / "out" / "c.stats.json", [str(p)]) is None
    # replaced by other content with the same mtime (cp -p, rsync -a): stale, naming the shard
    other = tmp_path / "other"
    other.write_bytes(gzip.compress(b"".join(DOCS[:3])))
    os.utime(other, ns=(s.st_atime_ns, s.st_mtime_ns))
    os.replace(other, p)
    why = planning.stale_local_chunk(tmp_path / "out" / "c.stats.json", [str(p)])
    assert why is not None and str(p) in why and "inode" in why


# ----------------------------------------------------------------- shard list format


def test_shard_list_format_holds_comment_like_and_multiline_names(tmp_path):
    names = ["# not a comment", "a\nb", "\r", '"', "\\", os.fsdecode(b"\xff\xfe"), "ünïcode"]
    p = tmp_path / "x.list"
    planning.write_shard_list(p, names, note="a note\nover two lines")
    assert planning.read_shard_list(p) == names
    assert p.read_text().count("\n") == len(names) + 3  # header + two note lines + one line per name
    # unchanged list: not rewritten; hand-written plain paths still read
    mtime = p.stat().st_mtime_ns
    planning.write_shard_list(p, names)
    assert p.stat().st_mtime_ns == mtime
    (tmp_path / "plain.list").write_text("a.jsonl\n# note\n\nb c.jsonl\n")
    assert planning.read_shard_list(tmp_path / "plain.list") == ["a.jsonl", "b c.jsonl"]
