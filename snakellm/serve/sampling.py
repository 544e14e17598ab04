"""Request fields and token log-probabilities shared by the OpenAI and NeMo APIs.

:class:`Fields` reads a JSON request field by field: each value is checked
where it is read, and whatever is left at the end is an unsupported field,
answered with a 400 that names it (never ignored). :func:`score` computes what
``logprobs``/``echo`` return: each token's log-probability given the tokens
before it and the ``k`` most likely tokens at that position, from one forward
pass over prompt + completion (the engine's decoder, fp32 log-softmax of the
real vocabulary, as lm-eval's ``hf`` backend computes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from snakellm.serve.errors import APIError, bad


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


class Fields:
    """A request object read field by field; :meth:`done` rejects the fields nobody read."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise APIError(422, f"the request body must be a JSON object, got {type(body).__name__}")
        self.rest = dict(body)

    def take(self, key: str, default: Any, ok: Callable[[Any], bool], why: str) -> Any:
        """The value of ``key`` (``default`` when missing or null); a 400 naming it when not ``ok``."""
        v = self.rest.pop(key, None)
        if v is None:
            return default
        if not ok(v):
            raise bad(key, f"{key} {why}, got {json.dumps(v)[:200]}")
        return v

    def only(self, key: str, allowed: Callable[[Any], bool], why: str) -> None:
        """A field accepted only with values that change nothing (e.g. ``suffix: ""``)."""
        v = self.rest.pop(key, None)
        if v is not None and not allowed(v):
            raise bad(key, f"{key} is not supported by this server ({why}), got {json.dumps(v)[:200]}")

    def done(self) -> None:
        if self.rest:
            key = sorted(self.rest)[0]
            raise bad(key, f"{key} is not a supported field (unsupported fields are rejected, not ignored)")


@dataclass
class Scored:
    """Per token of a row: its log-probability (None for the first) and the top-k alternatives."""

    ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]  # [] for the first token


def score(gen: Any, rows: Sequence[Sequence[int]], k: int) -> list[Scored]:
    """log p(token_i | tokens_<i) and the ``k`` most likely ids at each position, one row at a time.

    One row per forward keeps the [positions, vocab] log-softmax of one row the largest tensor held.
    """
    import torch

    dec = gen.decoder
    out = []
    for ids in rows:
        t = torch.tensor([list(ids)], dtype=torch.long, device=dec.device)
        n = t.shape[1]
        positions = torch.arange(n, device=dec.device)[None]
        valid = torch.ones(1, n, dtype=torch.bool, device=dec.device)
        with torch.inference_mode():
            logits = dec.forward(t, positions, dec.new_cache(1, n), 0, valid)
            lsm = torch.log_softmax(logits[0, :-1], dim=-1)
            chosen = lsm.gather(-1, t[0, 1:, None])[:, 0].tolist()
            top: list[list[tuple[int, float]]] = [[]]
            if k > 0 and n > 1:
                vals, idx = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
                top += [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                top += [[] for _ in range(n - 1)]
        out.append(Scored(list(ids), [None, *chosen], top))
    return out


_SPECIAL: dict[int, frozenset[int]] = {}


def special_ids(tok: Any) -> frozenset[int]:
    """Ids the OpenAI APIs leave out of returned text, as vLLM's ``skip_special_tokens`` does.

    The end-of-document token; SentencePiece's unk/bos/eos/pad (its decoder spells unk as ``' ⁇ '``,
    transformers' decode drops it); a tokenizer.json's special added tokens.
    """
    key = id(tok)
    if key not in _SPECIAL:
        ids = {int(tok.eod_id)} if tok.eod_id is not None else set()
        if tok.kind == "sentencepiece":
            sp = tok._sp
            ids |= {int(i) for i in (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) if i >= 0}
        elif tok.kind == "huggingface":
            ids |= {int(i) for i, t in tok._tok.get_added_tokens_decoder().items() if t.special}
        _SPECIAL[key] = frozenset(ids)
    return _SPECIAL[key]


def visible(gen: Any, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``prompt``, special tokens left out (what the OpenAI APIs return)."""
    skip = special_ids(gen.tok)
    return str(gen.continuation([t for t in prompt if t not in skip], [t for t in ids if t not in skip]))


def piece(tok: Any, token_id: int) -> str:
    """One token's text as OpenAI's ``tokens`` show it (``' the'``, not ``'Ġthe'``)."""
    return str(tok.decode([int(token_id)]))


def text_offsets(tok: Any, ids: Sequence[int], start: int = 0) -> list[int]:
    """Character offset of each token in the decoded text of ``ids`` (plus ``start``)."""
    return [start + len(tok.decode(list(ids[:i]))) if i else start for i in range(len(ids))]
