"""``snakellm tokenize``: one chunk's jsonl -> Megatron ``{prefix}.bin/.idx`` (+ ``.stats.json``).

What Megatron-LM's ``tools/preprocess_data.py --append-eod`` writes, at the
tokenizer's own speed: every document's ids followed by the EOD id, one
sequence per document, dtype uint16 below 65,500 tokens else int32.

How it stays fast and flat:

* the main thread only reads: it cuts the jsonl into blocks of whole lines of
  about ``--batch-mb`` (smaller towards the end of the file, so that the threads
  finish together instead of one encoding the last big block alone) and writes
  finished blocks in order. ``--threads`` worker threads each parse a whole
  block (orjson) and encode it (tiktoken, sentencepiece and tokenizers all
  release the GIL while encoding) into one array. Parsing in the workers keeps
  the main thread from holding the GIL while an encoder waits for it. At most
  ``2 * threads`` blocks' worth of bytes are in flight, so memory does not grow
  with the chunk.
* lengths and document ends are spooled to side files (see ``indexed.py``).
* where the encoder is a fast path checked against a reference library
  (tiktoken for a ``tokenizer.json``), the sampled documents of each written
  block are compared with that library in the same worker pool, alongside the
  encoding of the next blocks; all comparisons finish before anything is
  published, and the first difference re-encodes the chunk with the library.

Every token id is range-checked against the vocabulary before it is written:
an id outside it would silently wrap in uint16 (numpy casts without checking)
or crash the trainer's embedding lookup much later. Outputs appear together
and only on success (``atomic_group``), the stats file last.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

from snakellm.errors import DataError, StepFailed
from snakellm.io.atomic import atomic_group
from snakellm.io.progress import progress
from snakellm.tokenize import encoders as tokmod
from snakellm.tokenize.indexed import IndexedWriter, dtype_name, optimal_dtype, prefix_paths, read_index

MIN_BLOCK = 1 << 16  # the smallest block the reader cuts towards the end of a file


class TokenizeError(DataError):
    """Bad input to tokenize, phrased with the file (and line) at fault."""


class BlockError(StepFailed):
    """Bad input in a block, at a line counted from the block's first (the main thread adds the block's own)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line, self.reason = line, reason


class Mismatch(NamedTuple):
    line: int
    detail: str


class Verify(NamedTuple):
    """Which documents the fast encoder's ids are checked on against the reference library."""

    every: int  # each document whose index in the chunk is a multiple of this (1: all)


class VerificationFailed(StepFailed):
    """The fast encoder's ids differ from the reference library's on a document."""

    def __init__(self, source: str, mismatch: Mismatch) -> None:
        super().__init__(f"{source}:{mismatch.line}: {mismatch.detail}")
        self.line = mismatch.line


class Encoded(NamedTuple):
    tokens: np.ndarray  # in the dataset dtype, EOD after every non-empty document
    lengths: np.ndarray  # int64 tokens per document (incl. EOD; 0 for an empty document)
    nbytes: int  # bytes of jsonl of the documents (newlines included, blank lines not)
    texts: list[str]  # the documents (kept only when they are to be verified)
    lines: list[int]  # line of each document, counted from 0 at the block's first line
    newlines: int  # newlines in the block (how far the next block's first line is)


class Sample(NamedTuple):
    """Documents whose ids are compared with the reference library's."""

    docs: list[int]  # position in the chunk
    lines: list[int]
    texts: list[str]
    ids: list[np.ndarray]  # what was written for each, without the EOD


