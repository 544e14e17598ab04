"""``snakellm curate-index``: cluster an index's pairs into per-chunk removal lists (snakellm.curate.index)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.curate import index


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm curate-index",
        description="Connected components of the bucket jobs' pairs; each cluster keeps its first document in "
        "corpus order (pairs of near.scheme datatrove, 4 columns: the document datatrove's union-find keeps). "
        "Writes each chunk's removal list (only where its content changed) and a summary.",
    )
    p.add_argument("--pairs", nargs="+", required=True, help="the bucket jobs' pair files")
    p.add_argument(
        "--chunk",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "SIGNATURES", "LIST"),
        help="one chunk of the index, in corpus order: its name (source/chunk), signature file and removal list",
    )
    p.add_argument(
        "--chunks-file", help="the index's chunks, one NAME<TAB>SIGNATURES<TAB>LIST line each (instead of --chunk)"
    )
    p.add_argument("--summary", required=True, help="the index summary (.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        chunks = [list(c) for c in a.chunk] + (
            [list(c) for c in index.read_plan(a.chunks_file)] if a.chunks_file else []
        )
    except (OSError, ValueError) as e:
        print(f"snakellm curate-index: error: {e}", file=sys.stderr)
        return 1
    if not chunks:
        p.error("no chunks (--chunk or --chunks-file)")
    names = [tuple(c[0].split("/", 1)) for c in chunks]
    if any(len(n) != 2 for n in names):
        p.error("--chunk NAME must be source/chunk")
    try:
        s = index.cluster(
            [c[1] for c in chunks],
            names,
            a.pairs,
            [c[2] for c in chunks],
            a.summary,
        )
    except (OSError, ValueError) as e:
        print(f"snakellm curate-index: error: {e}", file=sys.stderr)
        return 1
    print(f"{a.summary}: {s}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
