"""``snakellm tokenize``: one chunk's jsonl -> Megatron ``{prefix}.bin/.idx`` (+ ``.stats.json``).

What Megatron-LM's ``tools/preprocess_data.py --append-eod`` writes, at the
tokenizer's own speed: every document's ids followed by the EOD id, one
sequence per document, dtype uint16 below 65,500 tokens else int32.

How it stays fast and flat:

* the main thread streams the jsonl and cuts it into batches of about
  ``--batch-mb`` of text; ``--threads`` worker threads encode whole batches
  (tiktoken, sentencepiece and tokenizers all release the GIL while encoding)
  and turn them into one array each; the main thread writes finished batches
  in order. At most ``2 * threads`` batches are in flight, so memory does not
  grow with the chunk.
* lengths and document ends are spooled to side files (see ``indexed.py``).

Every token id is range-checked against the vocabulary before it is written:
an id outside it would silently wrap in uint16 (numpy casts without checking)
or crash the trainer's embedding lookup much later. Outputs appear together
and only on success (``atomic_group``), the stats file last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

from snakellm.io.atomic import atomic_group
from snakellm.io.progress import progress
from snakellm.tokenize import encoders as tokmod
from snakellm.tokenize.indexed import IndexedWriter, dtype_name, optimal_dtype, prefix_paths, read_index


class TokenizeError(ValueError):
    """Bad input to tokenize, phrased with the file (and line) at fault."""


class Batch(NamedTuple):
    texts: list[str]
    lines: list[int]  # line number of each document in the jsonl, for error messages
    nbytes: int
    first: int = 0  # index of the first document in the chunk


class Mismatch(NamedTuple):
    line: int
    detail: str


class Verify(NamedTuple):
    """Which documents the fast encoder's ids are checked on against the reference library."""

    every: int  # each document whose index is a multiple of this (1: all)


class VerificationFailed(Exception):
    """The fast encoder's ids differ from the reference library's on a document."""

    def __init__(self, source: str, mismatch: Mismatch) -> None:
        super().__init__(f"{source}:{mismatch.line}: {mismatch.detail}")
        self.line = mismatch.line


class Encoded(NamedTuple):
    tokens: np.ndarray  # in the dataset dtype, EOD after every non-empty document
    lengths: np.ndarray  # int64 tokens per document (incl. EOD; 0 for an empty document)
    nbytes: int
    verified: int = 0  # documents whose ids were compared with the reference library
    mismatch: Mismatch | None = None


def read_batches(path: str, key: str, batch_bytes: int) -> Iterator[Batch]:
    """The documents of a jsonl file, in batches of about ``batch_bytes`` of json."""
    loads, JSONDecodeError = orjson.loads, orjson.JSONDecodeError
    texts: list[str] = []
    lines: list[int] = []
    size = first = 0
    with open(path, "rb", buffering=1 << 22) as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.isspace():
                continue  # a blank line is no document (stops at the first non-space byte)
            try:
                obj = loads(line)
            except JSONDecodeError as e:
                raise TokenizeError(f"{path}:{lineno}: invalid JSON: {e}") from None
            text = obj.get(key) if type(obj) is dict else None
            if type(text) is not str:
                raise TokenizeError(f"{path}:{lineno}: no string under key {key!r}")
            texts.append(text)
            lines.append(lineno)
            size += len(line)
            if size >= batch_bytes:
                yield Batch(texts, lines, size, first)
                first += len(texts)
                texts, lines, size = [], [], 0
    if texts:
        yield Batch(texts, lines, size, first)


def verify_batch(tok: tokmod.Tokenizer, batch: Batch, ids: list, verify: Verify) -> tuple[int, Mismatch | None]:
    """Compare the ids of the sampled documents with the reference library's: (documents checked, first mismatch)."""
    start = -batch.first % verify.every
    picked = range(start, len(batch.texts), verify.every)
    if not picked:
        return 0, None
    ref = tok.reference_batch([batch.texts[i] for i in picked])
    for i, want in zip(picked, ref, strict=True):
        got = ids[i].tolist() if isinstance(ids[i], np.ndarray) else [int(x) for x in ids[i]]
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            detail = (
                f"document {batch.first + i}: {tok.backend} gives {len(got)} ids, the reference {len(want)}; "
                f"first difference at token {at}: {got[at : at + 3]} != {want[at : at + 3]}"
            )
            return len(picked), Mismatch(batch.lines[i], detail)
    return len(picked), None


