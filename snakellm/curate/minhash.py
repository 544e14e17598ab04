"""MinHash signatures and LSH band keys of documents, batch-vectorised.

A document's text is normalised with datatrove's own ``simplify_text`` (lower case, numbers
to 0, punctuation removed, diacritics folded, whitespace collapsed: exactly what datatrove's
MinHash stage hashes), split into words at the single spaces that leaves, and shingled into
``ngram``-word windows. Shingles are hashed over a whole batch at once (xxh3 of each word, the
window's words mixed in numpy and finalised with splitmix64), and the
MinHash itself (``bands * rows`` permutations, 32-bit values) is rensa's, in Rust
(:func:`minhash_rensa`). The ``datatrove`` and ``datasketch`` backends compute the same
signature from the same shingle hashes with those libraries' permutations: the benchmark
(scripts/bench_curate.py) compares the three and the documents' choice is measured there.

Each band's ``rows`` values are folded into one 64-bit key (:func:`band_keys`); two
documents are candidates when any band's keys are equal. A document with no words has no
signature (key 0 in every band). A document shorter than ``ngram`` words is one shingle.

The ``datatrove`` scheme (``near.scheme``) computes datatrove 0.10's own signatures instead
(:func:`datatrove_shingles`, :func:`datatrove_signatures`): its ``simplify_text``, words split at
whitespace, its ``ngrams``, its 64-bit xxhash of each n-gram's words joined by a space, its
``(a*x + b) mod 2**61-1`` permutations, 64-bit values kept whole; a document shorter than
``ngram`` words has no signature, as in datatrove. tests/test_curate_datatrove.py checks them
against datatrove's ``MinhashDedupSignature`` value for value.
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_LEN_K = np.uint64(0x9E3779B97F4A7C15)
# per-position multipliers of a window's word hashes (odd, fixed: signatures are stable across versions)
_WIN = np.array([(0x9E3779B97F4A7C15 * (2 * i + 1)) & 0xFFFFFFFFFFFFFFFF | 1 for i in range(64)], dtype=np.uint64)
BACKENDS = ("rensa", "datatrove", "datasketch")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@functools.cache
def _patterns() -> tuple[Any, Any, Any, bytes, Any]:
    import regex
    from datatrove.utils.text import NUMBERS_PATTERN, PUNCTUATION

    ascii_punct = bytes(sorted({ord(c) for c in PUNCTUATION if ord(c) < 128}))
    table = bytes.maketrans(ascii_punct, b" " * len(ascii_punct))
    return (
        NUMBERS_PATTERN,
        re.compile("[" + re.escape(PUNCTUATION) + r"\s]+"),
        regex.compile(r"\p{Mn}+"),
        table,
        re.compile(rb"[0-9]+(?:[.,][0-9]+)?"),
    )


def simplify(text: str) -> str:
    """datatrove's MinHash normalisation (``datatrove.utils.text.simplify_text``, default TextNormConfig), faster.

    The same steps in the same order with datatrove's own number pattern and punctuation set;
    punctuation-to-space and whitespace collapsing in one regex pass, and the diacritics step
    (NFD, then drop combining marks) skipped for ASCII text, where it changes nothing.
    tests/test_curate.py checks the output equals datatrove's on the shipped corpus.
    """
    if text.isascii():
        return simplify_bytes(text).decode("ascii")
    numbers, punct_space, marks, _, _ = _patterns()
    text = punct_space.sub(" ", numbers.sub("0", text.lower())).strip()
    return marks.sub("", unicodedata.normalize("NFD", text)).strip()


def simplify_bytes(text: str) -> bytes:
    """:func:`simplify` as UTF-8 bytes; ASCII text takes a bytes-only path (a translate table, ASCII digits)
    that gives the same result 10x faster."""
    if not text.isascii():
        return simplify(text).encode("utf-8", "surrogatepass")
    _, _, _, table, digits = _patterns()
    raw = digits.sub(b"0", text.encode("ascii").lower()).translate(table)
    return b" ".join(raw.split())


def exact_hash(text: str) -> int:
    """64-bit hash of the exact-duplicate normal form: Unicode NFC, whitespace runs as one space, stripped.

    Never 0 (0 marks "no hash" in signature files).
    """
    h = xxhash.xxh3_64_intdigest(" ".join(unicodedata.normalize("NFC", text).split()).encode("utf-8", "surrogatepass"))
    return h or 1


def shingle_hashes(simplified: Sequence[str | bytes], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat uint64 shingle hashes, row offsets [len+1]) of already simplified texts.

    Words are the space-separated runs of each text, each hashed with xxh3; a window's words
    are mixed (a multiplier per position) and finalised with splitmix64, in numpy over the whole
    batch. A window of ``ngram`` words never crosses two texts; a text of 1..ngram-1 words is one
    shingle of all its words; an empty one has none.
    """
    if ngram < 1 or ngram > len(_WIN):
        raise ValueError(f"ngram must be 1..{len(_WIN)}, got {ngram}")
    n = len(simplified)
    split = [(t if isinstance(t, bytes) else t.encode("utf-8", "surrogatepass")).split(b" ") for t in simplified]
    split = [ws if ws[0] else [] for ws in split]  # simplified: single spaces, stripped; only "" has an empty word
    counts = np.fromiter(map(len, split), dtype=np.int64, count=n)
    words = np.fromiter(
        map(xxhash.xxh3_64_intdigest, itertools.chain.from_iterable(split)), dtype=np.uint64, count=int(counts.sum())
    )
    doc_of_word = np.repeat(np.arange(n), counts)
    with np.errstate(over="ignore"):
        m = len(words) - ngram + 1
        if m > 0:
            acc = np.zeros(m, dtype=np.uint64)
            for k in range(ngram):
                acc += words[k : k + m] * _WIN[k]
            valid = doc_of_word[:m] == doc_of_word[ngram - 1 :]
            grams, gram_doc = splitmix64(acc[valid]), doc_of_word[:m][valid]
        else:
            grams, gram_doc = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
        short = np.flatnonzero((counts > 0) & (counts < ngram))
        if len(short):
            first = np.concatenate([[0], np.cumsum(counts)])
            extra = np.array(
                [
                    splitmix64(
                        (words[first[d] : first[d + 1]] * _WIN[: counts[d]]).sum(dtype=np.uint64, keepdims=True)
                    )[0]
                    for d in short
                ],
                dtype=np.uint64,
            )
            grams = np.concatenate([grams, extra])
            gram_doc = np.concatenate([gram_doc, short])
            order = np.argsort(gram_doc, kind="stable")
            grams, gram_doc = grams[order], gram_doc[order]
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(gram_doc, minlength=n))
    return grams, offsets


