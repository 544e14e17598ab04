"""Per-chunk signatures and filter verdicts: the first curation job of each chunk.

Reads ``data/jsonl/{source}/{chunk}.jsonl`` once and writes two files:

* ``{out}.npy``: uint32 ``[3 + bands*rows, documents]``, one column a document: row 0 its
  verdict (0: passes every filter, i: failed rule ``rules[i-1]``), rows 1-2 the low and high
  halves of its exact-duplicate hash (0: exact dedup off), rows 3... its MinHash values
  (absent when near dedup is off; with ``near.scheme: datatrove`` each value is 64-bit, two
  rows: low and high half). Band-major, so a bucket job reads only its bands' rows.
* ``{out}.json``: the rules, per-rule counts, languages seen, the rejected documents'
  language and confidence, and the settings that made the file (the index checks them).

Documents run through the filters and the hashing in batches, in ``threads`` processes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson

from snakellm.curate import filters as filtmod
from snakellm.curate import minhash
from snakellm.errors import DataError
from snakellm.io.atomic import atomic_path, write_json
from snakellm.io.progress import progress

BATCH = 512
POOL_MIN_BYTES = 8 << 20
HEADER_ROWS = 3  # verdict, exact hash low, exact hash high

_JUDGE: Any = None
_CFG: dict[str, Any] = {}


def near_settings(curate: dict[str, Any]) -> dict[str, Any] | None:
    """The ``near`` section with defaults filled (None: off)."""
    from snakellm.config import sections as S
    from snakellm.config.settings import defaults

    near = curate.get("near")
    return None if near is None else {**defaults(S.NearDupSettings), **near}


def is_datatrove(near: dict[str, Any] | None) -> bool:
    """Whether these near settings use datatrove's scheme (64-bit values, datatrove's kept document)."""
    return near is not None and near.get("scheme", "snakellm") == "datatrove"


def value_rows(near: dict[str, Any] | None) -> int:
    """The matrix's MinHash rows: ``bands * rows`` values, two uint32 rows each in datatrove's scheme."""
    if not near:
        return 0
    return near["bands"] * near["rows"] * (2 if is_datatrove(near) else 1)


def _init(curate: dict[str, Any]) -> None:
    global _JUDGE, _CFG
    _JUDGE = filtmod.build(curate)
    _CFG = curate


def _batch(texts: list[str]) -> tuple[np.ndarray, list[tuple[str | None, str | None, float]]]:
    """(the batch's [rows, n] signature block, the verdicts) in a worker."""
    curate, judge = _CFG, _JUDGE
    near = near_settings(curate)
    perm = near["bands"] * near["rows"] if near else 0
    block = np.zeros((HEADER_ROWS + value_rows(near), len(texts)), dtype=np.uint32)
    verdicts = [judge.verdict(t) for t in texts]
    if curate.get("exact", True):
        h = np.array([minhash.exact_hash(t) for t in texts], dtype=np.uint64)
        block[1], block[2] = (h & np.uint64(0xFFFFFFFF)).astype(np.uint32), (h >> np.uint64(32)).astype(np.uint32)
    if near and is_datatrove(near):
        grams, offsets = minhash.datatrove_shingles(texts, near["ngram"])
        wide = minhash.datatrove_signatures(grams, offsets, perm, near["seed"])  # 0 where no shingles
        block[HEADER_ROWS:] = wide.view(np.uint32).T  # each value's low, then high half (little-endian)
    elif near:
        grams, offsets = minhash.shingle_hashes([minhash.simplify_bytes(t) for t in texts], near["ngram"])
        values = minhash.minhash_rensa(grams, offsets, perm, near["seed"])
        values[np.diff(offsets) == 0] = 0  # no words: no signature (all-zero values never form a band key)
        block[HEADER_ROWS:] = values.T
    return block, verdicts


def read_texts(path: str, key: str) -> Iterator[list[str]]:
    """Batches of the chunk's texts, in line order (a chunk line is valid JSON with a string ``key``)."""
    batch: list[str] = []
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                text = orjson.loads(line)[key]
            except (orjson.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path} line {lineno}: not a chunk document with a string {key!r} ({e})") from None
            if not isinstance(text, str):
                raise DataError(f"{path} line {lineno}: {key!r} is not a string")
            batch.append(text)
            if len(batch) == BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def compute(
    chunk_jsonl: str,
    out_npy: str,
    out_json: str,
    curate: dict[str, Any],
    *,
    key: str = "text",
    source: str = "",
    chunk: str = "",
    threads: int = 1,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Write the chunk's signature file and its summary; return the summary."""
    judge = filtmod.build(curate)  # fails here, not in a worker, on a bad setting
    code: dict[str, int] = {}  # full rule name -> its verdict code, in the order first met
    by_rule: Counter[str] = Counter()
    languages: Counter[str] = Counter()
    rejected_language: dict[str, list[Any]] = {}
    n = 0
    near = near_settings(curate)
    rows = HEADER_ROWS + value_rows(near)
    rejected = 0
    raw_path = f"{out_npy}.raw.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out_npy)), exist_ok=True)
    batches = read_texts(chunk_jsonl, key)
    # worker processes pay for themselves on a chunk of a few batches or more, not on the shipped corpus's
    big = os.path.getsize(chunk_jsonl) > POOL_MIN_BYTES
    pool = multiprocessing.get_context("fork").Pool(threads, _init, (curate,)) if threads > 1 and big else None
    if pool is None:
        _init(curate)
    raw = open(raw_path, "wb")  # opened where the try below removes it on any failure (a missing chunk: no leftover)
    try:
        results = pool.imap(_batch, batches) if pool else map(_batch, batches)
        with progress(show_progress, desc=f"signatures {source}/{chunk}", unit="doc") as bar:
            for block, verdicts in results:
                for i, (rule, lang, score) in enumerate(verdicts):
                    if lang is not None:
                        languages[lang] += 1
                    if rule is None:
                        continue
                    by_rule[rule] += 1
                    block[0, i] = code.setdefault(rule, len(code) + 1)
                    if rule == filtmod.LANGUAGE_RULE:
                        rejected_language[str(n + i)] = [lang, round(score, 4)]
                raw.write(np.ascontiguousarray(block.T).tobytes())  # document-major while streaming
                rejected += int((block[0] != 0).sum())
                n += block.shape[1]
                bar.update(block.shape[1])
    except BaseException:
        raw.close()
        os.unlink(raw_path)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    raw.close()
    try:
        _transpose(raw_path, out_npy, n, rows)
    finally:
        os.unlink(raw_path)
    summary = {
        "source": source,
        "chunk": chunk,
        "documents": n,
        "filters": judge.rules(),
        "rules": list(code),  # verdict code i is rules[i - 1]
        "rejected": rejected,
        "rejected_by_rule": dict(sorted(by_rule.items())),
        "languages": dict(languages.most_common()),
        "rejected_language": rejected_language,
        "exact": bool(curate.get("exact", True)),
        "near": near,
    }
    write_json(out_json, summary, indent=None)
    return summary


def _transpose(raw_path: str, out_npy: str, n: int, rows: int, step: int = 1 << 16) -> None:
    """The streamed document-major matrix as the band-major .npy, ``step`` documents at a time (bounded memory)."""
    src = np.memmap(raw_path, dtype=np.uint32, mode="r", shape=(n, rows)) if n else np.zeros((0, rows), np.uint32)
    with atomic_path(out_npy) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint32, shape=(rows, n))
        for i in range(0, n, step):
            out[:, i : i + step] = src[i : i + step].T
        out.flush()
        del out


def load(npy: str, mmap: bool = True) -> np.ndarray:
    """A signature file's [rows, documents] matrix (memory-mapped by default)."""
    return np.load(npy, mmap_mode="r" if mmap else None)


def exact_hashes(sig: np.ndarray) -> np.ndarray:
    return sig[1].astype(np.uint64) | (sig[2].astype(np.uint64) << np.uint64(32))


def doc_rules_path(npy: str) -> str:
    return os.path.splitext(npy)[0] + ".json"