def encode_batch(
    tok: tokmod.Tokenizer, batch: Batch, dtype: np.dtype, source: str, verify: Verify | None = None
) -> Encoded:
    """Encode one batch into a single array with EODs (runs in a worker thread)."""
    ids = tok.encode_batch(batch.texts)
    verified, mismatch = verify_batch(tok, batch, ids, verify) if verify and tok.can_verify else (0, None)
    if mismatch:
        return Encoded(np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64), batch.nbytes, verified, mismatch)
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
    if flat.size:
        hi, lo = int(flat.max()), int(flat.min())
        if hi >= tok.vocab_size or lo < 0:
            bad = hi if hi >= tok.vocab_size else lo
            doc = next(j for j, a in enumerate(ids) if len(a) and bad in np.asarray(a))
            fits = np.iinfo(dtype).min <= bad <= np.iinfo(dtype).max
            raise TokenizeError(
                f"{source}:{batch.lines[doc]}: token id {bad} is outside the vocabulary of "
                f"{tok.vocab_size} tokens of {next(iter(tok.files.values()))}"
                + ("" if fits else f" and does not fit the dataset dtype {dtype_name(dtype)}")
            )
    return Encoded(flat.astype(dtype, copy=False), lengths, batch.nbytes, verified)


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
) -> dict:
    """Tokenize ``jsonl`` into ``{prefix}.bin/.idx`` and ``{prefix}.stats.json``; return the stats.

    Where the tokenizer runs a fast path (tiktoken for a ``tokenizer.json``), the ids of a
    ``verify`` fraction of the documents (all of them when the chunk is at most
    ``verify_all_bytes``) are compared with the reference library's; on the first
    difference the chunk is encoded again with the reference library, with a warning
    naming the document.
    """
    if not os.path.isfile(jsonl):
        raise TokenizeError(f"{jsonl}: input not found")
    check = None
    if tok.can_verify and verify > 0:
        check = Verify(1 if os.path.getsize(jsonl) <= verify_all_bytes else max(1, round(1 / min(1.0, verify))))
    try:
        return _tokenize_file(jsonl, prefix, tok, key, threads, stats, source, chunk, batch_bytes, show_progress, check)
    except VerificationFailed as e:
        reason = f"fell back: tiktoken ids differ from tokenizers at {e}"
        print(f"snakellm tokenize: warning: {e}; encoding {jsonl} again with tokenizers", file=sys.stderr)
        tok.use_reference(reason)
        return _tokenize_file(jsonl, prefix, tok, key, threads, stats, source, chunk, batch_bytes, show_progress, None)


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
) -> dict:
    bin_p, idx_p = prefix_paths(prefix)
    stats_p = Path(stats) if stats else Path(str(prefix) + ".stats.json")
    dtype = np.dtype(optimal_dtype(tok.vocab_size))
    threads = max(1, threads)
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
            pending: deque = deque()

            def write_one() -> None:
                nonlocal text_bytes, empty_docs, verified
                enc: Encoded = pending.popleft().result()
                if enc.mismatch:
                    raise VerificationFailed(jsonl, enc.mismatch)
                verified += enc.verified
                writer.add_documents(enc.tokens, enc.lengths)
                empty_docs += int((enc.lengths == 0).sum())
                text_bytes += enc.nbytes
                bar.update(enc.nbytes)

            try:
                for batch in read_batches(jsonl, key, batch_bytes):
                    pending.append(pool.submit(encode_batch, tok, batch, dtype, jsonl, check))
                    while len(pending) >= 2 * threads:
                        write_one()
                while pending:
                    write_one()
            finally:
                for f in pending:
                    f.cancel()
            if writer.documents == 0:
                raise TokenizeError(f"{jsonl}: no documents to tokenize (empty chunk)")
            writer.finalize()
        # self-check before publishing: the index on disk describes what was written
        index = read_index(tmp_idx)
        if (
            len(index.document_indices) != writer.documents + 1
            or int(index.lengths.sum(dtype=np.int64)) != writer.tokens
            or tmp_bin.stat().st_size != writer.tokens * dtype.itemsize
        ):
            raise TokenizeError(f"{prefix}: the written index does not match the tokens written")
        del index
        seconds = time.perf_counter() - t0
        result = {
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
        tmp_stats.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="snakellm tokenize",
        description="Tokenize a jsonl chunk into Megatron's MMIDIDX {prefix}.bin/.idx, with an EOD token "
        "after every document (preprocess_data.py --append-eod), plus {prefix}.stats.json.",
    )
    p.add_argument("input", help="the chunk's .jsonl (one JSON object per line)")
    p.add_argument("prefix", help="output prefix, e.g. data/tokens/gpt2/wikitext/chunk-00000_text_document")
    p.add_argument("--key", default="text", help="JSON key holding the document text (default text)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="encoder threads (default: all cores)")
    p.add_argument("--stats", help="default: {prefix}.stats.json")
    p.add_argument("--batch-mb", type=float, default=1.0, help="MB of json per encoded batch (default 1)")
    p.add_argument("--source", default="", help="source name, recorded in the stats")
    p.add_argument("--chunk", default="", help="chunk name, recorded in the stats")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--verify",
        type=float,
        default=0.005,
        help="fraction of documents whose tiktoken ids are compared with tokenizers' (huggingface kind; default 0.005; "
        "0: none); a difference re-encodes the chunk with tokenizers",
    )
    p.add_argument(
        "--verify-all-mb",
        type=float,
        default=2.0,
        help="compare every document when the chunk is at most this many MB (default 2)",
    )
    tokmod.add_arguments(p)
    a = p.parse_args(argv)
    try:
        tok = tokmod.from_args(a)
        print(f"snakellm tokenize: encoder {tok.backend}: {tok.encoder_reason or tok.kind}", file=sys.stderr)
        st = tokenize_file(
            a.input,
            a.prefix,
            tok,
            key=a.key,
            threads=a.threads,
            stats=a.stats,
            source=a.source,
            chunk=a.chunk,
            batch_bytes=max(1, int(a.batch_mb * 1e6)),
            show_progress=not a.no_progress,
            verify=a.verify,
            verify_all_bytes=int(a.verify_all_mb * 1e6),
        )
    except (tokmod.TokenizerError, TokenizeError, OSError) as e:
        print(f"snakellm tokenize: error: {e}", file=sys.stderr)
        return 1
    print(
        f"{a.prefix}: {st['documents']} documents, {st['tokens']} tokens ({st['dtype']}, "
        f"{st['tokenizer']['name']} via {st['tokenizer']['backend']}) in {st['seconds']} s, "
        f"{st['tokens_per_s'] or 0:,} tokens/s with {st['threads']} threads",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
