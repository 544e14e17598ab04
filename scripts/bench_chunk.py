#!/usr/bin/env python3
"""Benchmark: chunk throughput (MB/s of decompressed jsonl) next to `zstd -dc` on the same shards.

Builds real-text .jsonl.zst shards (the shipped WikiText-2 and Botchan documents,
repeated in shuffled order to --mb megabytes), then in the same run times
  1. `zstd -dc SHARDS > /dev/null`              (decompression alone, the floor)
     `zstd -dc SHARDS > file`                    (decompression + writing the same bytes)
  2. `snakellm chunk SHARDS -o out.jsonl --threads 1|2` (decompress + validate every line + write + verify)
and prints both in MB/s of decompressed input.

usage: .venv/bin/python scripts/bench_chunk.py [--mb 200] [--shards 16] [--smoke]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200, help="decompressed corpus size (default 200 MB)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="seconds: 1 MB in 2 shards (tests/test_bench_smoke.py)")
    a = ap.parse_args()
    if a.smoke:
        a.mb, a.shards = 1.0, 2
    tmp = Path(tempfile.mkdtemp(prefix="snakellm-bench-chunk-"))
    try:
        docs, rng = shipped_docs(), random.Random(0)
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
