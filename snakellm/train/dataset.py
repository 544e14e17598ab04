"""Training data: Megatron's ``GPTDataset`` over a tokenizer's ``blend.json``.

``blend.json`` (written by ``snakellm blend``) holds Megatron's
``data_prefix`` list ``[w1, prefix1, w2, prefix2, ...]`` with prefixes relative
to the workflow's working directory, and the tokenizer's ``vocab_size`` and
``eod_id``. :func:`read_blend` only reads JSON and checks that every
``.bin/.idx`` pair exists, so it runs before torch is imported.

Sample order is Megatron-LM's: sample ``i`` of the run is the ``i``-th index of
the blended training dataset (shuffled by seed when the index is built), and
iteration ``s`` uses samples ``[s * GBS, (s + 1) * GBS)``, cut into
micro-batches of ``MBS x DP`` and then per data-parallel rank. The position in
the data is therefore the iteration alone: resuming at iteration ``s`` (even at
a different data-parallel size) continues with exactly the samples an
uninterrupted run would have used.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from snakellm import errors


class DataError(errors.DataError):
    pass


@dataclass(frozen=True)
class Blend:
    path: str
    prefixes: list[str]
    weights: list[float]
    tokenizer: dict
    vocab_size: int
    eod_id: int

    def fingerprint_items(self) -> dict:
        """What about the data determines the training trajectory."""
        return {
            "prefixes": self.prefixes,
            "weights": self.weights,
            "tokenizer": {k: self.tokenizer.get(k) for k in ("name", "kind", "vocab_size", "eod_id")},
        }


def read_blend(path: str | os.PathLike) -> Blend:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"blend file not found: {path}")
    try:
        obj = json.loads(p.read_text())
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON: {e}") from None
    dp = obj.get("data_prefix")
    if not isinstance(dp, list) or not dp or len(dp) % 2:
        raise DataError(f"{path}: 'data_prefix' must be a non-empty list [weight, prefix, weight, prefix, ...]")
    weights, prefixes = dp[0::2], dp[1::2]
    for w, pre in zip(weights, prefixes):
        if not isinstance(w, (int, float)) or isinstance(w, bool) or w <= 0:
            raise DataError(f"{path}: weight {w!r} for {pre!r} must be a positive number")
        if not isinstance(pre, str):
            raise DataError(f"{path}: prefix {pre!r} must be a string")
        for ext in (".bin", ".idx"):
            if not os.path.isfile(pre + ext):
                raise DataError(f"{path}: token file {pre + ext} not found (paths are relative to {os.getcwd()})")
    tok = obj.get("tokenizer") or {}
    try:
        vocab, eod = int(tok["vocab_size"]), int(tok["eod_id"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{path}: 'tokenizer' must give integer 'vocab_size' and 'eod_id'") from None
    return Blend(str(path), list(prefixes), [float(w) for w in weights], dict(tok), vocab, eod)


def document_count(prefix: str) -> int:
    """Documents in an MMIDIDX index, from its header alone (magic, version, dtype, sequences, documents + 1)."""
    with open(prefix + ".idx", "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != b"MMIDIDX\x00\x00":
        raise DataError(f"{prefix}.idx is not a Megatron MMIDIDX index")
    return struct.unpack("<Q", head[26:34])[0] - 1


def split_shares(split: str) -> list[float]:
    try:
        parts = [float(x) for x in split.split(",")]
    except ValueError:
        raise DataError(f"split {split!r}: expected up to three numbers, e.g. 969,30,1") from None
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or any(x < 0 for x in parts) or sum(parts) <= 0:
        raise DataError(f"split {split!r}: expected up to three non-negative numbers with a positive sum")
    return [x / sum(parts) for x in parts]


def split_ranges(split: str, n_docs: int) -> list[tuple[int, int]]:
    """Megatron's document ranges [begin, end) of train, valid and test for a file of ``n_docs`` documents."""
    shares = split_shares(split)
    bounds = [0.0]
    for x in shares:
        bounds.append(bounds[-1] + x)
    return [(int(round(bounds[i] * n_docs)), int(round(bounds[i + 1] * n_docs))) for i in range(3)]


def check_splits(blend: Blend, split: str, need_valid: bool) -> None:
    """Every token file needs documents in the training split (and the validation split, if used).

    megatron-core loops forever building an index over an empty split, so this
    is checked up front, with the numbers.
    """
    for pre in blend.prefixes:
        n = document_count(pre)
        (tb, te), (vb, ve), _ = split_ranges(split, n)
        if te <= tb:
            raise DataError(f"{pre}: {n} documents leave none for training with split {split!r}")
        if need_valid and ve <= vb:
            raise DataError(
                f"{pre}: {n} documents leave none for validation with split {split!r} (Megatron takes documents "
                f"{vb}..{ve}); give validation a larger share (e.g. 90,10,0) or set eval_iters: 0"
            )


