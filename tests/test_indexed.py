"""The streaming MMIDIDX writer against megatron-core's own IndexedDatasetBuilder.

Byte identity for the same documents (uint16 and int32, empty documents,
documents split over many batches, the .idx assembled over many blocks), and
megatron-core's IndexedDataset reading what we wrote.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from snakellm.tokenize import indexed as indexed
from snakellm.tokenize.indexed import IndexedFormatError, IndexedReader, IndexedWriter, optimal_dtype

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder


def random_documents(rng: np.random.Generator, n: int, vocab: int, eod: int, empty_every: int = 0) -> list[np.ndarray]:
    """Documents as preprocess_data.py --append-eod hands them over: ids then EOD, or nothing."""
    docs = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            docs.append(np.zeros(0, dtype=np.int64))
            continue
        ids = rng.integers(0, vocab, size=int(rng.integers(1, 300)), dtype=np.int64)
        docs.append(np.append(ids, eod))
    return docs


def megatron_write(prefix: str, docs: list[np.ndarray], dtype) -> None:
    """What tools/preprocess_data.py does per document: add_document(ids, [len]) (no sequence when empty)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(d.tolist(), [len(d)] if len(d) else [])
    builder.finalize(prefix + ".idx")


def ours_write(prefix: str, docs: list[np.ndarray], dtype, batch: int) -> None:
    w = IndexedWriter(prefix + ".bin", prefix + ".idx", dtype)
    for i in range(0, len(docs), batch):
        part = docs[i : i + batch]
        flat = np.concatenate(part) if part else np.zeros(0)
        w.add_documents(flat.astype(dtype), np.array([len(d) for d in part]))
    w.finalize()


@pytest.mark.parametrize(
    "vocab,batch,block",
    [(50257, 7, None), (2000, 1000, None), (65500, 3, None), (100_000, 13, 5)],
    ids=["gpt2-uint16", "one-batch", "int32-boundary", "int32-small-blocks"],
)
def test_byte_identical_to_megatron_builder(tmp_path, monkeypatch, vocab, batch, block):
    if block:  # assemble the .idx over many blocks: exercises the pointer carry between blocks
        monkeypatch.setattr(indexed, "_BLOCK", block)
    rng = np.random.default_rng(vocab)
    docs = random_documents(rng, 200, vocab, vocab - 1, empty_every=17)
    dtype = optimal_dtype(vocab)
    assert dtype is DType.optimal_dtype(vocab)
    megatron_write(str(tmp_path / "ref"), docs, dtype)
    ours_write(str(tmp_path / "ours"), docs, dtype, batch)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes(), ext

    ds = IndexedDataset(str(tmp_path / "ours"))
    ours = IndexedReader(tmp_path / "ours")
    assert len(ds.document_indices) - 1 == len(ours) == len(docs)
    nonempty = [d for d in docs if len(d)]
    assert len(ds) == len(nonempty)
    for i, d in enumerate(nonempty):
        assert np.array_equal(ds[i], d)
    for i, d in enumerate(docs):
        assert np.array_equal(ours.document(i), d)


def test_side_files_are_removed_and_nothing_else_is_written(tmp_path):
    w = IndexedWriter(tmp_path / "x.bin", tmp_path / "x.idx", np.uint16)
    w.add_documents(np.array([1, 2, 3], dtype=np.uint16), np.array([3]))
    w.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.idx"]
    assert w.sequences == 1 and w.documents == 1 and w.tokens == 3


def test_writer_refuses_wrong_dtype_and_bad_lengths(tmp_path):
    with IndexedWriter(tmp_path / "x.bin", tmp_path / "x.idx", np.uint16) as w:
        with pytest.raises(TypeError):
            w.add_documents(np.array([1, 2], dtype=np.int32), np.array([2]))
        with pytest.raises(ValueError):
            w.add_documents(np.array([1, 2], dtype=np.uint16), np.array([3]))


def test_reader_rejects_truncated_and_foreign_files(tmp_path):
    ours_write(str(tmp_path / "x"), [np.array([5, 6, 7]), np.array([8, 9])], np.uint16, 10)
    idx = (tmp_path / "x.idx").read_bytes()
    (tmp_path / "x.idx").write_bytes(idx[:-4])
    with pytest.raises(IndexedFormatError, match="truncated"):
        IndexedReader(tmp_path / "x")
    (tmp_path / "x.idx").write_bytes(b"NOTMAGIC!" + idx[9:])
    with pytest.raises(IndexedFormatError, match="bad magic"):
        IndexedReader(tmp_path / "x")
    (tmp_path / "x.idx").write_bytes(idx)
    (tmp_path / "x.bin").write_bytes(b"\0\0")
    with pytest.raises(IndexedFormatError, match="the index describes 10"):
        IndexedReader(tmp_path / "x")
