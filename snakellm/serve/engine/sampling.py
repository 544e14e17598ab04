"""Sampling on the device for a batch of rows with different settings, without host syncs.

Every row of the running batch carries its own temperature, top-k, top-p,
repetition, presence and frequency penalties, logit bias, ``min_new_tokens`` and
seed as device tensors, so one fused sequence of tensor ops serves a batch of
unrelated requests and can be captured in a CUDA graph (no ``.item()``, no
data-dependent shapes, no host round trip). The order is vLLM's and the eager
:class:`~snakellm.serve.generate.Generator`'s (:func:`penalize`): logit bias,
repetition penalty (HF/CTRL style, over prompt and generated tokens), frequency
and presence penalties (OpenAI's, over the generated tokens), EOD forbidden
before ``min_new_tokens``, then greedy argmax, or temperature -> top-k -> top-p
(at least one token kept) -> a draw.

The draw is the Gumbel-max trick (argmax of logits + Gumbel noise is an exact
sample of the softmax) with noise from a counter-based hash of (row seed, token
index, vocabulary id). Why not ``torch.multinomial`` with a generator: one
generator cannot give each row its own stream, and the hash makes a seeded
request draw the same tokens alone or in any batch, at any batch position.
"""

from __future__ import annotations

import random
from typing import Any

_M32 = 0xFFFFFFFF


