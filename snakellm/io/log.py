"""One log line format for every step: ``[HH:MM:SS] message`` on stderr, rank 0 only in distributed jobs."""

from __future__ import annotations

import sys
import time


def log(msg: str, rank0: bool = True) -> None:
    """Write a timestamped line to stderr (flushed: Snakemake logs and srun interleave streams)."""
    if rank0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 shard``, ``2 shards``, ``1,234 prompts`` (``many``: an irregular plural): every count we print."""
    return f"{n} {word if n == 1 else many or word + 's'}"
