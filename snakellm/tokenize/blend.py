"""``snakellm blend``: Megatron's ``data_prefix`` for one tokenizer's token files.

Reads the ``.stats.json`` of every tokenized chunk and writes

``blend.json``
    ``data_prefix``: ``[w1, prefix1, w2, prefix2, ...]`` (Megatron-LM
    ``--data-path``, NeMo ``model.data.data_prefix``), each weight the chunk's
    tokens times its source's ``weight``, normalised to sum to 1; the tokenizer
    (vocab size, EOD id, files, Megatron-LM flags, NeMo tokenizer config) a
    trainer needs; and per-chunk and per-source token counts.
``blend.txt``
    the same list as one line, ``w1 p1 w2 p2 ...``, to paste after ``--data-path``.

All chunks must have been tokenized by the same tokenizer (same files, vocab
size and EOD id), or the blend refuses to mix them.
"""

from __future__ import annotations

import json
from pathlib import Path

from snakellm.errors import DataError
from snakellm.tokenize.encoders import megatron_args, nemo_tokenizer

_SAME = ("kind", "vocab_size", "eod_id", "sha256")


class BlendError(DataError):
    pass


def build_blend(stats_files: list[str], weights: dict[str, float]) -> dict:
    """The blend.json object for the chunks described by ``stats_files``."""
    if not stats_files:
        raise BlendError("no tokenized chunks given")
    datasets = []
    tokenizer = dtype = None
    first = ""
    for path in stats_files:
        try:
            st = json.loads(Path(path).read_text())
            prefix, source, tokens = st["prefix"], st["source"], int(st["tokens"])
        except (OSError, ValueError, KeyError) as e:
            raise BlendError(f"{path}: not a tokenize stats file: {e}") from None
        if source not in weights:
            raise BlendError(f"{path}: source {source!r} has no weight (given: {', '.join(sorted(weights)) or 'none'})")
        if tokenizer is None:
            tokenizer, dtype, first = st["tokenizer"], st["dtype"], path
        else:
            diff = [k for k in _SAME if st["tokenizer"].get(k) != tokenizer.get(k)]
            if diff or st["dtype"] != dtype:
                raise BlendError(
                    f"{path}: tokenized with a different tokenizer than {first} ({', '.join(diff) or 'dtype'} differ)"
                )
        if tokens <= 0 and st.get("documents") == 0:
            continue  # an empty curated chunk (every document removed): nothing to sample
        if tokens <= 0:
            raise BlendError(f"{path}: no tokens")
        datasets.append(
            {
                "prefix": prefix,
                "source": source,
                "chunk": st.get("chunk", ""),
                "documents": st["documents"],
                "tokens": tokens,
            }
        )
    if not datasets:
        raise BlendError(f"no documents in any of the {len(stats_files)} tokenized chunks")
    raw = [d["tokens"] * weights[d["source"]] for d in datasets]
    total = sum(raw)
    for d, r in zip(datasets, raw):
        d["weight"] = r / total
    sources: dict[str, dict] = {}
    for d in datasets:
        s = sources.setdefault(
            d["source"], {"weight": weights[d["source"]], "chunks": 0, "documents": 0, "tokens": 0, "share": 0.0}
        )
        s["chunks"] += 1
        s["documents"] += d["documents"]
        s["tokens"] += d["tokens"]
        s["share"] += d["weight"]
    assert tokenizer is not None
    tok = {**tokenizer, "dtype": dtype, "megatron_args": megatron_args(tokenizer), "nemo": nemo_tokenizer(tokenizer)}
    return {
        "tokenizer": tok,
        "data_prefix": [x for d in datasets for x in (d["weight"], d["prefix"])],
        "datasets": datasets,
        "sources": sources,
        "documents": sum(d["documents"] for d in datasets),
        "tokens": sum(d["tokens"] for d in datasets),
    }


def blend_line(blend: dict) -> str:
    """``w1 p1 w2 p2 ...`` for Megatron-LM ``--data-path``."""
    return " ".join(repr(x) if isinstance(x, float) else str(x) for x in blend["data_prefix"])