def read_blocks(path: str, batch_bytes: int, threads: int = 1) -> Iterator[bytes]:
    """The jsonl in blocks of whole lines: about ``batch_bytes``, less towards the end.

    A block is cut at ``remaining bytes / (2 * threads)`` once that is below ``batch_bytes``
    (never below ``MIN_BLOCK``): the last blocks shrink geometrically, so that no thread is left
    encoding a full block while the others have run out of work.
    """
    size = os.path.getsize(path)
    floor = min(batch_bytes, MIN_BLOCK)
    done, carry = 0, b""
    with open(path, "rb", buffering=0) as fh:
        while True:
            want = max(floor, min(batch_bytes, (size - done) // (2 * threads)))
            buf = fh.read(want)
            if not buf:
                if carry:  # a last line without a newline
                    yield carry
                return
            done += len(buf)
            data = carry + buf if carry else buf
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than the block: read on
                carry = data
                continue
            block, carry = (data, b"") if cut == len(data) else (data[:cut], data[cut:])
            yield block  # the lines are counted by the worker that parses it (bytes.count is slow)


def parse_block(block: bytes, key: str) -> tuple[list[str], list[int], int, int]:
    """The documents of a block, their lines (from 0), their bytes of jsonl and the block's newlines.

    Blank lines are no documents.
    """
    loads, JSONDecodeError = orjson.loads, orjson.JSONDecodeError
    texts: list[str] = []
    lines: list[int] = []
    nbytes = 0
    rows = block.split(b"\n")
    for lineno, raw in enumerate(rows):
        if raw and not raw.isspace():
            nbytes += len(raw) + 1
            try:
                obj = loads(raw)
            except JSONDecodeError as e:
                raise BlockError(lineno, f"invalid JSON: {e}") from None
            text = obj.get(key) if type(obj) is dict else None
            if type(text) is not str:
                raise BlockError(lineno, f"no string under key {key!r}")
            texts.append(text)
            lines.append(lineno)
    if rows[-1] and texts and lines[-1] == len(rows) - 1:
        nbytes -= 1  # the file's last line has no newline
    return texts, lines, nbytes, len(rows) - 1


def encode_block(tok: tokmod.Tokenizer, block: bytes, key: str, dtype: np.dtype, keep_texts: bool = False) -> Encoded:
    """Parse and encode one block into a single array with EODs (runs in a worker thread)."""
    texts, lines, nbytes, newlines = parse_block(block, key)
    ids = tok.encode_batch(texts) if texts else []
    # keep the encoder's own dtype (tiktoken uint32, sentencepiece int32) through the concatenation
    wide = ids[0].dtype if ids and isinstance(ids[0], np.ndarray) else np.dtype(np.int64)
    eod = np.array([tok.eod_id], dtype=wide)
    parts = []
    lengths = np.zeros(len(ids), dtype=np.int64)
    for i, a in enumerate(ids):
        n = len(a)
        if n:  # preprocess_data.py: an empty document gets no EOD
            parts.append(a if isinstance(a, np.ndarray) else np.asarray(a, dtype=wide))
            parts.append(eod)
            lengths[i] = n + 1
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=wide)
    hi = 0
    if flat.size:
        hi = int(flat.max())
        lo = int(flat.min()) if flat.dtype.kind != "u" else 0
        if hi >= tok.vocab_size or lo < 0:
            bad = hi if hi >= tok.vocab_size else lo
            doc = next(j for j, a in enumerate(ids) if len(a) and bad in np.asarray(a))
            fits = np.iinfo(dtype).min <= bad <= np.iinfo(dtype).max
            raise BlockError(
                lines[doc],
                f"token id {bad} is outside the vocabulary of "
                f"{tok.vocab_size} tokens of {next(iter(tok.files.values()))}"
                + ("" if fits else f" and does not fit the dataset dtype {dtype_name(dtype)}"),
            )
    if flat.dtype != dtype and flat.dtype.itemsize == dtype.itemsize and hi <= np.iinfo(dtype).max:
        tokens = flat.view(dtype)  # tiktoken's uint32 as int32: every id is checked to fit, no copy
    else:
        tokens = flat.astype(dtype, copy=False)
    return Encoded(tokens, lengths, nbytes, texts if keep_texts else [], lines, newlines)


def pick_sample(enc: Encoded, first: int, line: int, verify: Verify) -> Sample | None:
    """The documents of a block that the verification compares (``first``: the index in the chunk of its first
    document, ``line``: the line number of its first line)."""
    picked = range(-first % verify.every, len(enc.lengths), verify.every)
    if not picked:
        return None
    ends = np.cumsum(enc.lengths)
    ids = []
    for i in picked:
        n = int(enc.lengths[i])
        ids.append(enc.tokens[ends[i] - n : ends[i] - 1] if n else enc.tokens[:0])
    return Sample(
        [first + i for i in picked], [line + enc.lines[i] for i in picked], [enc.texts[i] for i in picked], ids
    )


def verify_sample(tok: tokmod.Tokenizer, sample: Sample) -> tuple[int, Mismatch | None]:
    """Compare the sample's ids with the reference library's: (documents checked, first mismatch)."""
    ref = tok.reference_batch(sample.texts)
    for k, want in enumerate(ref):
        got = sample.ids[k].tolist()
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            detail = (
                f"document {sample.docs[k]}: {tok.backend} gives {len(got)} ids, the reference {len(want)}; "
                f"first difference at token {at}: {got[at : at + 3]} != {want[at : at + 3]}"
            )
            return len(ref), Mismatch(sample.lines[k], detail)
    return len(ref), None


def tokenize_file(
    jsonl: str,
    prefix: str,
    tok: tokmod.Tokenizer,
    *,
    key: str = "text",
    threads: int = 2,
    stats: str | None = None,
    source: str = "",
    chunk: str = "",
    batch_bytes: int = 1 << 20,
    show_progress: bool = True,
    verify: float = 0.005,
    verify_all_bytes: int = 2_000_000,
    allow_empty: bool = False,
) -> dict:
    """Tokenize ``jsonl`` into ``{prefix}.bin/.idx`` and ``{prefix}.stats.json``; return the stats.

    An empty chunk is an error unless ``allow_empty`` (a curated chunk whose documents were all
    removed): then it is a valid dataset of no documents, which the blend leaves out.

    Where the tokenizer runs a fast path (tiktoken for a ``tokenizer.json``), the ids of a
    ``verify`` fraction of the documents (all of them when the chunk is at most
    ``verify_all_bytes``) are compared with the reference library's; on the first
    difference the chunk is encoded again with the reference library, with a warning
    naming the document.
    """
    if not os.path.isfile(jsonl):
        raise TokenizeError(f"{jsonl}: input not found")
    tok.prepare_threads(max(1, threads))  # loading, not encoding: main() has done it already
    check = None
    if tok.can_verify and verify > 0:
        check = Verify(1 if os.path.getsize(jsonl) <= verify_all_bytes else max(1, round(1 / min(1.0, verify))))
    try:
        return _tokenize_file(
            jsonl, prefix, tok, key, threads, stats, source, chunk, batch_bytes, show_progress, check, allow_empty
        )
    except VerificationFailed as e:
        reason = f"fell back: tiktoken ids differ from tokenizers at {e}"
        print(f"snakellm tokenize: warning: {e}; encoding {jsonl} again with tokenizers", file=sys.stderr)
        tok.use_reference(reason)
        return _tokenize_file(
            jsonl, prefix, tok, key, threads, stats, source, chunk, batch_bytes, show_progress, None, allow_empty
        )


def _tokenize_file(
    jsonl: str,
    prefix: str,
    tok: tokmod.Tokenizer,
    key: str,
    threads: int,
    stats: str | None,
    source: str,
    chunk: str,
    batch_bytes: int,
    show_progress: bool,
    check: Verify | None,
    allow_empty: bool = False,
) -> dict:
    bin_p, idx_p = prefix_paths(prefix)
    stats_p = Path(stats) if stats else Path(str(prefix) + ".stats.json")
    dtype = np.dtype(optimal_dtype(tok.vocab_size))
    threads = max(1, threads)
    window = 2 * threads * batch_bytes  # bytes of jsonl in flight
    t0 = time.perf_counter()
    text_bytes = empty_docs = verified = 0
    with atomic_group(bin_p, idx_p, stats_p) as (tmp_bin, tmp_idx, tmp_stats):
        with (
            IndexedWriter(tmp_bin, tmp_idx, dtype) as writer,
            ThreadPoolExecutor(threads) as pool,
            progress(
                total=os.path.getsize(jsonl),
                unit="B",
                unit_scale=True,
                desc=f"tokenize {source}/{chunk}",
                enabled=show_progress,
            ) as bar,
        ):
            pending: deque[tuple[Future, int]] = deque()
            checks: deque[Future] = deque()  # verifications, in document order
            in_flight = 0
            line = 1  # the line number of the next block's first line

            def settle(block: bool) -> None:
                """Collect finished verifications in order (all of them if ``block``); raise on a difference."""
                nonlocal verified
                while checks and (block or checks[0].done()):
                    n, mismatch = checks.popleft().result()
                    verified += n
                    if mismatch:
                        raise VerificationFailed(jsonl, mismatch)

            def write_one() -> None:
                nonlocal text_bytes, empty_docs, in_flight, line
                future, size = pending.popleft()
                in_flight -= size
                try:
                    enc: Encoded = future.result()
                except BlockError as e:
                    raise TokenizeError(f"{jsonl}:{line + e.line}: {e.reason}") from None
                if check:
                    sample = pick_sample(enc, writer.documents, line, check)
                    if sample:
                        checks.append(pool.submit(verify_sample, tok, sample))
                    settle(block=False)
                writer.add_documents(enc.tokens, enc.lengths)
                empty_docs += int((enc.lengths == 0).sum())
                text_bytes += enc.nbytes
                bar.update(size)
                line += enc.newlines

            try:
                for block in read_blocks(jsonl, batch_bytes, threads):
                    pending.append((pool.submit(encode_block, tok, block, key, dtype, check is not None), len(block)))
                    in_flight += len(block)
                    while in_flight >= window:
                        write_one()
                while pending:
                    write_one()
                settle(block=True)
            finally:
                for f, _ in pending:
                    f.cancel()
                for f in checks:
                    f.cancel()
            if writer.documents == 0 and not allow_empty:
                raise TokenizeError(f"{jsonl}: no documents to tokenize (empty chunk)")
            writer.finalize()
        _check_written(prefix, tmp_bin, tmp_idx, writer, dtype)
        seconds = time.perf_counter() - t0
        result = _stats_record(
            jsonl, prefix, key, tok, source, chunk, writer, dtype, empty_docs, text_bytes, verified, threads, seconds
        )
        tmp_stats.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _check_written(prefix: str, tmp_bin: Path, tmp_idx: Path, writer: IndexedWriter, dtype: np.dtype) -> None:
    """Self-check before publishing: the index on disk describes what was written.

    A mismatch here (a writer bug, a full disk) would otherwise surface only when Megatron reads the data.
    """
    index = read_index(tmp_idx)
    if (
        len(index.document_indices) != writer.documents + 1
        or int(index.lengths.sum(dtype=np.int64)) != writer.tokens
        or tmp_bin.stat().st_size != writer.tokens * dtype.itemsize
    ):
        raise TokenizeError(f"{prefix}: the written index does not match the tokens written")
    del index


def _stats_record(
    jsonl: str,
    prefix: str,
    key: str,
    tok: tokmod.Tokenizer,
    source: str,
    chunk: str,
    writer: IndexedWriter,
    dtype: np.dtype,
    empty_docs: int,
    text_bytes: int,
    verified: int,
    threads: int,
    seconds: float,
) -> dict:
    """The ``{prefix}.stats.json`` record: what blend, report and staleness checks read of a tokenized chunk."""
    return {
        "source": source,
        "chunk": chunk,
        "input": str(jsonl),
        "prefix": str(prefix),
        "key": key,
        "tokenizer": tok.info(),
        "encoder": tok.backend,
        "encoder_reason": tok.encoder_reason,
        "verified_documents": verified,
        "dtype": dtype_name(dtype),
        "documents": writer.documents,
        "empty_documents": empty_docs,
        "sequences": writer.sequences,
        "tokens": writer.tokens,
        "eod_tokens": writer.documents - empty_docs,
        "text_bytes": text_bytes,
        "bin_bytes": writer.tokens * dtype.itemsize,
        "threads": threads,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(writer.tokens / seconds) if seconds > 0 else None,
    }
