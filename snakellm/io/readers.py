"""Streaming readers for shards: zstd, gzip or plain, decided by format or suffix."""

from __future__ import annotations

import gzip
import io
from typing import BinaryIO

import zstandard

READ_SIZE = 1 << 20


def compression_of(path: str, fmt: str | None = None) -> str:
    """``zstd``, ``gzip`` or ``none`` from the configured format, else the file suffix."""
    probe = fmt if fmt and fmt.endswith((".zst", ".gz")) else path
    if probe.endswith((".zst", ".zstd")):
        return "zstd"
    if probe.endswith(".gz"):
        return "gzip"
    return "none"


def open_shard(path: str, fmt: str | None = None) -> BinaryIO:
    """A buffered binary stream of the decompressed shard; never loads it whole."""
    comp = compression_of(path, fmt)
    raw = open(path, "rb")
    if comp == "zstd":
        dctx = zstandard.ZstdDecompressor()
        # read_across_frames: shards written by several zstd calls (cat a.zst b.zst) stay whole
        stream = dctx.stream_reader(raw, read_size=READ_SIZE, read_across_frames=True, closefd=True)
        return io.BufferedReader(stream, buffer_size=READ_SIZE)
    if comp == "gzip":
        return io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), buffer_size=READ_SIZE)  # type: ignore[arg-type]
    return io.BufferedReader(raw, buffer_size=READ_SIZE)  # type: ignore[arg-type]
