#!/usr/bin/env python3
"""Benchmark: chunk throughput on jsonl.zst, parquet and WARC, each next to its reference in the same run.

jsonl.zst: real-text shards (the shipped WikiText-2 and Botchan documents, repeated in shuffled order to --mb
megabytes), timed as
  1. `zstd -dc SHARDS > /dev/null`              (decompression alone, the floor)
     `zstd -dc SHARDS > file`                    (decompression + writing the same bytes)
  2. `snakellm chunk SHARDS -o out.jsonl --threads 1|2` (decompress + validate every line + write + verify)
in MB/s of decompressed input.

parquet: FineWeb-shaped files (text, id, dump, url, file_path, language, language_score, token_count; snappy,
row groups of 1,000 rows; --parquet-mb of text), one core each (pyarrow's CPU pool set to 1 thread), CPU
seconds, best of --repeat (removing the last run's outputs untimed):
  1. pyarrow reading the text column (memory-mapped) into Python strings, file by file (the ceiling: any
     reader pays it)
  2. snakellm chunk (every column, validated, written as jsonl by its C writer, verified, hashed, published
     atomically), and the same stage on its orjson path (an install without a C compiler)
  3. datatrove's ParquetReader -> JsonlWriter (compression off) on the same files
in MB/s of text (UTF-8 bytes of the text column).

warc: CommonCrawl-shaped .warc.gz files of HTML responses (the same documents as pages) with request and
metadata records, a 404 and a non-HTML response among them: snakellm chunk against datatrove's WarcReader +
Trafilatura, in HTML documents per second.

usage: .venv/bin/python scripts/bench_chunk.py [--mb 200] [--shards 16] [--parquet-mb 200] [--pages 2000]
                                               [--repeat 5] [--formats jsonl,parquet,warc] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

REPO = Path(__file__).resolve().parent.parent


def shipped_docs() -> list[bytes]:
    docs = []
    d = zstandard.ZstdDecompressor()
    for p in sorted((REPO / "resources/corpus/wikitext").rglob("*.jsonl.zst")):
        with d.stream_reader(open(p, "rb")) as r:
            docs += [ln for ln in r.read().splitlines() if ln]
    docs += [ln for ln in (REPO / "resources/corpus/botchan/botchan.jsonl").read_bytes().splitlines() if ln]
    return docs


def bench_jsonl(a: argparse.Namespace, tmp: Path, docs: list[bytes]) -> None:
    rng = random.Random(0)
    target = int(a.mb * 1e6)
    per_shard = target // a.shards
    cctx = zstandard.ZstdCompressor(level=3)
    shards, total = [], 0
    for i in range(a.shards):
        buf, n = [], 0
        while n < per_shard:
            rng.shuffle(docs)
            for d in docs:
                buf.append(d + b"\n")
                n += len(d) + 1
                if n >= per_shard:
                    break
        p = tmp / f"example_train_{i}.jsonl.zst"
        p.write_bytes(cctx.compress(b"".join(buf)))
        shards.append(str(p))
        total += n
    comp = sum(Path(s).stat().st_size for s in shards)
    print(f"corpus: {a.shards} shards, {total / 1e6:.1f} MB decompressed, {comp / 1e6:.1f} MB zstd")

    t = time.perf_counter()
    subprocess.run(["zstd", "-q", "-dc", *shards], stdout=subprocess.DEVNULL, check=True)
    zs = time.perf_counter() - t

    t = time.perf_counter()
    with open(tmp / "zstd-out.jsonl", "wb") as fh:
        subprocess.run(["zstd", "-q", "-dc", *shards], stdout=fh, check=True)
    zf = time.perf_counter() - t
    (tmp / "zstd-out.jsonl").unlink()

    results = []
    for threads in (1, 2):
        t = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "snakellm.steps.chunk",
                *shards,
                "-o",
                str(tmp / "out.jsonl"),
                "--format",
                "jsonl.zst",
                "--threads",
                str(threads),
                "--no-progress",
            ],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        results.append((threads, time.perf_counter() - t))
        st = json.loads((tmp / "out.stats.json").read_text())
        assert st["documents"] + st["rejected"] == st["lines_read"] and st["bytes_in"] == total
    print(f"  zstd -dc > /dev/null  {total / 1e6 / zs:8.1f} MB/s  ({zs:.2f} s)")
    print(f"  zstd -dc > file       {total / 1e6 / zf:8.1f} MB/s  ({zf:.2f} s)")
    for threads, ck in results:
        print(
            f"  snakellm chunk -t{threads}    {total / 1e6 / ck:8.1f} MB/s  ({ck:.2f} s, {st['documents']} documents "
            f"validated, {ck / zs:.1f}x zstd's time)"
        )


def _best(fn, n: int = 2, setup=None) -> tuple[float, float]:
    """The best of ``n`` runs: (CPU seconds of this process, wall seconds). Per core is CPU time: the machine's
    other load and the page cache's writeback do not enter it. ``setup`` (untimed) runs before each."""
    times = []
    for _ in range(n):
        if setup is not None:
            setup()
        c, t = time.process_time(), time.perf_counter()
        fn()
        times.append((time.process_time() - c, time.perf_counter() - t))
    return min(times)


