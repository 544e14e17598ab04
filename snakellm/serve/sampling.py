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
    """One token alone as OpenAI's ``top_logprobs`` keys show an alternative (``' the'``, not ``'Ġthe'``).

    Decoded after a context token, so SentencePiece's leading space stays (``decode`` of one piece drops it);
    a token that is not whole characters is ``bytes:\\xNN...``, as OpenAI shows it.
    """
    return token_texts(tok, [_context_id(tok), int(token_id)], 1, 2)[0]


# tokens of context before each token in token_texts: enough for any character's bytes (4) and a word's
# decoder state (SentencePiece drops one leading space of what it decodes, whatever comes first)
_WINDOW = 8
_BYTE_PIECE = __import__("re").compile(r"<0x([0-9A-Fa-f]{2})>")


def _context_id(tok: Any) -> int:
    """A token that decodes to a plain letter: what a lone token is decoded after (see piece)."""
    key = ("ctx", id(tok))
    if key not in _CONTEXT:
        ids = tok.encode_batch(["a"])[0]
        _CONTEXT[key] = int(ids[-1])
    return _CONTEXT[key]


_CONTEXT: dict[tuple[str, int], int] = {}


def token_bytes(tok: Any, token_id: int) -> bytes:
    """The bytes one token stands for (GPT-2's byte-level symbols mapped back, SentencePiece's ``▁`` a space,
    a byte-fallback piece ``<0xNN>`` its byte)."""
    from snakellm.serve.generate import token_strings
    from snakellm.tokenize.encoders import bytes_to_unicode

    if tok.kind == "gpt2-bpe" and tok.backend == "tiktoken":
        return bytes(tok._enc.decode_single_token_bytes(int(token_id)))
    (text,) = token_strings(tok, [int(token_id)])
    m = _BYTE_PIECE.fullmatch(text)
    if m:
        return bytes([int(m.group(1), 16)])
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    if tok.kind != "sentencepiece" and "▁" not in text and text and all(ch in u2b for ch in text):
        return bytes(u2b[ch] for ch in text)
    return text.replace("▁", " ").encode("utf-8")


def token_texts(tok: Any, ids: Sequence[int], lo: int = 0, hi: int | None = None) -> list[str]:
    """The text each of ``ids[lo:hi]`` adds to the decoded text, as OpenAI's and vLLM's ``tokens`` spell it.

    They concatenate to the text (a word's leading space kept: ``' upon'``, not SentencePiece's
    ``'upon'``): each is what decoding the token after the tokens before it adds (a few tokens of context,
    as vLLM's incremental detokenizer does). A token that ends or starts inside a character (a byte of a
    multi-byte character) is shown as OpenAI shows it: ``bytes:\\xe2\\x80``.
    """
    ids = [int(i) for i in ids]
    return [_added(tok, ids[max(0, i - _WINDOW) : i], ids[i]) for i in range(lo, len(ids) if hi is None else hi)]


def alternative_texts(tok: Any, ids: Sequence[int], i: int, alternatives: Sequence[int]) -> list[str]:
    """What each alternative token would add at position ``i`` of ``ids`` (``top_logprobs``' keys): the same
    spelling as :func:`token_texts`, so the chosen token's key is its ``tokens`` entry."""
    ctx = [int(t) for t in ids[max(0, i - _WINDOW) : i]]
    return [_added(tok, ctx, int(t)) for t in alternatives]


def _added(tok: Any, ctx: list[int], token_id: int) -> str:
    before, after = tok.decode(ctx), tok.decode([*ctx, token_id])
    added = after[len(before) :]
    if after.startswith(before) and "\ufffd" not in added and not before.endswith("\ufffd"):
        return added
    return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(tok, token_id))


def text_offsets(tok: Any, ids: Sequence[int], start: int = 0) -> list[int]:
    """Character offset of each token in the decoded text of ``ids`` (plus ``start``)."""
    return [start + len(tok.decode(list(ids[:i]))) if i else start for i in range(len(ids))]
