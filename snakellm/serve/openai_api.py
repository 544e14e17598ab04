"""OpenAI's completions and chat completions, as the ``openai`` client and lm-eval use them.

A request is parsed into a :class:`GenRequest` on the event loop (every field
checked, unsupported ones rejected with a 400 naming them), run as one job on
the model worker (:func:`run`: tokenize, check the limits, generate, score
log-probabilities when asked), and shaped into a response or a list of
server-sent-event chunks.

Fields (completions): ``model``, ``prompt`` (a string, a list of strings, a
list of token ids or a list of lists of ids), ``max_tokens`` (16; 0 only with
``echo``), ``temperature`` (1; 0 is greedy), ``top_p``, ``n``, ``stop`` (up to
16 strings, cut from the text as OpenAI does), ``seed``, ``logprobs`` (0-20
alternatives), ``echo``, ``stream``, ``stream_options.include_usage``,
``user`` (recorded nowhere: it does not change the output), ``presence_penalty``
and ``frequency_penalty`` (in [-2, 2]: vLLM's semantics, over the tokens generated
so far), ``logit_bias`` (token id -> bias in [-100, 100], added to the logits;
an id outside the vocabulary is a 400), and vLLM's extras ``top_k``,
``min_tokens``, ``repetition_penalty``. Accepted only with its no-op value:
``best_of`` (1 or n). ``suffix`` and every other
field: 400. Chat adds ``messages``, ``max_completion_tokens``, ``logprobs``
(a boolean) with ``top_logprobs``.

Log-probabilities (``logprobs``/``echo``) include every token the model read or
produced, the final end-of-document token included, so lm-eval's
``token_logprobs[ctxlen:-1]`` slices exactly the continuation; ``text_offset``
counts characters into prompt + completion.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from snakellm.serve.errors import APIError, bad
from snakellm.serve.generate import GenerationError, SamplingParams
from snakellm.serve.sampling import (
    Fields,
    Scored,
    alternative_texts,
    is_int,
    is_num,
    is_str_list,
    score,
    text_offsets,
    token_texts,
    visible,
)

MAX_LOGPROBS = 20
MAX_STOP = 16


@dataclass
class Limits:
    """What one request may ask of the model (from ServeSettings)."""

    max_prompts: int
    max_total_tokens: int


@dataclass
class GenRequest:
    """A parsed completions or chat request, ready for the model worker."""

    prompts: list[str | list[int]]
    n: int
    params: SamplingParams
    echo: bool = False
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    model: str = ""
    fill_context: bool = False  # chat without max_tokens: generate up to the context length


@dataclass
class Choice:
    """One generated continuation with what the response shapes need."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    ids: list[int]  # generated ids, a final EOD or stop token included
    text: str  # the completion as returned: without EOD, cut before a stop string
    finish_reason: str  # "stop" | "length"
    scored: Scored | None = None  # prompt + generated ids, when logprobs were asked
    eod: bool = False  # ended by the end-of-document token (the last of ``ids``)
    offsets: list[int] | None = None  # text_offset of prompt + generated tokens (computed once)


# ----------------------------------------------------------------------------- parsing


