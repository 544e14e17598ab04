"""Streaming readers for shards: zstd, gzip, bz2, xz or plain, decided by the shard's magic bytes.

A shard is never trusted to be what its name or the source's ``format`` says:
the first bytes decide how it is decompressed (a ``.gz`` in a ``jsonl.zst``
source is read as gzip, and the chunk's stats say so). Damaged input is an
error, never a short read: a truncated or corrupt stream (zstd, single or
multi-frame, gzip, bz2, xz) raises :class:`DamagedShardError` naming the shard,
the reason and where in the file it was found. zstandard's own
``stream_reader`` returns a clean EOF on a frame cut short, which is why zstd is
decoded here frame by frame with ``decompressobj`` and ``eof`` is checked.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from collections.abc import Iterator
from typing import BinaryIO

import zstandard

from snakellm.errors import DataError

READ_SIZE = 1 << 20
_ZSTD_FEED = 1 << 18  # compressed bytes per decompress() call: bounds the output of one call

BOM = b"\xef\xbb\xbf"
COMPRESSIONS = ("none", "zstd", "gzip", "bz2", "xz")
_NAMES = {"zstd": "zstd", "gzip": "gzip", "bz2": "bzip2", "xz": "xz"}


class DamagedShardError(DataError):
    """A shard that cannot be read completely; the message names the file and the reason."""


def compression_of(path: str, fmt: str | None = None) -> str:
    """The compression a shard is *declared* to have: the configured format, else the file suffix."""
    probe = fmt if fmt and fmt.endswith((".zst", ".gz", ".bz2", ".xz")) else path
    if probe.endswith((".zst", ".zstd")):
        return "zstd"
    if probe.endswith(".gz"):
        return "gzip"
    if probe.endswith(".bz2"):
        return "bz2"
    if probe.endswith(".xz"):
        return "xz"
    return "none"


def sniff(head: bytes) -> str:
    """The compression the first bytes of a file show (``none`` when no known magic matches)."""
    if head[:4] == b"\x28\xb5\x2f\xfd" or (len(head) >= 4 and head[1:4] == b"\x2a\x4d\x18" and head[0] & 0xF0 == 0x50):
        return "zstd"  # a frame, or a skippable frame (0x184D2A5?)
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:3] == b"BZh" and head[3:4].isdigit():
        return "bz2"
    if head[:6] == b"\xfd7zXZ\x00":
        return "xz"
    return "none"


def detect_compression(path: str, fmt: str | None = None) -> str:
    """How to decompress ``path``: its magic bytes; an error when the format promised one and none is there."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    found = sniff(head)
    declared = compression_of(path, fmt)
    if found == "none" and declared != "none":
        what = f"first bytes {head.hex(' ')}" if head else "the file is empty"
        raise DamagedShardError(
            f"{path}: not a {_NAMES[declared]} file ({what}); expected {_NAMES[declared]} magic bytes"
        )
    return found


class _ZstdRaw(io.RawIOBase):
    """zstd frames one after another (``cat a.zst b.zst``), failing on a frame cut short or corrupt."""

    def __init__(self, path: str, raw: BinaryIO) -> None:
        self._path, self._raw = path, raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False  # bytes of the current frame were fed and it has not ended
        self._pending = b""  # compressed bytes not yet fed
        self._pos = 0  # compressed offset of the start of _pending
        self._out = b""
        self._off = 0  # bytes of _out already handed out by readinto
        self._eof = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while not self._out and not self._eof:
            if not self._pending:
                self._pending = self._raw.read(_ZSTD_FEED)
                if not self._pending:
                    self._eof = True
                    if self._in_frame:
                        raise DamagedShardError(
                            f"{self._path}: truncated zstd stream: the file ends inside a frame at byte {self._pos} "
                            "(a download or copy cut short?)"
                        )
                    return
            feed, self._pending = self._pending, b""
            try:
                out = self._obj.decompress(feed)
            except zstandard.ZstdError as e:
                raise DamagedShardError(f"{self._path}: corrupt zstd data near byte {self._pos}: {e}") from None
            self._in_frame = True
            if self._obj.eof:  # the frame ended; what follows must be another frame
                rest = self._obj.unused_data
                self._pos += len(feed) - len(rest)
                self._pending = rest
                self._obj = self._dctx.decompressobj()
                self._in_frame = False
            else:
                self._pos += len(feed)
            self._out = out

    def readinto(self, b) -> int:
        if self._off >= len(self._out):
            self._out, self._off = b"", 0
            self._fill()
        n = min(len(b), len(self._out) - self._off)
        b[:n] = memoryview(self._out)[self._off : self._off + n]
        self._off += n
        return n

    def next_block(self) -> bytes:
        """The next piece of decompressed output as produced (no copies; b"" at the end)."""
        if self._off:
            out, self._out, self._off = self._out[self._off :], b"", 0
            if out:
                return out
        self._fill()
        out, self._out = self._out, b""
        return out

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Checked(io.RawIOBase):
    """A stdlib decompressor (gzip, bz2, xz) whose failures become DamagedShardError naming the shard."""

    def __init__(self, path: str, comp: str, stream: io.BufferedIOBase) -> None:
        self._path, self._comp, self._stream = path, comp, stream

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        try:
            data = self._stream.read(len(b))
        except EOFError as e:
            raise DamagedShardError(f"{self._path}: truncated {_NAMES[self._comp]} stream: {e}") from None
        except (OSError, zlib.error, lzma.LZMAError, ValueError) as e:
            raise DamagedShardError(f"{self._path}: corrupt {_NAMES[self._comp]} data: {e}") from None
        n = len(data)
        b[:n] = data
        return n

    def close(self) -> None:
        self._stream.close()
        super().close()


