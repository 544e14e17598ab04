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
import hashlib
import io
import lzma
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import zstandard

from snakellm.errors import DataError

READ_SIZE = 1 << 20
# Compressed bytes per zstd decompress() call: one byte can expand to ~32,000 (RLE blocks),
# so 1 KiB bounds one call's output at ~32 MiB whatever the file holds (no cost in speed).
_ZSTD_FEED = 1 << 10
_FEED = 1 << 16  # compressed bytes per call for the decoders that take an output limit
MAX_STEP_OUT = 1 << 20  # output limit of one bz2/xz/gzip call
ZSTD_MAX_WINDOW = 1 << 31  # frames written with `zstd --long=31` (2 GiB windows) are valid input
_ZSTD = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)

BOM = b"\xef\xbb\xbf"
COMPRESSIONS = ("none", "zstd", "gzip", "bz2", "xz")
_NAMES = {"zstd": "zstd", "gzip": "gzip", "bz2": "bzip2", "xz": "xz"}


class DamagedShardError(DataError):
    """A shard that cannot be read completely; the message names the file and the reason."""


def display(path: str) -> str:
    """A path as it may appear in a message: itself, or escaped when it holds a newline or undecodable bytes.

    Names come from the filesystem as Python gives them (undecodable bytes as
    surrogates; ``os.fsencode`` turns them back). Printed raw, such a name would
    stop the message with a UnicodeEncodeError or split it over lines.
    """
    return path if path.isprintable() else ascii(path)


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
            f"{display(path)}: not a {_NAMES[declared]} file ({what}); expected {_NAMES[declared]} magic bytes"
        )
    return found


class HashingFile(io.RawIOBase):
    """A shard opened for reading that hashes (sha256) every byte read from it.

    The chunk job records each shard's sha256 without a second pass: the
    decoders below read every byte of the file (they decode to its end).
    :meth:`hexdigest` first reads whatever a reader left unread.
    """

    def __init__(self, path: str) -> None:
        self._fh = open(path, "rb", buffering=0)
        self._h = hashlib.sha256()
        self._digest: str | None = None
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._fh.readinto(b)
        if n:
            self._h.update(memoryview(b)[:n])
            self.bytes_read += n
        return n or 0

    def fileno(self) -> int:
        return self._fh.fileno()

    def hexdigest(self) -> str:
        """sha256 of the whole file (what the readers left unread is read here; also after close)."""
        if self._digest is None:
            while buf := self._fh.read(READ_SIZE):
                self._h.update(buf)
                self.bytes_read += len(buf)
            self._digest = self._h.hexdigest()
        return self._digest

    def close(self) -> None:
        # the readers close their file when they are done: the digest is taken first
        if not self._fh.closed:
            try:
                self.hexdigest()
            except OSError:
                pass
            self._fh.close()
        super().close()


class _Decoder:
    """One compressed stream's decoder behind one interface: ``step(data)`` returns bounded output.

    bz2, xz and gzip (zlib) take an output limit; zstandard's ``decompressobj``
    does not, so zstd is fed in pieces small enough that no piece can expand
    past the limit (a zstd block of 128 KiB can be stored in 4 bytes).
    """

    def __init__(self, comp: str) -> None:
        self.comp = comp
        self._z: Any
        if comp == "zstd":
            self._z = _ZSTD.decompressobj()
        elif comp == "gzip":
            self._z = zlib.decompressobj(wbits=31)
        elif comp == "bz2":
            self._z = bz2.BZ2Decompressor()
        else:
            self._z = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)

    @property
    def feed_size(self) -> int:
        return _ZSTD_FEED if self.comp == "zstd" else _FEED

    @property
    def needs_input(self) -> bool:
        if self.comp == "zstd":
            return True
        if self.comp == "gzip":
            return not self._z.unconsumed_tail
        return self._z.needs_input

    def step(self, data: bytes) -> bytes:
        z = self._z
        if self.comp == "zstd":
            return z.decompress(data)
        if self.comp == "gzip":
            return z.decompress(z.unconsumed_tail if not data else data, MAX_STEP_OUT)
        return z.decompress(data, MAX_STEP_OUT)

    @property
    def eof(self) -> bool:
        return self._z.eof

    def leftover(self) -> bytes:
        """Input past the end of the stream (a suffix of what was fed)."""
        extra = self._z.unconsumed_tail if self.comp == "gzip" else b""
        return self._z.unused_data + extra