def make_parquet(tmp: Path, docs: list[bytes], mb: float, files: int) -> tuple[list[Path], int]:
    """FineWeb-shaped parquet files holding about ``mb`` MB of text; their paths and the text's UTF-8 bytes."""
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)
    # every document unique (as in a web corpus): lines drawn from the whole shipped corpus, so neither parquet's
    # dictionary encoding nor snappy sees whole repeated documents (about 2.5x compression, as FineWeb's files)
    lines = [ln for d in docs for ln in orjson.loads(d)["text"].split("\n") if ln.strip()]
    folder = tmp / "parquet"
    folder.mkdir()
    paths, total = [], 0
    for f in range(files):
        rows: list[str] = []
        n = 0
        while n < mb * 1e6 / files:
            t = "\n".join(rng.choice(lines) for _ in range(rng.randrange(5, 60)))
            rows.append(t)
            n += len(t.encode())
        total += n
        m = len(rows)
        tbl = pa.table(
            {
                "text": rows,
                "id": [f"<urn:uuid:{f:04d}-{i:08d}>" for i in range(m)],
                "dump": ["CC-MAIN-2024-10"] * m,
                "url": [f"https://example.org/{f}/{i}" for i in range(m)],
                "file_path": [f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{f}.warc.gz"] * m,
                "language": ["en"] * m,
                "language_score": [rng.random() for _ in range(m)],
                "token_count": [rng.randrange(50, 5000) for _ in range(m)],
            }
        )
        p = folder / f"{f:03d}_00000.parquet"
        pq.write_table(tbl, p, row_group_size=1000, compression="snappy")
        paths.append(p)
    return paths, total


def bench_parquet(a: argparse.Namespace, tmp: Path, docs: list[bytes]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import JsonlWriter

    from snakellm.data import columnar_jsonl
    from snakellm.data.chunk import build_chunk

    pa.set_cpu_count(1)  # per core: pyarrow decodes columns on its CPU pool otherwise
    pa.set_io_thread_count(1)
    paths, text_bytes = make_parquet(tmp, docs, a.parquet_mb, a.parquet_files)
    rgs = sum(pq.read_metadata(p).num_row_groups for p in paths)
    size = sum(p.stat().st_size for p in paths)
    print(
        f"parquet: {len(paths)} files, {text_bytes / 1e6:.1f} MB of text, {rgs} row groups, {size / 1e6:.1f} MB snappy"
    )
    out = tmp / "pq-out"
    out.mkdir()

    def ceiling() -> None:  # memory-mapped, as the chunk stage reads them
        for p in paths:
            for b in pq.ParquetFile(p, memory_map=True).iter_batches(columns=["text"], use_threads=False):
                b.column(0).to_pylist()

    def clean() -> None:  # the last run's outputs: removing them is no work of the stage
        for f in out.glob("snakellm.*"):
            f.unlink()
        shutil.rmtree(out / "datatrove", ignore_errors=True)

    def ours() -> None:
        st = build_chunk([str(p) for p in paths], str(out / "snakellm.jsonl"), fmt="parquet", show_progress=False)
        assert st["documents"] == st["lines_read"] > 0

    def theirs() -> None:
        w = JsonlWriter(str(out / "datatrove"), compression=None)
        for _ in w.run(ParquetReader(str(tmp / "parquet"), glob_pattern="*.parquet").run()):
            pass

    writer = "C writer" if columnar_jsonl.AVAILABLE else "orjson path: snakellm/data/_jsonl.c is not built"
    (c_ceil, w_ceil), (c_ours, w_ours) = _best(ceiling, a.repeat), _best(ours, a.repeat, clean)
    c_dt, w_dt = _best(theirs, a.repeat, clean)
    c_py = None
    if columnar_jsonl.AVAILABLE:  # the same stage without the C writer: what an install without a compiler gets
        columnar_jsonl.AVAILABLE = False
        try:
            c_py, _ = _best(ours, a.repeat, clean)
        finally:
            columnar_jsonl.AVAILABLE = True
    mb = text_bytes / 1e6
    print(
        f"  pyarrow text column -> str  {mb / c_ceil:8.1f} MB/s per core  ({c_ceil:.2f} s CPU, {w_ceil:.2f} s wall; the ceiling)"
    )
    print(
        f"  snakellm chunk -t1          {mb / c_ours:8.1f} MB/s per core  ({c_ours:.2f} s CPU, {w_ours:.2f} s wall; "
        f"{c_ceil / c_ours:.2f}x pyarrow's read, {c_dt / c_ours:.1f}x datatrove; {writer})"
    )
    if c_py is not None:
        print(
            f"  snakellm chunk, orjson path {mb / c_py:8.1f} MB/s per core  ({c_py:.2f} s CPU; "
            f"{c_ceil / c_py:.2f}x pyarrow's read; the C writer is {c_py / c_ours:.2f}x it)"
        )
    print(f"  datatrove Parquet->Jsonl    {mb / c_dt:8.1f} MB/s per core  ({c_dt:.2f} s CPU, {w_dt:.2f} s wall)")


def make_warc(tmp: Path, docs: list[bytes], pages: int, files: int) -> tuple[Path, int]:
    """.warc.gz files of HTML pages made of the shipped documents (plus a request, a 404 and an image per 50)."""
    import io

    import orjson
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    rng = random.Random(2)
    texts = [t for t in (orjson.loads(d)["text"] for d in docs) if len(t) > 200]
    folder = tmp / "warc"
    folder.mkdir()
    html_pages = 0
    for f in range(files):
        with open(folder / f"CC-MAIN-{f:05d}.warc.gz", "wb") as fh:
            w = WARCWriter(fh, gzip=True)
            for i in range(pages // files):
                paras = "".join(f"<p>{p}</p>" for p in rng.choice(texts).split("\n") if p.strip())
                body = (
                    f"<html><head><title>Page {i}</title></head><body><nav><a href='/'>Home</a> <a href='/a'>About"
                    f"</a></nav><article><h1>Article {f}-{i}</h1>{paras}</article><footer>(c) example.org</footer>"
                    "</body></html>"
                ).encode()
                status, ctype = "200 OK", "text/html; charset=utf-8"
                if i % 50 == 7:
                    status = "404 Not Found"
                elif i % 50 == 9:
                    ctype = "image/png"
                else:
                    html_pages += 1
                url = f"https://example.org/{f}/{i}"
                hh = StatusAndHeaders(status, [("Content-Type", ctype)], protocol="HTTP/1.1")
                w.write_record(w.create_warc_record(url, "request", payload=io.BytesIO(b"GET / HTTP/1.1\r\n\r\n")))
                w.write_record(w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=hh))
    return folder, html_pages


def bench_warc(a: argparse.Namespace, tmp: Path, docs: list[bytes]) -> None:
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.readers import WarcReader

    from snakellm.data.chunk import build_chunk

    folder, html = make_warc(tmp, docs, a.pages, a.warc_files)
    files = sorted(str(p) for p in folder.glob("*.warc.gz"))
    print(f"warc: {len(files)} files, {html} HTML responses of 200 among {2 * a.pages} records")
    out = tmp / "warc-out"
    out.mkdir()
    got = {}

    def ours() -> None:
        for f in out.glob("*"):
            f.unlink()
        got["ours"] = build_chunk(files, str(out / "w.jsonl"), fmt="warc", show_progress=False)["documents"]

    def theirs() -> None:
        # datatrove keeps the 404 page (it does not look at the status): its count may be one page higher in 50
        got["theirs"] = sum(1 for _ in Trafilatura().run(WarcReader(str(folder)).run()))

    # datatrove's extractor runs trafilatura in a child process (its timeout): CPU time would miss it, so wall time
    (_, t_ours), (_, t_dt) = _best(ours, 1), _best(theirs, 1)
    print(
        f"  snakellm chunk -t1          {got['ours'] / t_ours:8.1f} documents/s  ({got['ours']} in {t_ours:.2f} s, "
        f"{(got['ours'] / t_ours) / (got['theirs'] / t_dt):.2f}x datatrove)"
    )
    print(f"  datatrove Warc+Trafilatura  {got['theirs'] / t_dt:8.1f} documents/s  ({got['theirs']} in {t_dt:.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200, help="jsonl.zst: decompressed corpus size (default 200 MB)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--parquet-mb", type=float, default=200, help="parquet: MB of text (default 200)")
    ap.add_argument("--parquet-files", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5, help="parquet: best of this many runs of each (default 5)")
    ap.add_argument("--pages", type=int, default=2000, help="warc: response records (default 2000)")
    ap.add_argument("--warc-files", type=int, default=2)
    ap.add_argument("--formats", default="jsonl,parquet,warc", help="which parts to run (default all three)")
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny corpora (tests/test_bench_smoke.py)")
    a = ap.parse_args()
    if a.smoke:
        a.mb, a.shards, a.parquet_mb, a.parquet_files, a.pages, a.warc_files = 1.0, 2, 1.0, 2, 40, 1
        a.repeat = 1
    formats = a.formats.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="snakellm-bench-chunk-"))
    try:
        docs = shipped_docs()
        for fmt, fn in (("jsonl", bench_jsonl), ("parquet", bench_parquet), ("warc", bench_warc)):
            if fmt in formats:
                fn(a, tmp, docs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