def open_shard(path: str, fmt: str | None = None, compression: str | None = None) -> BinaryIO:
    """A buffered binary stream of the decompressed shard; never loads it whole.

    ``compression`` (from :func:`detect_compression`) skips the sniffing. Reads
    raise :class:`DamagedShardError` where the data is damaged.
    """
    comp = compression or detect_compression(path, fmt)
    raw = open(path, "rb")
    stream: io.RawIOBase
    if comp == "zstd":
        stream = _ZstdRaw(path, raw)
    elif comp == "gzip":
        stream = _Checked(path, comp, gzip.GzipFile(fileobj=raw, mode="rb"))
    elif comp == "bz2":
        stream = _Checked(path, comp, bz2.BZ2File(raw))
    elif comp == "xz":
        stream = _Checked(path, comp, lzma.LZMAFile(raw))
    else:
        return io.BufferedReader(raw, buffer_size=READ_SIZE)
    return io.BufferedReader(stream, buffer_size=READ_SIZE)


def shard_lines(path: str, fmt: str | None = None, compression: str | None = None) -> Iterator[bytes]:
    """The lines of a shard (see :func:`iter_lines`), decompressed by its magic bytes.

    zstd output goes to the line splitter as each frame piece is decoded, without
    the copies a BufferedReader would make (the hot path of ``snakellm chunk``).
    """
    comp = compression or detect_compression(path, fmt)
    if comp == "zstd":
        with _ZstdRaw(path, open(path, "rb")) as z:
            yield from iter_lines(z)
        return
    with open_shard(path, fmt, comp) as fh:
        yield from iter_lines(fh)


def iter_lines(fh: BinaryIO | _ZstdRaw, block: int = READ_SIZE) -> Iterator[bytes]:
    r"""The lines of a stream with their terminators, splitting on ``\n``, ``\r\n`` and a lone ``\r``.

    Files exported on old Macs end lines with CR alone; reading them by ``\n``
    would make the whole shard one line. A final line without a terminator is
    yielded as is. A very long line is collected in pieces (no quadratic copying).
    """
    pending: list[bytes] = []  # an unterminated line, in pieces
    read = fh.next_block if isinstance(fh, _ZstdRaw) else lambda: fh.read(block)
    while buf := read():
        if pending and pending[-1].endswith(b"\r"):
            # a line ending in \r at a block edge: \r\n split in two, or a lone \r
            if buf.startswith(b"\n"):
                pending.append(b"\n")
                buf = buf[1:]
            yield b"".join(pending)
            pending = []
            if not buf:
                continue
        lines = buf.splitlines(keepends=True)
        last = lines[-1]
        if len(lines) == 1 and not last.endswith((b"\n", b"\r")):
            pending.append(last)
            continue
        if pending:
            lines[0] = b"".join(pending) + lines[0]
            pending = []
        if not last.endswith(b"\n"):  # unterminated, or \r that may be followed by \n
            pending.append(lines.pop())
        yield from lines
    if pending:
        yield b"".join(pending)