class _Streams(io.RawIOBase):
    """A compressed file read stream after stream to its end: every byte must belong to a complete stream.

    ``cat a.bz2 b.bz2``, multistream Wikipedia dumps, ``pigz`` output and
    multi-frame zstd are series of streams. The standard library's readers
    stop quietly at the first stream they cannot start (``bz2``/``lzma`` take
    it for trailing garbage) and zstandard's ``stream_reader`` returns a clean
    EOF on a frame cut short: either way documents vanish. Here damage in any
    stream, a stream cut short, or trailing data that is not a stream raises
    :class:`DamagedShardError` naming the shard, the stream and the byte
    offset. Zero bytes between streams are padding where the format allows it
    (gzip, xz). Each call returns at most about ``MAX_STEP_OUT`` bytes, whatever
    the compression ratio: a decompression bomb cannot exhaust memory here.
    """

    def __init__(self, path: str, raw: io.RawIOBase, comp: str) -> None:
        self._path, self._raw, self._comp = path, raw, comp
        self._buf = b""  # compressed bytes read from the file
        self._i = 0  # bytes of _buf handed to a decoder
        self._base = 0  # file offset of _buf[0]
        self._dec: _Decoder | None = None
        self._streams = 0
        self._start = 0  # file offset where the current stream starts
        self._out = b""
        self._off = 0  # bytes of _out already handed out by readinto
        self._eof = False

    def readable(self) -> bool:
        return True

    def _where(self) -> str:
        return f"stream {self._streams} (starting at byte {self._start})"

    def _more(self) -> bool:
        """Refill _buf when it is used up; False at the end of the file."""
        if self._i < len(self._buf):
            return True
        self._base += len(self._buf)
        self._buf, self._i = self._raw.read(READ_SIZE), 0
        return bool(self._buf)

    def _begin(self) -> bool:
        """Start the next stream (skipping allowed padding); False at a clean end of the file."""
        while True:
            if not self._more():
                return False
            if self._comp in ("gzip", "xz"):
                rest = self._buf[self._i :]
                stripped = rest.lstrip(b"\0")
                self._i += len(rest) - len(stripped)
                if not stripped:
                    continue
            break
        self._streams += 1
        self._start = self._base + self._i
        self._dec = _Decoder(self._comp)
        return True

    def _step(self) -> bytes:
        dec = self._dec
        assert dec is not None
        data = b""
        if dec.needs_input:
            if not self._more():
                self._eof = True
                name = _NAMES[self._comp]
                raise DamagedShardError(
                    f"{display(self._path)}: truncated {name} data: the file ends at byte {self._base + self._i} "
                    f"inside {self._where()} (a download or copy cut short?)"
                )
            data = self._buf[self._i : self._i + dec.feed_size]
            self._i += len(data)
        try:
            out = dec.step(data)
        except (zstandard.ZstdError, zlib.error, OSError, lzma.LZMAError, EOFError, ValueError) as e:
            self._eof = True
            what = "corrupt" if self._streams == 1 else "corrupt (or trailing non-stream) "
            raise DamagedShardError(
                f"{display(self._path)}: {what} {_NAMES[self._comp]} data in {self._where()}, "
                f"near byte {self._base + self._i}: {e}"
            ) from None
        if dec.eof:
            self._i -= len(dec.leftover())
            self._dec = None
        return out

    def _fill(self) -> None:
        pieces: list[bytes] = []
        size = 0
        while size < READ_SIZE and not self._eof:
            if self._dec is None and not self._begin():
                self._eof = True
                break
            out = self._step()
            if out:
                pieces.append(out)
                size += len(out)
        self._out = pieces[0] if len(pieces) == 1 else b"".join(pieces)

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


def open_shard(
    path: str, fmt: str | None = None, compression: str | None = None, raw: io.RawIOBase | None = None
) -> BinaryIO:
    """A buffered binary stream of the decompressed shard; never loads it whole.

    ``compression`` (from :func:`detect_compression`) skips the sniffing;
    ``raw`` is the file already opened (a :class:`HashingFile`). Reads raise
    :class:`DamagedShardError` where the data is damaged.
    """
    comp = compression or detect_compression(path, fmt)
    raw = raw if raw is not None else open(path, "rb", buffering=0)
    if comp == "none":
        return io.BufferedReader(raw, buffer_size=READ_SIZE)
    return io.BufferedReader(_Streams(path, raw, comp), buffer_size=READ_SIZE)


class TooLong(bytes):
    """A line longer than the limit, in place of it: its first bytes (``head``) and its full ``size``.

    The rest was read and dropped as it came, so no line is ever held whole
    beyond the limit (the chunk job quarantines it as ``too_long``).
    """

    size: int

    def __new__(cls, head: bytes, size: int) -> TooLong:
        obj = super().__new__(cls, head)
        obj.size = size
        return obj