def minhash_rensa(grams: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """[docs, num_perm] uint32 MinHash values (rensa's RMinHash over the shingle hashes)."""
    import rensa

    if len(offsets) <= 1:
        return np.zeros((0, num_perm), dtype=np.uint32)
    m = rensa.RMinHash.digest_matrix_from_flat_token_hashes(grams, offsets.astype(np.uint64), num_perm, seed)
    return np.array(m.to_rows(), dtype=np.uint32).reshape(len(offsets) - 1, num_perm)


def minhash_datatrove(grams: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """The same with datatrove's permutations ((a*x + b) mod 2**61-1, numpy seeded as its MinhashConfig)."""
    prime = np.uint64((1 << 61) - 1)
    gen = np.random.RandomState(seed)
    a = gen.randint(1, prime, dtype=np.uint64, size=(1, num_perm))
    b = gen.randint(0, prime, dtype=np.uint64, size=(1, num_perm))
    out = np.zeros((len(offsets) - 1, num_perm), dtype=np.uint32)
    with np.errstate(over="ignore"):
        for i in range(len(offsets) - 1):
            sh = grams[offsets[i] : offsets[i + 1]].reshape(-1, 1)
            if len(sh):
                out[i] = (np.min((sh * a + b) % prime, axis=0) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return out


def minhash_datasketch(grams: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """The same with datasketch's MinHash (its hashfunc: the shingle hash itself)."""
    from datasketch import MinHash

    out = np.zeros((len(offsets) - 1, num_perm), dtype=np.uint32)
    proto = MinHash(num_perm=num_perm, seed=seed, hashfunc=int, scheme="affine64")
    for i in range(len(offsets) - 1):
        sh = grams[offsets[i] : offsets[i + 1]]
        if len(sh):
            m = MinHash(
                num_perm=num_perm, seed=seed, hashfunc=int, permutations=proto.permutations, scheme=proto.scheme
            )
            m.update_batch(sh.tolist())
            out[i] = (m.hashvalues & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return out


DT_PRIME = np.uint64((1 << 61) - 1)  # datatrove's _mersenne_prime


def datatrove_shingles(texts: Sequence[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat uint64 shingle hashes, row offsets [len+1]) of raw texts, as datatrove's
    ``MinhashDedupSignature.get_shingles`` computes them with a whitespace word tokenizer.

    datatrove's own helpers: ``simplify_text`` (default TextNormConfig), ``ngrams`` and the hash
    function of its default ``HashConfig`` (64-bit xxhash) over each n-gram's words joined by one
    space as UTF-8 (datatrove hashes the str, which xxhash < 4 encodes as UTF-8; xxhash 4 takes bytes).
    ASCII text is simplified by :func:`simplify_bytes` instead: the same output (for ASCII, datatrove's
    number pattern is ``[0-9]+``, its punctuation a byte table, and there are no diacritics), without
    ``simplify_text``'s per-character diacritics loop, which took half of this function's time.
    The words are ``str.split()``'s of the simplified text (snakellm.curate.filters.split_tokenizer,
    the tokenizer the benchmark gives datatrove: its English default needs a spaCy model).
    """
    # MinhashConfig's defaults, without importing datatrove.pipeline.dedup (its package pulls in
    # huggingface_hub: seconds in every signature worker)
    from datatrove.utils.hashing import HashConfig, create_hash_func
    from datatrove.utils.text import TextNormConfig, ngrams, simplify_text

    norm = TextNormConfig()
    hash_fn = create_hash_func(HashConfig(), bytes)
    out: list[int] = []
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    for i, text in enumerate(texts):
        if text.isascii():
            words = simplify_bytes(text).split()
        else:
            words = simplify_text(text, norm).encode("utf-8", "surrogatepass").split()
        out += [hash_fn(b" ".join(g)) for g in ngrams(words, ngram)]
        offsets[i + 1] = len(out)
    return np.array(out, dtype=np.uint64), offsets


def datatrove_parameters(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of datatrove's permutations: ``MinhashDedupSignature.parameters`` (numpy RandomState(seed))."""
    gen = np.random.RandomState(seed)
    a = gen.randint(1, DT_PRIME, dtype=np.uint64, size=(1, num_perm))
    b = gen.randint(0, DT_PRIME, dtype=np.uint64, size=(1, num_perm))
    return a, b


def datatrove_signatures(grams: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """[docs, num_perm] uint64: datatrove's ``get_signature`` (min over shingles of ``(x*a + b) % (2**61-1)``,
    uint64 arithmetic wrapping as numpy's does in datatrove), batched; 0 for a document without shingles."""
    a, b = datatrove_parameters(num_perm, seed)
    n = len(offsets) - 1
    out = np.zeros((n, num_perm), dtype=np.uint64)
    block = max(1, (1 << 16) // max(1, num_perm))  # shingles a step: ~0.5 MiB of uint64
    i = 0
    with np.errstate(over="ignore"):
        while i < n:
            j = max(i + 1, int(np.searchsorted(offsets, offsets[i] + block, side="right")) - 1)
            j = min(j, n)
            lo, hi = int(offsets[i]), int(offsets[j])
            if hi > lo:
                phv = grams[lo:hi].reshape(-1, 1) * a  # in place from here: no temporaries
                phv += b
                phv %= DT_PRIME
                starts = offsets[i:j] - lo
                has = np.diff(offsets[i : j + 1]) > 0
                out[i:j][has] = np.minimum.reduceat(phv, starts[has], axis=0)
            i = j
    return out


def band_keys(values: np.ndarray, bands: int, rows: int, empty: np.ndarray) -> np.ndarray:
    """[bands, docs] uint64 keys: each band's ``rows`` values folded into one (0 where ``empty``)."""
    n = values.shape[0]
    v = values[:, : bands * rows].astype(np.uint64).reshape(n, bands, rows)
    with np.errstate(over="ignore"):
        acc = np.zeros((n, bands), dtype=np.uint64)
        for k in range(rows):
            acc += v[:, :, k] * _WIN[k]
        keys = splitmix64(acc + np.arange(bands, dtype=np.uint64) * _LEN_K).T.copy()
    keys[keys == 0] = 1
    keys[:, empty] = 0
    return keys


def signatures(
    texts: Sequence[str], ngram: int, bands: int, rows: int, seed: int = 1, backend: str = "rensa"
) -> np.ndarray:
    """[bands, docs] uint64 LSH band keys of raw texts (0: no words, no signature)."""
    grams, offsets = shingle_hashes([simplify_bytes(t) for t in texts], ngram)
    fn = {"rensa": minhash_rensa, "datatrove": minhash_datatrove, "datasketch": minhash_datasketch}[backend]
    values = fn(grams, offsets, bands * rows, seed)
    return band_keys(values, bands, rows, np.diff(offsets) == 0)


def lsh_probability(similarity: float, bands: int, rows: int) -> float:
    """Chance that two documents of this Jaccard similarity share at least one band."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def threshold_of(bands: int, rows: int) -> float:
    """The similarity where the LSH S-curve is steepest, about (1/bands)**(1/rows)."""
    return (1.0 / bands) ** (1.0 / rows)