def _prompts(v: Any) -> list[str | list[int]]:
    def ids_ok(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(is_int(i) for i in x)

    if isinstance(v, str):
        out: list[str | list[int]] = [v]
    elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        out = list(v)
    elif ids_ok(v):
        out = [list(v)]
    elif isinstance(v, list) and v and all(ids_ok(x) for x in v):
        out = [list(x) for x in v]
    else:
        raise bad(
            "prompt",
            "prompt must be a string, a non-empty list of strings, a non-empty list of token ids or a list of "
            "non-empty lists of token ids",
        )
    for i, p in enumerate(out):
        if p == "":
            raise bad("prompt", f"prompt {i} is empty: give at least one token")
    return out


def _logit_bias(v: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` ({"token id": bias in [-100, 100]}) as {id: bias}; a 400 naming it if not."""
    out: dict[int, float] = {}
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            t = -1
        if t < 0 or str(t) != str(k).strip():
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {json.dumps(k)}")
        if not is_num(b) or not -100 <= b <= 100:
            raise bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {json.dumps(b)} for {k}")
        out[t] = float(b)
    return out


def _sampling(f: Fields, max_tokens: int) -> SamplingParams:
    """The sampling fields both APIs share, read from ``f``."""
    temp = f.take("temperature", 1.0, lambda v: is_num(v) and 0 <= v <= 2, "must be a number in [0, 2]")
    top_p = f.take("top_p", 1.0, lambda v: is_num(v) and 0 < v <= 1, "must be a number in (0, 1]")
    top_k = f.take("top_k", 0, lambda v: is_int(v) and v >= -1, "must be an integer >= -1 (-1 or 0: off)")
    min_tokens = f.take("min_tokens", 0, lambda v: is_int(v) and 0 <= v, "must be an integer >= 0")
    if min_tokens > max_tokens:
        raise bad("min_tokens", f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
    rp = f.take("repetition_penalty", 1.0, lambda v: is_num(v) and v >= 1, "must be a number >= 1 (1: off)")
    seed = f.take("seed", None, is_int, "must be an integer")
    stop = f.take(
        "stop",
        [],
        lambda v: isinstance(v, str) or (is_str_list(v) and len(v) <= MAX_STOP),
        f"must be a string or a list of up to {MAX_STOP} strings",
    )
    presence = f.take("presence_penalty", 0.0, lambda v: is_num(v) and -2 <= v <= 2, "must be a number in [-2, 2]")
    frequency = f.take("frequency_penalty", 0.0, lambda v: is_num(v) and -2 <= v <= 2, "must be a number in [-2, 2]")
    bias = _logit_bias(f.take("logit_bias", {}, lambda v: isinstance(v, dict), "must be an object"))
    return SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        greedy=temp == 0,
        temperature=float(temp) if temp else 1.0,
        top_k=max(int(top_k), 0),
        top_p=float(top_p),
        repetition_penalty=float(rp),
        presence_penalty=float(presence),
        frequency_penalty=float(frequency),
        logit_bias=bias,
        end_strings=[stop] if isinstance(stop, str) else [s for s in stop if s],
        seed=None if seed is None else seed % (2**63),
    )


def _model(f: Fields, model_name: str) -> str:
    model = f.take("model", model_name, lambda v: isinstance(v, str), "must be a string")
    if model != model_name:
        raise APIError(
            404, f"The model '{model}' does not exist: this server serves '{model_name}'", "model", "model_not_found"
        )
    return model


def _common(f: Fields, limits: Limits, rows: int) -> tuple[int, bool, bool]:
    n = f.take("n", 1, lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
    if rows * n > limits.max_prompts:
        raise APIError(
            413,
            f"{rows} prompt(s) x n={n} = {rows * n} completions exceed this server's limit of {limits.max_prompts} "
            "per request (serve --max-prompts)",
            "n" if n > 1 else "prompt",
        )
    best_of = f.take("best_of", n, is_int, "must be an integer")
    if best_of != n:
        raise bad("best_of", f"best_of is not supported by this server (only best_of = n = {n}), got {best_of}")
    stream = f.take("stream", False, lambda v: isinstance(v, bool), "must be a boolean")
    opts = f.take("stream_options", {}, lambda v: isinstance(v, dict), "must be an object")
    if opts and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    extra = set(opts) - {"include_usage"}
    if extra:
        raise bad("stream_options", f"stream_options.{sorted(extra)[0]} is not supported (include_usage is)")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad("stream_options", "stream_options.include_usage must be a boolean")
    f.take("user", None, lambda v: isinstance(v, str), "must be a string")
    return n, stream, usage


def parse_completion(body: Any, model_name: str, limits: Limits) -> GenRequest:
    """POST /v1/completions' body -> a GenRequest (APIError naming the field when it is not one)."""
    f = Fields(body)
    model = _model(f, model_name)
    if "prompt" not in f.rest:
        raise bad("prompt", "prompt is required")
    prompts = _prompts(f.rest.pop("prompt"))
    f.only("suffix", lambda v: v == "", "no insertion")
    echo = f.take("echo", False, lambda v: isinstance(v, bool), "must be a boolean")
    max_tokens = f.take("max_tokens", 16, lambda v: is_int(v) and v >= 0, "must be an integer >= 0")
    if max_tokens == 0 and not echo:
        raise bad("max_tokens", "max_tokens must be at least 1 (0 only with echo: true)")
    logprobs = f.take(
        "logprobs", None, lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}]"
    )
    n, stream, usage = _common(f, limits, len(prompts))
    params = _sampling(f, max_tokens)
    f.done()
    return GenRequest(prompts, n, params, echo, logprobs, stream, usage, list(params.end_strings), model)


# ----------------------------------------------------------------------------- running (model thread)


def _encode(gen: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    out = []
    vocab = gen.vocab_size
    for i, p in enumerate(prompts):
        ids = gen.tok.encode(p) if isinstance(p, str) else p
        if not ids:
            raise bad("prompt", f"prompt {i} has no tokens")
        badid = next((t for t in ids if not 0 <= t < vocab), None)
        if badid is not None:
            raise bad("prompt", f"prompt {i}: token id {badid} is outside the vocabulary (0..{vocab - 1})")
        out.append(list(ids))
    return out


def _check_fit(gen: Any, rows: list[list[int]], req: GenRequest, limits: Limits, max_field: str) -> None:
    ctx = gen.decoder.max_len
    m = req.params.max_new_tokens
    for i, ids in enumerate(rows):
        if len(ids) + m > ctx:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens; prompt {i} has {len(ids)} tokens and "
                f"{max_field} asks for {m} more",
                max_field if len(ids) <= ctx else "prompt",
                "context_length_exceeded",
            )
    total = req.n * sum(len(ids) + m for ids in rows)
    if total > limits.max_total_tokens:
        raise APIError(
            413,
            f"the request would run {total} tokens through the model ((prompt + {max_field}) x n, summed), over this "
            f"server's limit of {limits.max_total_tokens} (serve --max-total-tokens)",
            max_field,
        )


def _finish(gen: Any, prompt: list[int], c: Any, stops: list[str]) -> tuple[str, str]:
    """(text, finish_reason) as OpenAI returns them: no special tokens, nothing from the first stop string on."""
    text = visible(gen, prompt, c.ids)
    if c.finish_reason == "end_string":
        cut = min((text.find(s) for s in stops if s and s in text), default=-1)
        return (text[:cut] if cut >= 0 else text), "stop"
    return text, "stop" if c.finish_reason == "eod" else "length"


def prepare(gen: Any, req: GenRequest, limits: Limits, max_field: str = "max_tokens") -> list[list[int]]:
    """The prompts' token ids, checked against the vocabulary, the context and the limits (APIError if not)."""
    prompts = _encode(gen, req.prompts)
    if req.fill_context:
        req.params.max_new_tokens = max(1, gen.decoder.max_len - max(map(len, prompts)))
    _check_fit(gen, prompts, req, limits, max_field)
    return prompts


def prompt_text(gen: Any, src: str | list[int], ids: list[int]) -> str:
    """The prompt as echoed: the string as sent, or the decoded token ids."""
    return src if isinstance(src, str) else str(gen.tok.decode(ids))


def run(
    gen: Any,
    req: GenRequest,
    limits: Limits,
    max_field: str = "max_tokens",
    prompts: list[list[int]] | None = None,
    on_step: Any = None,
) -> list[Choice]:
    """Generate (and score) on the model thread; choices in OpenAI's order (prompt-major, then n)."""
    if prompts is None:
        prompts = prepare(gen, req, limits, max_field)
    rows = [p for p in prompts for _ in range(req.n)]
    if req.params.max_new_tokens == 0:
        outs: list[Any] = [None] * len(rows)
    else:
        try:
            outs = gen.generate(rows, req.params, on_step=on_step)
        except GenerationError as e:  # the engine's own checks, in OpenAI's words
            raise bad(max_field if e.field == "max_new_tokens" else (e.field or "prompt"), str(e)) from None
    choices = []
    for i, (ids, c) in enumerate(zip(rows, outs)):
        ptext = prompt_text(gen, req.prompts[i // req.n], ids)
        if c is None:
            choices.append(Choice(i, ids, ptext, [], "", "length"))
            continue
        text, reason = _finish(gen, ids, c, req.stop)
        choices.append(Choice(i, ids, ptext, list(c.ids), text, reason, eod=c.finish_reason == "eod"))
    if req.logprobs is not None:
        for ch, sc in zip(choices, score(gen, [c.prompt_ids + c.ids for c in choices], req.logprobs)):
            ch.scored = sc
    return choices


# ----------------------------------------------------------------------------- responses


def _usage(choices: list[Choice], n: int) -> dict:
    pt = sum(len(c.prompt_ids) for c in choices[::n])
    ct = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}


def _completion_logprobs(gen: Any, c: Choice, echo: bool, lo: int, hi: int) -> dict:
    """OpenAI's completions ``logprobs`` object for tokens lo..hi of prompt + completion."""
    assert c.scored is not None
    tok = gen.tok
    ids = c.scored.ids
    if c.offsets is None:
        c.offsets = text_offsets(tok, ids)
    offs = c.offsets
    start = 0 if echo else len(c.prompt_ids)
    lo = max(lo, start)
    top: list[dict[str, float] | None] = []
    tokens = token_texts(tok, ids, lo, hi)  # they concatenate to the text (leading spaces kept)
    for i in range(lo, hi):
        if i == 0:
            top.append(None)
            continue
        keys = alternative_texts(tok, ids, i, [t for t, _ in c.scored.top[i]])
        alts = {k: lp for k, (_, lp) in zip(keys, c.scored.top[i], strict=True)}
        alts.setdefault(tokens[i - lo], float(c.scored.logprobs[i] or 0.0))  # the chosen one is always there (vLLM)
        top.append(alts)
    return {
        "tokens": tokens,
        "token_logprobs": c.scored.logprobs[lo:hi],
        "top_logprobs": top,
        "text_offset": offs[lo:hi],
    }


def completion_body(gen: Any, req: GenRequest, choices: list[Choice]) -> dict:
    out = []
    for c in choices:
        lp = None
        if c.scored is not None:
            lp = _completion_logprobs(gen, c, req.echo, 0, len(c.scored.ids))
        out.append(
            {
                "index": c.index,
                "text": (c.prompt_text if req.echo else "") + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": out,
        "usage": _usage(choices, req.n),
    }


def pieces(gen: Any, c: Choice) -> list[str]:
    """The completion's text cut into one piece per generated token (they add up to ``c.text``)."""
    out, prev = [], 0
    for i in range(len(c.ids)):
        end = min(len(visible(gen, c.prompt_ids, c.ids[: i + 1])), len(c.text))
        out.append(c.text[prev:end] if end > prev else "")
        prev = max(prev, end)
    if prev < len(c.text):  # a decode that is not a prefix of the next: the rest goes with the last token
        out[-1] += c.text[prev:]
    return out


def stream_chunk(req: GenRequest, cid: str, created: int, obj: str, choice: dict[str, Any]) -> dict:
    """One SSE chunk of a completions or chat stream: one choice, and ``usage: null`` until the last chunk
    when the client asked for usage (OpenAI's shape for both APIs)."""
    d: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        d["usage"] = None
    return d


def completion_chunk(
    req: GenRequest, cid: str, created: int, index: int, text: str, lp: dict | None, reason: str | None
) -> dict:
    choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
    return stream_chunk(req, cid, created, "text_completion", choice)


def usage_chunk(req: GenRequest, cid: str, created: int, obj: str, choices: list[Choice]) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": cid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [],
        "usage": _usage(choices, req.n),
    }


def completion_chunks(gen: Any, req: GenRequest, choices: list[Choice], cid: str, created: int) -> list[dict]:
    """A finished completion as stream chunks: per choice, the echo, one chunk per token, the finish."""
    out = []
    for c in choices:
        p = len(c.prompt_ids)
        if req.echo:
            lp = _completion_logprobs(gen, c, True, 0, p) if c.scored else None
            out.append(
                completion_chunk(req, cid, created, c.index, c.prompt_text, lp, None if c.ids else c.finish_reason)
            )
        for i, text in enumerate(pieces(gen, c)):
            lp = _completion_logprobs(gen, c, True, p + i, p + i + 1) if c.scored else None
            reason = c.finish_reason if i == len(c.ids) - 1 else None
            out.append(completion_chunk(req, cid, created, c.index, text, lp, reason))
    if req.include_usage:
        out.append(usage_chunk(req, cid, created, "text_completion", choices))
    return out