def shard_lines(
    path: str,
    fmt: str | None = None,
    compression: str | None = None,
    raw: io.RawIOBase | None = None,
    max_line: int | None = None,
) -> Iterator[bytes]:
    """The lines of a shard (see :func:`iter_lines`), decompressed by its magic bytes.

    Compressed output goes to the line splitter as each piece is decoded,
    without the copies a BufferedReader would make (the hot path of
    ``snakellm chunk``).
    """
    comp = compression or detect_compression(path, fmt)
    raw = raw if raw is not None else open(path, "rb", buffering=0)
    if comp == "none":
        with io.BufferedReader(raw, buffer_size=READ_SIZE) as fh:
            yield from iter_lines(fh, max_line=max_line)
        return
    with _Streams(path, raw, comp) as z:
        yield from iter_lines(z, max_line=max_line)


TOO_LONG_HEAD = 1024  # bytes of a too-long line kept in its quarantine record


def iter_lines(fh: BinaryIO | _Streams, block: int = READ_SIZE, max_line: int | None = None) -> Iterator[bytes]:
    r"""The lines of a stream with their terminators, splitting on ``\n``, ``\r\n`` and a lone ``\r``.

    Files exported on old Macs end lines with CR alone; reading them by ``\n``
    would make the whole shard one line. A final line without a terminator is
    yielded as is. A very long line is collected in pieces (no quadratic
    copying); one longer than ``max_line`` bytes (terminator included) comes
    out as a :class:`TooLong` holding its first bytes, and what lies beyond
    the limit is never held.
    """
    limit = max_line if max_line is not None else 1 << 62
    pending: list[bytes] = []  # an unterminated line, in pieces
    held = 0  # bytes in pending
    over = 0  # > 0: the current line passed the limit; its length so far (pending holds its head only)
    over_cr = False  # ... and the bytes dropped so far ended with \r (a \n may follow)
    read = fh.next_block if isinstance(fh, _Streams) else lambda: fh.read(block)
    while buf := read():
        if over:
            if over_cr:
                cut = 0 if buf[:1] == b"\n" else -1
            else:
                cut = _first_end(buf)
                if cut < 0 or (buf[cut] == 13 and cut + 1 == len(buf)):
                    over += len(buf)
                    over_cr = cut >= 0
                    continue
                cut += buf[cut : cut + 2] == b"\r\n"
            yield TooLong(pending[0], over + cut + 1)
            pending, held, over, over_cr = [], 0, 0, False
            buf = buf[cut + 1 :]
            if not buf:
                continue
        if pending and pending[-1].endswith(b"\r"):
            # a line ending in \r at a block edge: \r\n split in two, or a lone \r
            if buf.startswith(b"\n"):
                pending.append(b"\n")
                buf = buf[1:]
            line = b"".join(pending)
            yield line if len(line) <= limit else TooLong(line[:TOO_LONG_HEAD], len(line))
            pending, held = [], 0
            if not buf:
                continue
        lines = buf.splitlines(keepends=True)
        last = lines[-1]
        if len(lines) == 1 and not last.endswith((b"\n", b"\r")):
            pending.append(last)
            held += len(last)
            if held > limit:  # keep the head only from now on
                over, over_cr = held, False
                pending = [b"".join(pending)[:TOO_LONG_HEAD]]
            continue
        if pending:
            lines[0] = b"".join(pending) + lines[0]
            pending, held = [], 0
        if not last.endswith(b"\n"):  # unterminated, or \r that may be followed by \n
            pending.append(lines.pop())
            held = len(pending[0])
        if lines and (len(buf) > limit or len(lines[0]) > limit):
            lines = [x if len(x) <= limit else TooLong(x[:TOO_LONG_HEAD], len(x)) for x in lines]
        yield from lines
        if held > limit:
            over, over_cr = held, pending[0].endswith(b"\r")
            pending = [pending[0][:TOO_LONG_HEAD]]
    if over:
        yield TooLong(pending[0], over)
    elif pending:
        line = b"".join(pending)
        yield line if len(line) <= limit else TooLong(line[:TOO_LONG_HEAD], len(line))


def _first_end(buf: bytes) -> int:
    """Index of the first \\n or \\r in ``buf`` (-1: none)."""
    n, r = buf.find(b"\n"), buf.find(b"\r")
    if n < 0:
        return r
    return n if r < 0 else min(n, r)
