"""Megatron's ``MMIDIDX`` indexed dataset (``.bin`` + ``.idx``), written as a stream.

The format is megatron-core's ``megatron/core/datasets/indexed_dataset.py``:

``.bin``
    the token ids of every document back to back, in the dataset's dtype.
``.idx``
    9-byte magic ``MMIDIDX\\x00\\x00``, ``<Q`` version 1, ``<B`` dtype code,
    ``<Q`` sequence count, ``<Q`` document count (+1), then ``int32`` sequence
    lengths, ``int64`` byte pointers of the sequences in ``.bin`` and ``int64``
    document indices (``0`` then, per document, the number of sequences so far).

Megatron's ``IndexedDatasetBuilder`` keeps every length in a Python list and
writes the ``.idx`` at the end. :class:`IndexedWriter` writes the same bytes
but spools lengths and document ends to side files, so memory stays flat
however large the chunk is; ``tests/test_indexed.py`` proves byte identity.

``add_documents`` takes documents with ``--append-eod`` semantics already
applied, as ``tools/preprocess_data.py`` hands them to the builder: one
sequence per document, or none for a document that tokenized to nothing (then
no EOD either, and the document index repeats).
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from snakellm.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

# megatron.core.datasets.indexed_dataset.DType
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

_BLOCK = 1 << 20  # elements per block when assembling the .idx


class IndexedFormatError(DataError):
    """A ``.bin``/``.idx`` pair that is not valid MMIDIDX."""


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65500 tokens, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def prefix_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``(prefix.bin, prefix.idx)``."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedWriter:
    """Stream documents into ``bin_path`` and finish with ``idx_path``.

    Give it temporary paths (see :func:`snakellm.atomic.atomic_group`): it
    writes in place and renames nothing. Side files are created next to
    ``idx_path`` and removed by :meth:`finalize` or :meth:`close`.
    """

    def __init__(self, bin_path: str | os.PathLike, idx_path: str | os.PathLike, dtype) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.type not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self.bin_path = Path(bin_path)
        self.idx_path = Path(idx_path)
        self._bin = open(self.bin_path, "wb", buffering=0)
        d = str(self.idx_path.parent)
        self._lengths = tempfile.TemporaryFile(dir=d, prefix=".lengths.")  # int32 per sequence
        self._doc_ends = tempfile.TemporaryFile(dir=d, prefix=".docs.")  # int64 per document
        self.sequences = 0
        self.documents = 0
        self.tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` concatenated, ``lengths`` tokens per document.

        ``tokens`` must already have the writer's dtype (range-checked by the caller).
        """
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, dataset is {self.dtype}")
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError("document lengths do not add up to the tokens given")
        if tokens.size:
            self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))  # type: ignore[arg-type]  # no copy
        nonempty = lengths[lengths > 0]
        if nonempty.size and int(nonempty.max()) > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2^31-1 tokens does not fit MMIDIDX")
        self._lengths.write(nonempty.astype(np.int32).tobytes())
        ends = self.sequences + np.cumsum(lengths > 0, dtype=np.int64)
        self._doc_ends.write(ends.tobytes())
        self.sequences += int(nonempty.size)
        self.documents += int(lengths.size)
        self.tokens += int(tokens.size)

    def finalize(self) -> None:
        """Close the ``.bin`` and write the ``.idx`` in blocks of constant size."""
        self._bin.close()
        itemsize = self.dtype.itemsize
        with open(self.idx_path, "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", DTYPE_CODES[self.dtype.type]))
            out.write(struct.pack("<Q", self.sequences))
            out.write(struct.pack("<Q", self.documents + 1))
            # int32 sequence lengths
            self._lengths.seek(0)
            while buf := self._lengths.read(_BLOCK * 4):
                out.write(buf)
            # int64 byte pointers: exclusive running sum of length * itemsize
            self._lengths.seek(0)
            carry = 0
            while buf := self._lengths.read(_BLOCK * 4):
                lens = np.frombuffer(buf, dtype=np.int32).astype(np.int64) * itemsize
                ptr = np.empty_like(lens)
                ptr[0] = carry
                np.cumsum(lens[:-1], out=ptr[1:])
                ptr[1:] += carry
                carry += int(lens.sum())
                out.write(ptr.tobytes())
            # int64 document indices: a leading 0, then each document's end
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            self._doc_ends.seek(0)
            while buf := self._doc_ends.read(_BLOCK * 8):
                out.write(buf)
        self.close()

    def close(self) -> None:
        for f in (self._bin, self._lengths, self._doc_ends):
            if not f.closed:
                f.close()

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Index(NamedTuple):
    dtype: np.dtype
    lengths: np.ndarray  # int32, per sequence
    pointers: np.ndarray  # int64, byte offset of each sequence in .bin
    document_indices: np.ndarray  # int64, documents + 1 entries


def read_index(idx_path: str | os.PathLike) -> Index:
    """Parse an ``.idx`` (memory-mapped) and check that it is consistent."""
    idx_path = Path(idx_path)
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as fh:
        head = fh.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE or head[:9] != MAGIC:
        raise IndexedFormatError(f"{idx_path}: not an MMIDIDX index (bad magic)")
    (version,) = struct.unpack_from("<Q", head, 9)
    (code,) = struct.unpack_from("<B", head, 17)
    (nseq,) = struct.unpack_from("<Q", head, 18)
    (ndoc,) = struct.unpack_from("<Q", head, 26)
    if version != VERSION or code not in CODE_DTYPES:
        raise IndexedFormatError(f"{idx_path}: version {version}, dtype code {code}: not supported")
    expected = HEADER_SIZE + nseq * 4 + nseq * 8 + ndoc * 8
    if size < expected:
        raise IndexedFormatError(f"{idx_path}: truncated ({size} bytes, header says {expected})")
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    off = HEADER_SIZE
    lengths = np.frombuffer(mm, dtype=np.int32, count=nseq, offset=off)
    off += nseq * 4
    pointers = np.frombuffer(mm, dtype=np.int64, count=nseq, offset=off)
    off += nseq * 8
    docs = np.frombuffer(mm, dtype=np.int64, count=ndoc, offset=off)
    return Index(np.dtype(CODE_DTYPES[code]), lengths, pointers, docs)


class IndexedReader:
    """Read documents of a ``{prefix}.bin/.idx`` pair (for tests, stats and tools)."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.bin_path, self.idx_path = prefix_paths(prefix)
        self.index = read_index(self.idx_path)
        nbytes = int(self.index.lengths.astype(np.int64).sum()) * self.index.dtype.itemsize
        if self.bin_path.stat().st_size != nbytes:
            raise IndexedFormatError(
                f"{self.bin_path}: {self.bin_path.stat().st_size} bytes, the index describes {nbytes}"
            )
        self.tokens = (
            np.memmap(self.bin_path, mode="r", dtype=self.index.dtype)
            if nbytes
            else np.zeros(0, dtype=self.index.dtype)
        )

    def __len__(self) -> int:
        """Number of documents."""
        return len(self.index.document_indices) - 1

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i`` (its sequences concatenated)."""
        d = self.index.document_indices
        a, b = int(d[i]), int(d[i + 1])
        if a == b:
            return np.zeros(0, dtype=self.index.dtype)
        itemsize = self.index.dtype.itemsize
        start = int(self.index.pointers[a]) // itemsize
        end = int(self.index.pointers[b - 1]) // itemsize + int(self.index.lengths[b - 1])
        return np.asarray(self.tokens[start:end])
