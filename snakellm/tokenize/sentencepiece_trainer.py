"""``snakellm train-tokenizer``: train a SentencePiece model on a deterministic sample of chunks.

The equivalent of sentencepiece's ``train_sentencepiece_tokenizer.py
--vocab_size 2000`` on Botchan, but reading our jsonl chunks. The sample is
drawn document by document with a seeded RNG until ``--max-bytes`` of text
(each document kept with probability ``max_bytes / total``), so the same
chunks, settings and seed always give the same sample, and the same model
bytes. Each non-blank line of a kept document is one training sentence, as in
a plain-text corpus file.

Outputs ``{model}``, ``{vocab}`` and a stats file (settings, sample, timing)
appear together and only on success.
"""

from __future__ import annotations

import io
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from snakellm.errors import StepFailed
from snakellm.io.atomic import atomic_group

MODEL_TYPES = ("bpe", "unigram", "char", "word")
# config tokenizers.NAME.train.normalization: what the trainer is told beyond the configured settings.
# preserve: the text survives encode + decode (newlines, tabs and runs of spaces kept; a character outside the
# vocabulary as its UTF-8 bytes), as Llama 2's and Gemma's models are trained; sentencepiece: its own defaults,
# which NFKC-normalize and squeeze whitespace, so "a\n\nb" comes back "a b".
NORMALIZATIONS: dict[str, dict[str, Any]] = {
    "preserve": {
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "allow_whitespace_only_pieces": True,
        "split_digits": True,
        "byte_fallback": True,
    },
    "sentencepiece": {"byte_fallback": False},
}


class TrainError(StepFailed, ValueError):
    pass


def _documents(path: str, key: str) -> Iterator[str]:
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise TrainError(f"{path}:{lineno}: invalid JSON: {e}") from None
            text = obj.get(key) if type(obj) is dict else None
            if type(text) is not str:
                raise TrainError(f"{path}:{lineno}: no string under key {key!r}")
            yield text


def sample_sentences(inputs: list[tuple[str, str]], max_bytes: int, seed: int) -> tuple[list[str], dict]:
    """Sentences (non-blank lines) of a seeded document sample of at most ~``max_bytes`` of text."""
    sizes = {}
    for path, _ in inputs:
        if not os.path.isfile(path):
            raise TrainError(f"{path}: input not found")
        sizes[path] = os.path.getsize(path)
    total = sum(sizes.values())
    if total == 0:
        raise TrainError(f"{', '.join(p for p, _ in inputs)}: no text to train on (empty inputs)")
    # json bytes >= text bytes, so this keeps slightly fewer than max_bytes on average
    keep = 1.0 if max_bytes <= 0 or total <= max_bytes else max_bytes / total
    rng = random.Random(seed)
    sentences: list[str] = []
    per_input = []
    nbytes = 0
    for path, key in inputs:
        docs = kept = 0
        for text in _documents(path, key):
            docs += 1
            if keep < 1.0 and rng.random() >= keep:
                continue
            kept += 1
            for line in text.split("\n"):
                if line.strip():
                    sentences.append(line)
                    nbytes += len(line.encode("utf-8"))
        per_input.append({"input": path, "key": key, "documents": docs, "sampled": kept})
    if not sentences:
        raise TrainError(f"{', '.join(p for p, _ in inputs)}: the sample has no text to train on")
    return sentences, {"inputs": per_input, "sentences": len(sentences), "bytes": nbytes, "keep_probability": keep}


def train_sentencepiece(
    inputs: list[tuple[str, str]],
    model: str,
    vocab: str,
    stats: str,
    *,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    normalization: str = "preserve",
    byte_fallback: bool | None = None,
    user_defined_symbols: list[str] | None = None,
    max_sentence_length: int = 16384,
    max_bytes: int = 100_000_000,
    seed: int = 0,
    threads: int = 1,
    options: dict[str, str] | None = None,
) -> dict:
    import sentencepiece as spm

    t0 = time.perf_counter()
    sentences, sample = sample_sentences(inputs, max_bytes, seed)
    if normalization not in NORMALIZATIONS:
        raise TrainError(f"{model}: normalization {normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "model_type": model_type,
        "character_coverage": character_coverage,
        **NORMALIZATIONS[normalization],
        "byte_fallback": NORMALIZATIONS[normalization]["byte_fallback"] if byte_fallback is None else byte_fallback,
        "user_defined_symbols": list(user_defined_symbols or []),
        "max_sentence_length": max_sentence_length,
        **(options or {}),
    }
    model_p, vocab_p, stats_p = Path(model), Path(vocab), Path(stats)
    proto = io.BytesIO()
    try:
        # model_writer, not model_prefix: the proto records its prefix, and a temp path would
        # make equal trainings give different bytes
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=proto,
            num_threads=max(1, threads),
            input_sentence_size=0,  # sampled already: use every sentence, no shuffling inside
            minloglevel=1,
            **settings,
        )
    except RuntimeError as e:
        raise TrainError(f"{model}: SentencePiece training failed: {e}") from None
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    if sp.vocab_size() != vocab_size:
        raise TrainError(f"{model}: trained {sp.vocab_size()} pieces, not the configured {vocab_size}")
    seconds = time.perf_counter() - t0
    result = {
        "model": str(model),
        "settings": settings,
        "threads": max(1, threads),
        "seed": seed,
        "max_bytes": max_bytes,
        "sample": sample,
        "vocab_size": sp.vocab_size(),
        "eos_id": sp.eos_id(),
        "bos_id": sp.bos_id(),
        "unk_id": sp.unk_id(),
        "pad_id": sp.pad_id(),
        "seconds": round(seconds, 3),
    }
    with atomic_group(vocab_p, model_p, stats_p) as (tv, tm, ts):
        tv.write_text(vocab_text(sp), encoding="utf-8")
        tm.write_bytes(proto.getvalue())
        ts.write_text(json.dumps(result, indent=2) + "\n")
    return result


def vocab_text(sp) -> str:
    """The ``.vocab`` file SentencePiece writes: ``piece<TAB>score`` per line (C++ ostream float)."""
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))
