"""``snakellm curate``: write a curated chunk (kept lines, removed documents with reasons, stats)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.curate.apply import curate_chunk
from snakellm.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm curate",
        description="The chunk minus the documents its filters rejected and its index removed; every removed "
        "document goes to the removed file with its reason (filter rule, or duplicate with its cluster and kept id).",
    )
    p.add_argument("chunk_jsonl", help="data/jsonl/{source}/{chunk}.jsonl")
    p.add_argument("--signatures", required=True, help="the chunk's signature matrix (.npy)")
    p.add_argument("--signature-summary", required=True, help="its summary (.json)")
    p.add_argument("--removal-list", required=True, help="the chunk's removal list from its index")
    p.add_argument("-o", "--output", required=True, help="the curated chunk (.jsonl)")
    p.add_argument("--removed", required=True, help="removed documents (.jsonl)")
    p.add_argument("--stats", required=True, help="counts (.json)")
    p.add_argument("--source", default="")
    p.add_argument("--chunk", default="")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        s = curate_chunk(
            a.chunk_jsonl,
            a.signatures,
            a.signature_summary,
            a.removal_list,
            a.output,
            a.removed,
            a.stats,
            source=a.source,
            chunk=a.chunk,
        )
    except (OSError, ValueError, DataError) as e:
        print(f"snakellm curate: error: {e}", file=sys.stderr)
        return 1
    print(f"{a.output}: kept {s['documents']} of {s['documents_in']} {s['removed_by_reason']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