class _Tokenizer:
    """What GPTDataset asks of a tokenizer: the vocabulary size and the end-of-document id."""

    def __init__(self, vocab_size: int, eod: int, data: list[list[int]] | None = None):
        self.vocab_size = vocab_size
        self.eod = eod
        # part of the dataset's description, hence of its index cache's file names; ``data`` (the token
        # files' sizes and mtimes) makes a rebuilt .bin/.idx under the same prefix get a new index cache
        self.unique_identifiers = {"class": "snakellm", "vocab_size": vocab_size, "eod": eod, "data": data or []}


def _token_files_identity(prefixes: list[str]) -> list[list[int]]:
    """Size and mtime_ns of every prefix's .bin and .idx: Megatron names its index cache by the dataset's
    description (paths, split, seed, ...), not by the files' contents, so a token file rebuilt in place
    (one more document in a shard) would otherwise reuse sample indices computed for the old file."""
    out = []
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            st = os.stat(prefix + ext)
            out.append([st.st_size, st.st_mtime_ns])
    return out


def build_datasets(
    blend: Blend, *, seq_length: int, seed: int, split: str, train_samples: int, valid_samples: int, cache_dir: str
):
    """(train, valid) GPTDatasets (valid may be None). Must be called on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    os.makedirs(cache_dir, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(blend.prefixes, blend.weights if len(blend.prefixes) > 1 else None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=_Tokenizer(blend.vocab_size, blend.eod_id, _token_files_identity(list(blend.prefixes))),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    # We never evaluate on the test split: skip building its index (the train/valid
    # document boundaries stay exactly Megatron-LM's for this split string).
    config.split_matrix[2] = None
    # Blended splits need a size each (Megatron-LM asks for eval_iters x GBS for valid and test too);
    # an unused split's index is small and cheap.
    sizes = [train_samples, max(valid_samples, 1), max(valid_samples, 1)]
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    if train is None or len(train) == 0:
        raise DataError(f"{blend.path}: the training split is empty (split {split!r}, sequence length {seq_length})")
    if valid_samples and (valid is None or len(valid) == 0):
        raise DataError(
            f"{blend.path}: the validation split is empty (split {split!r}); give it a share of the documents "
            "or set eval_iters: 0"
        )
    return train, (valid if valid_samples else None)


def sample_indices(iteration: int, micro: int, *, gbs: int, mbs: int, dp_rank: int, dp_size: int) -> list[int]:
    """Global sample indices of one micro-batch (``iteration`` counts from 0)."""
    base = iteration * gbs + micro * mbs * dp_size + dp_rank * mbs
    return list(range(base, base + mbs))


class _BatchSampler:
    """Yields the index lists of every micro-batch from ``start_iter`` to ``end_iter``, in order."""

    def __init__(self, start_iter: int, end_iter: int, *, gbs: int, mbs: int, dp_rank: int, dp_size: int, limit: int):
        self.args = (start_iter, end_iter, gbs, mbs, dp_rank, dp_size)
        self.limit = limit

    def __iter__(self) -> Iterator[list[int]]:
        start, end, gbs, mbs, r, dp = self.args
        micros = gbs // (mbs * dp)
        for it in range(start, end):
            for m in range(micros):
                idx = sample_indices(it, m, gbs=gbs, mbs=mbs, dp_rank=r, dp_size=dp)
                if idx[-1] >= self.limit:
                    raise DataError(f"sample {idx[-1]} is past the dataset's {self.limit} samples")
                yield idx

    def __len__(self) -> int:
        start, end, gbs, mbs, r, dp = self.args
        return (end - start) * (gbs // (mbs * dp))


def micro_batches(
    dataset,
    start_iter: int,
    end_iter: int,
    *,
    gbs: int,
    mbs: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
):
    """An iterator over the micro-batches (dicts of stacked tensors) of iterations [start_iter, end_iter)."""
    import torch

    sampler = _BatchSampler(
        start_iter, end_iter, gbs=gbs, mbs=mbs, dp_rank=dp_rank, dp_size=dp_size, limit=len(dataset)
    )
    return iter(
        torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=False,
            prefetch_factor=4 if num_workers else None,
            # its own generator: worker seeding must not draw from the global RNG (exact resume)
            generator=torch.Generator().manual_seed(0),
        )
    )
