"""``snakellm curate-buckets``: one bucket job of a duplicate index (snakellm.curate.index)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.curate import index
from snakellm.curate import settings as cs
from snakellm.io.readers import display


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm curate-buckets",
        description="Find the duplicate pairs of this job's (band, hash slice) cells across the signature files: "
        "documents with an equal band key (or exact hash), near pairs checked against the threshold.",
    )
    p.add_argument("signatures", nargs="*", help="the index's signature files (.npy), in corpus order")
    p.add_argument(
        "--chunks-file",
        help="the index's chunk list (data/plan/curate-index/{index}.tsv), instead of signature files on the "
        "command line",
    )
    p.add_argument(
        "--output", required=True, help="the pairs (.npy, uint64 [pairs, 3]; near.scheme datatrove: [pairs, 4])"
    )
    p.add_argument("--job", type=int, default=0, help="this job's number (0-based)")
    p.add_argument("--jobs", type=int, default=1, help="bucket jobs of the index (config: near.index_jobs)")
    cs.add(p, filters=False)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if not 0 <= a.job < a.jobs:
        p.error(f"--job {a.job} is not in 0..{a.jobs - 1}")
    curate = cs.from_args(a, p)
    try:
        sigs = list(a.signatures) + ([sig for _, sig, _ in index.read_plan(a.chunks_file)] if a.chunks_file else [])
        if not sigs:
            p.error("no signature files (positional, or --chunks-file)")
        c = index.buckets(sigs, a.output, job=a.job, jobs=a.jobs, exact=curate["exact"], near=curate["near"])
    except (OSError, ValueError) as e:
        print(f"snakellm curate-buckets: error: {e}", file=sys.stderr)
        return 1
    print(f"{display(a.output)}: {c}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
