"""``snakellm curate-signatures``: a chunk's filter verdicts, exact hashes and MinHash values (snakellm.curate)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.curate import settings as cs
from snakellm.curate.signatures import compute
from snakellm.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm curate-signatures",
        description="Run the quality filters and language ID on a chunk's documents and compute their exact "
        "hash and MinHash values: one band-major uint32 matrix (.npy) and a summary (.json).",
    )
    p.add_argument("chunk_jsonl", help="data/jsonl/{source}/{chunk}.jsonl")
    p.add_argument("--output", required=True, help="the signature matrix (.npy)")
    p.add_argument("--summary", required=True, help="the summary (.json): rules, counts, languages")
    p.add_argument("--key", default="text", help="JSON key holding the text (config: sources.NAME.key)")
    p.add_argument("--source", default="", help="source name, recorded in the summary")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the summary")
    p.add_argument("--threads", type=int, default=1, help="worker processes")
    p.add_argument("--no-progress", action="store_true")
    cs.add(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    curate = cs.from_args(a, p)
    try:
        s = compute(
            a.chunk_jsonl,
            a.output,
            a.summary,
            curate,
            key=a.key,
            source=a.source,
            chunk=a.chunk,
            threads=a.threads,
            show_progress=not a.no_progress,
        )
    except (OSError, ValueError, DataError) as e:
        print(f"snakellm curate-signatures: error: {e}", file=sys.stderr)
        return 1
    print(f"{a.output}: {s['documents']} documents, {s['rejected']} rejected {s['rejected_by_rule']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
