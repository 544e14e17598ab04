#!/usr/bin/env python3
"""Benchmark: plan, dry-run and no-op rerun a 60,000-shard source in SlimPajama's layout.

Two cases, each a real `snakemake` on a temp working directory:
  http  - `url: http://127.0.0.1:9/chunk{1..10}/example_train_{0..5999}.jsonl.zst`, nothing fetched: dry-run only
  local - 60,000 real (tiny) .jsonl.zst files: dry-run, the real build, then a no-op rerun
The config has the GPT-2 tokenizer, so the graph is download/chunk/tokenize/blend.
Prints jobs per rule (about 75 per stage at 800 shards a chunk), wall time and peak
memory of each snakemake call next to the bar (20 s) and the references measured on
this machine before (one job per shard: 86 s and 1.7 GB dry-run; a per-chunk
prototype with 60,000 local files: 16.6 s dry-run, 15.9 s no-op). `--naive` also
measures the one-job-per-shard Snakefile in this run (slow: minutes, GBs).

Shard lists reach the jobs through data/plan/{source}/{chunk}.list files (no command-line
ceiling): `--per-chunk 5000` checks the 60,000-shard / 12-chunk case. CPU seconds are printed
next to wall time: on a loaded machine they are the figure to compare.

`--curate` gives the source a `curate:` section (exact + MinHash near dedup, the four quality filters,
language ID, `--index-jobs` bucket jobs), so the plan holds the curation stages too; `--http-only` skips
the local case. RedPajama-v2's order, 10^6 shards, with curation (bar: < 60 s and < 4 GB):
  .venv/bin/python scripts/bench_plan.py --shards 1000000 --per-chunk 1000 --curate --http-only
`--smoke` (seconds, tests/test_bench_smoke.py): 20 shards in 2 chunks, curated, and the real build and
no-op rerun of the `data` target only (the chunk jobs), not of the whole default target.

`--parquet N` (default 10,000; 0: skip) adds the row-group case: N local parquet files of 3-7 row groups,
planned by row group (`row_groups_per_chunk: 2`) as the Snakefile plans them at parse time, first with no
footer cache (every footer read; bar < 30 s) and then again with nothing changed (the cache's stats; bar
< 5 s), and once more after one file is rewritten (its footer alone is read again).

usage: .venv/bin/python scripts/bench_plan.py [--shards 60000] [--per-chunk 800] [--curate] [--http-only]
       [--naive] [--parquet 10000] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
import zstandard

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
BAR_S = 20.0
BAR_MB = 4096.0
CURATE = {
    "exact": True,
    "near": {"threshold": 0.8},
    "filters": {"gopher_repetition": {}, "gopher_quality": {}, "c4": {}, "fineweb": {}},
    "languages": ["en"],
}


CPU: dict[str, float] = {}  # CPU seconds (user + sys) of the last snakemake call: robust on a loaded machine


def snakemake(workdir: Path, *args: str, snakefile: Path = REPO / "Snakefile") -> tuple[float, float, str]:
    """Run snakemake; return (seconds, peak RSS in MB of this child, output); CPU["last"] = its CPU seconds."""
    cmd = [str(BIN / "snakemake"), "-s", str(snakefile), "-d", str(workdir), "--nocolor", "-c2", *args]
    if snakefile == REPO / "Snakefile":
        cmd += ["--configfile", str(workdir / "config.yaml"), "--replace-workflow-config"]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    # peak RSS of exactly this child: run it through a tiny wrapper that reports its own rusage
    wrapper = (
        "import resource,subprocess,sys,time;t=time.perf_counter();"
        "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
        "sys.stdout.write(p.stdout+p.stderr);"
        "r=resource.getrusage(resource.RUSAGE_CHILDREN);"
        "sys.stderr.write(f'@@{time.perf_counter()-t} {r.ru_maxrss} {r.ru_utime+r.ru_stime}@@');"
        "sys.exit(p.returncode)"
    )
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env, cwd=workdir)
    m = re.search(r"@@([\d.]+) (\d+) ([\d.]+)@@", p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"snakemake failed: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    CPU["last"] = float(m.group(3))
    return float(m.group(1)), int(m.group(2)) / 1024, p.stdout


def job_counts(out: str) -> dict[str, int]:
    """Per-rule counts from snakemake's 'Job stats' table."""
    counts = {}
    table = out.split("Job stats:", 1)[-1]
    for line in table.splitlines()[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    return counts


def bench_config(source: dict, curate: dict | None = None) -> str:
    """One source plus the GPT-2 tokenizer: the whole data graph (download/chunk/tokenize/blend)."""
    tok = REPO / "resources" / "tokenizers" / "gpt2"
    return yaml.safe_dump(
        {
            "sources": {"sp": {**source, **({"curate": curate} if curate else {})}},
            "tokenizers": {
                "gpt2": {
                    "kind": "gpt2-bpe",
                    "vocab_file": str(tok / "vocab.json"),
                    "merges_file": str(tok / "merges.txt"),
                    "vocab_size": 50257,
                }
            },
        }
    )


def make_local_shards(root: Path, n: int) -> None:
    blob = zstandard.ZstdCompressor().compress(b'{"text": "a tiny real shard"}\n')
    per_dir = -(-n // 10)
    for i in range(n):
        d = root / f"chunk{1 + i // per_dir}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"example_train_{i % per_dir}.jsonl.zst").write_bytes(blob)


def line(name: str, seconds: float, mb: float, ref: str, bar_s: float = BAR_S) -> None:
    verdict = "OK " if seconds < bar_s and mb < BAR_MB else "SLOW"
    cpu = CPU.get("last", 0.0)
    print(
        f"  {verdict} {name:<34} {seconds:6.1f} s ({cpu:5.1f} s CPU)  {mb:7.0f} MB peak   "
        f"(bar < {bar_s:.0f} s, < {BAR_MB:.0f} MB; {ref})"
    )


def bench_parquet_plan(root: Path, n: int) -> None:
    """Planning N local parquet files by row group: cold (no footer cache), warm, and after one file changed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from snakellm.data import planning

    t = time.perf_counter()
    for i in range(n):
        d = root / "files" / f"{i // 1000:03d}"
        d.mkdir(parents=True, exist_ok=True)
        k = 3 + i % 5
        tbl = pa.table({"text": [f"document {i}-{j}" for j in range(k)], "id": [f"{i}-{j}" for j in range(k)]})
        pq.write_table(tbl, d / f"{i:06d}_00000.parquet", row_group_size=1)
    print(f"parquet: wrote {n} files of 3-7 row groups in {time.perf_counter() - t:.1f} s")
    spec = {"kind": "local", "path": str(root / "files" / "*" / "*.parquet"), "format": "parquet",
            "row_groups_per_chunk": 2}  # fmt: skip
    cache = root / "plan"
    for name, bar in (("cold (every footer read)", 30.0), ("warm (nothing changed)", 5.0)):
        t = time.perf_counter()
        chunks = planning.plan_source(spec, cache_dir=cache)
        s = time.perf_counter() - t
        verdict = "OK " if s < bar else "SLOW"
        print(
            f"  {verdict} parquet plan, {name:<26} {s:7.3f} s  ({n} files -> {len(chunks)} chunks; bar < {bar:.0f} s)"
        )
    victim = next((root / "files").rglob("*.parquet"))
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), victim, row_group_size=1)
    t = time.perf_counter()
    planning.plan_source(spec, cache_dir=cache)
    print(f"      parquet plan, one file rewritten        {time.perf_counter() - t:7.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=60_000)
    ap.add_argument("--per-chunk", type=int, default=800)
    ap.add_argument("--naive", action="store_true", help="also time a one-job-per-shard Snakefile (slow)")
    ap.add_argument("--keep", type=Path, help="work here and keep it (default: a temp dir, removed)")
    ap.add_argument("--curate", action="store_true", help="curate the source (dedup, filters, language ID)")
    ap.add_argument("--index-jobs", type=int, default=90, help="bucket jobs of the curated source's index")
    ap.add_argument("--http-only", action="store_true", help="only the http case (no local files written)")
    ap.add_argument("--parquet", type=int, default=10_000, help="local parquet files planned by row group (0: skip)")
    ap.add_argument("--smoke", action="store_true", help="seconds: 20 shards, 10 a chunk, curated, build only `data`")
    a = ap.parse_args()
    if a.smoke:
        a.shards, a.per_chunk, a.naive, a.curate, a.index_jobs, a.parquet = 20, 10, False, True, 2, 20
    build = ["data"] if a.smoke else []
    curate = {**CURATE, "near": {**CURATE["near"], "index_jobs": a.index_jobs}} if a.curate else None
    bar_s = 60.0 if a.shards >= 1_000_000 else BAR_S
    base = a.keep or Path(tempfile.mkdtemp(prefix="snakellm-bench-plan-"))
    base.mkdir(parents=True, exist_ok=True)
    n_dirs = 10
    per_dir = -(-a.shards // n_dirs)
    try:
        print(f"{a.shards} shards, {a.per_chunk} per chunk -> {-(-a.shards // a.per_chunk)} chunks per source")
        # http: nothing is fetched, the plan comes from the URL template alone
        http = base / "http"
        http.mkdir(exist_ok=True)
        url = f"http://127.0.0.1:9/chunk{{1..{n_dirs}}}/example_train_{{0..{per_dir - 1}}}.jsonl.zst"
        (http / "config.yaml").write_text(
            bench_config({"kind": "http", "url": url, "format": "jsonl.zst", "shards_per_chunk": a.per_chunk}, curate)
        )
        s, mb, out = snakemake(http, "-n")
        print(f"http source  jobs: {job_counts(out)}")
        line("http: snakemake -n", s, mb, "per-shard reference 86 s / 1.7 GB", bar_s)
        if a.curate:
            t = time.perf_counter()
            p = subprocess.run(
                [str(BIN / "snakellm"), "plan", "--config", str(http / "config.yaml")],
                capture_output=True,
                text=True,
                cwd=http,
            )
            print(f"  snakellm plan ({time.perf_counter() - t:.1f} s):")
            lines = p.stdout.splitlines()
            at = next((i for i, x in enumerate(lines) if x.startswith("index")), len(lines))
            print("\n".join("    " + x for x in lines[at : at + 5]))
        if a.parquet:
            bench_parquet_plan(base / "parquet", a.parquet)
        if a.http_only:
            return

        # local: 60,000 real files
        local = base / "local"
        t = time.perf_counter()
        make_local_shards(local / "shards", a.shards)
        print(f"local source: wrote {a.shards} shard files in {time.perf_counter() - t:.1f} s")
        (local / "config.yaml").write_text(
            bench_config(
                {
                    "kind": "local",
                    "path": "shards/chunk*/example_train_*.jsonl.zst",
                    "format": "jsonl.zst",
                    "shards_per_chunk": a.per_chunk,
                },
                curate,
            )
        )
        s, mb, out = snakemake(local, "-n")
        print(f"local source jobs: {job_counts(out)}")
        line("local: snakemake -n", s, mb, "per-chunk prototype 16.6 s", bar_s)
        if a.curate and not a.smoke:  # every tiny shard holds the same one-line document: all would be removed
            print("  (curated: no real build; the shards are copies of one short document)")
        else:
            s, mb, out = snakemake(local, *build)
            print(f"  (real build of {job_counts(out)}: {s:.1f} s)")
            s, mb, out = snakemake(local, *build)
            assert "Nothing to be done" in out, out[-2000:]
            line("local: no-op rerun", s, mb, "per-chunk prototype 15.9 s", bar_s)

        if a.naive:
            naive = base / "naive"
            naive.mkdir(exist_ok=True)
            (naive / "Snakefile").write_text(
                f'SH = glob_wildcards("{local}/shards/{{d}}/example_train_{{i}}.jsonl.zst")\n'
                "rule all:\n    input: expand('out/{d}/{i}.jsonl', zip, d=SH.d, i=SH.i)\n"
                f"rule one:\n    input: '{local}/shards/{{d}}/example_train_{{i}}.jsonl.zst'\n"
                "    output: 'out/{d}/{i}.jsonl'\n    shell: 'zstd -dc {input} > {output}'\n"
            )
            s, mb, out = snakemake(naive, "-n", snakefile=naive / "Snakefile")
            line("naive one-job-per-shard: -n", s, mb, "the thing to beat")
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
