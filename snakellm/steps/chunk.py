"""``snakellm chunk``: a chunk's shards into one validated jsonl (snakellm.data.chunk)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.sections import SourceSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.data.chunk import (
    ALARM_MIN_LINES,
    Expected,
    Fields,
    Limits,
    ManifestMismatchError,
    RejectedFractionError,
    ShardFileError,
    VerificationError,
    _read_manifest,
    build_chunk,
)
from snakellm.data.planning import read_shard_list


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm chunk` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm chunk",
        description="Concatenate a chunk's shards (zstd, gzip, bz2, xz or plain, told apart by their magic bytes; "
        "MediaWiki XML dumps, parquet files or row-group slices of them, Arrow IPC shards, WARC files) into one validated jsonl file, quarantining bad lines with their shard, line number "
        "and reason. A truncated or corrupt shard fails the job naming the shard.",
    )
    p.add_argument(
        "shards", nargs="*", help="shard files in chunk order (a *.manifest.json stands for the shards it lists)"
    )
    p.add_argument(
        "--manifest",
        action="append",
        default=[],
        help="download manifest(s) listing the shards; each shard is checked against the size and sha256 "
        "recorded there before it is read (a damaged one is removed, so the next run downloads it again)",
    )
    p.add_argument(
        "--shard-list",
        action="append",
        default=[],
        metavar="FILE",
        help="file(s) listing shard paths, one per line (for lists too long for a command line)",
    )
    p.add_argument(
        "--max-document-bytes",
        type=int,
        default=None,
        help="a longer document (line) is quarantined as too_long, never held whole (default: no limit; "
        "config: sources.NAME.max_document_bytes)",
    )
    p.add_argument(
        "--max-rejected-fraction",
        type=float,
        default=None,
        help=f"fail on a shard of at least {ALARM_MIN_LINES} lines with a larger share of them rejected "
        "(default: no alarm; 1 turns it off; config: sources.NAME.max_rejected_fraction)",
    )
    p.add_argument("-o", "--output", required=True, help="the chunk's .jsonl")
    p.add_argument("--rejected", help="default: {output stem}.rejected.jsonl")
    p.add_argument("--stats", help="default: {output stem}.stats.json")
    add_arguments(p.add_argument_group("source (config: sources.NAME)"), SourceSettings)
    p.add_argument("--source", default="", help="source name, recorded in the stats")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the stats")
    p.add_argument("--threads", type=int, default=1, help="validate shards in this many processes (default 1)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    # The chunk rule passes its input as is: for an http source that is the
    # download manifest, which stands for the shards it lists.
    shards: list[str] = []
    expected: dict[str, Expected] = {}

    def add_manifest(m: str) -> None:
        for path, exp in _read_manifest(m):
            shards.append(path)
            if exp is not None:
                expected[path] = exp

    for s in a.shards:
        add_manifest(s) if s.endswith(".manifest.json") else shards.append(s)
    for m in a.manifest:
        add_manifest(m)
    try:
        for f in a.shard_list:
            shards.extend(read_shard_list(f))
    except (OSError, ValueError) as e:
        p.error(f"cannot read shard list: {e}")
    if not shards:
        p.error("no shards given (positional files, --shard-list or --manifest)")
    try:
        st = build_chunk(
            shards,
            a.output,
            fmt=a.format,
            key=a.key,
            rejected=a.rejected,
            stats=a.stats,
            source=a.source,
            chunk=a.chunk,
            workers=a.threads,
            show_progress=not a.no_progress,
            expected=expected,
            limits=Limits(a.max_document_bytes, a.max_rejected_fraction),
            fields=Fields(a.id_key, tuple(a.columns) if a.columns else None),
        )
    except (
        FileNotFoundError,
        ValueError,
        VerificationError,
        ManifestMismatchError,
        ShardFileError,
        RejectedFractionError,
    ) as e:
        print(f"snakellm chunk: error: {e}", file=sys.stderr)
        return 1
    print(
        f"{a.output}: {st['documents']} documents, {st['rejected']} rejected "
        f"{st['rejected_by_reason'] or ''} from {st['lines_read']} lines in {st['shards']} shards, "
        f"{st['bytes_in'] / 1e6:.1f} MB at {st['mb_per_s']} MB/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