def _hash32(x: Any) -> Any:
    """Chris Wellons' ``lowbias32`` on int64 tensors holding 32-bit values (low bits survive int64 wrap)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def penalize(
    logits: Any,
    bias: Any = None,
    seen: Any = None,
    repetition: Any = 1.0,
    counts: Any = None,
    frequency: Any = 0.0,
    presence: Any = 0.0,
) -> Any:
    """Logits [rows, vocab] with vLLM's penalties, in vLLM's order (a part left out where its tensor is None).

    ``bias`` is added (OpenAI's ``logit_bias``); the logits of tokens in ``seen`` (prompt and generated)
    are divided by ``repetition`` where positive, multiplied where not; ``counts`` (how often each token
    was generated) take ``frequency`` per occurrence and ``presence`` once off. The penalties are
    floats or per-row tensors [rows, 1].
    """
    s = logits if bias is None else logits + bias
    if seen is not None:
        import torch

        s = torch.where(seen, torch.where(s > 0, s / repetition, s * repetition), s)
    if counts is not None:
        s = s - frequency * counts - presence * (counts > 0).to(counts.dtype)
    return s


def gumbel_noise(seed: Any, step: Any, vocab_ids: Any) -> Any:
    """Gumbel(0, 1) noise [rows, vocab] (fp32), a pure function of (seed, step, vocabulary id)."""
    import torch

    base = _hash32(_hash32((seed & _M32) ^ ((seed >> 32) & _M32)) ^ (step & _M32))
    x = _hash32((base[:, None] * 0x9E3779B1 + vocab_ids[None, :]) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


class SamplingState:
    """Per-row sampling settings and history as device tensors ``[rows]``.

    ``[rows, vocab]``: ``seen`` (prompt and generated tokens: the repetition penalty), ``counts``
    (generated tokens: presence and frequency penalties) and ``bias`` (``logit_bias``).
    """

    def __init__(self, rows: int, vocab: int, eod: int, device: Any) -> None:
        import torch

        self.vocab = vocab
        self.eod = eod
        f32, i64 = torch.float32, torch.long
        self.temperature = torch.ones(rows, dtype=f32, device=device)
        self.top_k = torch.zeros(rows, dtype=i64, device=device)
        self.top_p = torch.ones(rows, dtype=f32, device=device)
        self.penalty = torch.ones(rows, dtype=f32, device=device)
        self.presence = torch.zeros(rows, dtype=f32, device=device)
        self.frequency = torch.zeros(rows, dtype=f32, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)
        self.min_new = torch.zeros(rows, dtype=i64, device=device)
        self.seed = torch.zeros(rows, dtype=i64, device=device)
        self.n_gen = torch.zeros(rows, dtype=i64, device=device)  # tokens generated so far (the draw's counter)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(rows, vocab, dtype=f32, device=device)
        self.bias = torch.zeros(rows, vocab, dtype=f32, device=device)
        self.vocab_ids = torch.arange(vocab, dtype=i64, device=device)
        self.ranks = self.vocab_ids

    def set_row(self, row: int, params: Any, prompt: list[int], seed: int | None) -> None:
        """Give ``row`` to a request: its settings, a zero counter, its prompt as the penalty's history."""
        import torch

        p = params
        self.temperature[row] = float(p.temperature) if not p.greedy else 1.0
        self.top_k[row] = int(p.top_k)
        self.top_p[row] = float(p.top_p)
        self.penalty[row] = float(p.repetition_penalty)
        self.presence[row] = float(p.presence_penalty)
        self.frequency[row] = float(p.frequency_penalty)
        self.greedy[row] = bool(p.greedy)
        self.min_new[row] = int(p.min_new_tokens)
        self.seed[row] = int(seed if seed is not None else random.getrandbits(62))
        self.n_gen[row] = 0
        self.seen[row] = False
        self.counts[row] = 0.0
        self.bias[row] = 0.0
        dev = self.seen.device
        if p.repetition_penalty != 1.0 and prompt:
            self.seen[row, torch.tensor(prompt, dtype=torch.long, device=dev)] = True
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            self.bias[row, ids] = torch.tensor([float(b) for b in p.logit_bias.values()], device=dev)

    def sample(
        self, logits: Any, rows: Any, greedy_only: bool, penalty: bool = True, probs: bool = True
    ) -> tuple[Any, Any]:
        """Next token and its log-probability (of the raw logits) for ``rows``; advances their counters.

        ``greedy_only``: every row in ``rows`` is greedy, so the sort for top-k/top-p and the noise
        are left out; ``penalty``: some row has a repetition, presence or frequency penalty or a logit
        bias (else the [rows, vocab] passes are left out; rows without them are left unchanged); ``probs``: some row wants log-probabilities (else they are zeros). Each
        combination is its own captured graph; the tokens are the general path's.
        """
        import torch

        scores = logits
        if penalty:
            scores = penalize(
                logits,
                self.bias.index_select(0, rows),
                self.seen.index_select(0, rows),
                self.penalty.index_select(0, rows)[:, None],
                self.counts.index_select(0, rows),
                self.frequency.index_select(0, rows)[:, None],
                self.presence.index_select(0, rows)[:, None],
            )
        n_gen = self.n_gen.index_select(0, rows)
        ban = n_gen < self.min_new.index_select(0, rows)  # EOD not allowed yet
        eod_col = torch.where(ban, float("-inf"), scores[:, self.eod])
        scores = torch.cat((scores[:, : self.eod], eod_col[:, None], scores[:, self.eod + 1 :]), dim=-1)
        best = scores.argmax(dim=-1)
        if greedy_only:
            nxt = best
        else:
            nxt = torch.where(self.greedy.index_select(0, rows), best, self._draw(scores, rows, n_gen))
        lp = logits.gather(-1, nxt[:, None])[:, 0]
        lp = lp - torch.logsumexp(logits, dim=-1) if probs else torch.zeros_like(lp)
        self.n_gen.index_add_(0, rows, torch.ones_like(n_gen))
        if penalty:
            self.seen.index_put_((rows, nxt), torch.ones_like(nxt, dtype=torch.bool))
            self.counts.index_put_((rows, nxt), self.counts[rows, nxt] + 1.0)  # rows are distinct
        return nxt, lp

    def _draw(self, scores: Any, rows: Any, n_gen: Any) -> Any:
        """temperature -> top-k -> top-p -> Gumbel-max draw, per row, over the sorted scores."""
        import torch

        s = scores / self.temperature.index_select(0, rows)[:, None]
        s_sorted, order = torch.sort(s, dim=-1, descending=True)
        k = self.top_k.index_select(0, rows)[:, None]
        in_k = (k == 0) | (self.ranks[None, :] < k)
        s_sorted = s_sorted.masked_fill(~in_k, float("-inf"))
        probs = torch.softmax(s_sorted, dim=-1)
        top_p = self.top_p.index_select(0, rows)[:, None]
        nucleus = ((top_p <= 0) | (top_p >= 1)) | (probs.cumsum(dim=-1) - probs < top_p)
        keep = in_k & nucleus
        keep[:, 0] = True
        noise = gumbel_noise(self.seed.index_select(0, rows), n_gen, self.vocab_ids).gather(-1, order)
        choice = (s_sorted.masked_fill(~keep, float("-inf")) + noise).argmax(dim=-1, keepdim=True)
        return order.gather(-1, choice)[:, 0]
