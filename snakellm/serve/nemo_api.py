"""NeMo ``MegatronServer``'s ``PUT /generate``, field for field.

The fields, their defaults and checks are those of NeMo's
``nemo/collections/nlp/modules/common/text_generation_server.py``
(``MegatronGenerate.put``): ``sentences`` (at most 128), ``tokens_to_generate``
(64), ``all_probs``, ``temperature`` (1.0, in (0, 100]), ``add_BOS``,
``greedy``, ``top_k`` (0), ``top_p`` (0.9), ``repetition_penalty`` (1.2, NeMo
<= 2.0.0's default; 2.1 changed it to 1.0), ``end_strings``
(``["<|endoftext|>"]``), ``min_tokens_to_generate``, ``compute_logprob``,
``random_seed``; the response is ``{sentences, tokens, logprob, token_ids,
offsets[, full_logprob]}`` with the prompt included. As in NeMo's sampling,
top-k wins over top-p when both are set.

Where the request does not fit the model, NeMo's behaviour: the generation is
shortened so that prompt + new tokens is at most the sequence length + 1
(NeMo's ``sample_sequence_batch`` clips ``maxlen`` the same way; the last token
is never fed back), and the log says so. Unknown keys are logged and ignored,
as NeMo does.

Differences, on purpose: an invalid field is HTTP 400 with
``{"error": ..., "field": ...}`` (NeMo answers 200 with the message as a JSON
string); ``task_ids`` (p-tuning by task) and ``neighbors`` (RETRO) are
rejected with a 400 naming them; the server's limits (prompts, total tokens)
answer 413.
"""

from __future__ import annotations

import logging
from typing import Any

from snakellm.serve.errors import APIError, bad
from snakellm.serve.generate import GenerationError, SamplingParams, token_strings
from snakellm.serve.openai_api import Limits
from snakellm.serve.sampling import Fields, is_int, is_num, is_str_list

log = logging.getLogger("snakellm.serve")

MAX_SENTENCES = 128  # NeMo's own limit
KNOWN = {
    "sentences",
    "tokens_to_generate",
    "all_probs",
    "temperature",
    "add_BOS",
    "greedy",
    "top_k",
    "top_p",
    "repetition_penalty",
    "end_strings",
    "min_tokens_to_generate",
    "compute_logprob",
    "random_seed",
    "task_ids",
    "neighbors",
}


def parse(body: Any, limits: Limits) -> tuple[list[str], SamplingParams, dict]:
    """NeMo's request -> (sentences, params, options); APIError(400) names the field."""
    f = Fields(body)
    for key in sorted(set(f.rest) - KNOWN):
        log.warning("PUT /generate: the request key %s is not allowed (ignored, as NeMo does)", key)
        f.rest.pop(key)
    s = f.rest.get("sentences")
    if s is None:
        raise bad("sentences", "sentences is required (a list of strings)")
    if not is_str_list(s) or not s:
        raise bad("sentences", "sentences must be a non-empty list of strings")
    if len(s) > MAX_SENTENCES:
        raise bad("sentences", f"Maximum number of sentences is {MAX_SENTENCES}")
    if len(s) > limits.max_prompts:
        raise APIError(413, f"{len(s)} sentences exceed this server's limit of {limits.max_prompts}", "sentences")
    f.rest.pop("sentences")

    def boolean(key: str) -> bool:
        return bool(f.take(key, False, lambda v: isinstance(v, bool), "must be a boolean"))

    ttg = f.take("tokens_to_generate", 64, lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
    all_probs = boolean("all_probs")
    temp = f.take("temperature", 1.0, lambda v: is_num(v) and 0 < v <= 100, "must be a number in (0, 100]")
    add_bos = boolean("add_BOS")
    greedy = boolean("greedy")
    top_k = f.take("top_k", 0, lambda v: is_num(v) and v >= 0 and float(v).is_integer(), "must be an integer >= 0")
    top_p = f.take("top_p", 0.9, lambda v: is_num(v) and 0 <= v <= 1, "must be a number in [0, 1]")
    rp = f.take("repetition_penalty", 1.2, lambda v: is_num(v) and v >= 1, "must be a number >= 1.0")
    ends = f.take("end_strings", ["<|endoftext|>"], is_str_list, "must be a list of strings")
    mintok = f.take("min_tokens_to_generate", 0, lambda v: is_int(v) and v >= 0, "must be an integer >= 0")
    logprob = boolean("compute_logprob")
    seed = f.take("random_seed", None, lambda v: is_int(v) and v >= 0, "must be an integer >= 0 or null")
    f.only("task_ids", lambda v: False, "p-tuning task ids")
    f.only("neighbors", lambda v: False, "RETRO neighbours")
    f.done()
    top_k = int(top_k)
    params = SamplingParams(
        max_new_tokens=ttg,
        min_new_tokens=mintok,
        greedy=greedy,
        temperature=float(temp),
        top_k=top_k,
        top_p=1.0 if top_k > 0 else float(top_p),  # NeMo applies top-k or top-p, never both (top-k wins)
        repetition_penalty=float(rp),
        end_strings=ends,
        seed=seed,
    )
    return s, params, {"add_bos": add_bos, "all_probs": all_probs, "compute_logprob": logprob}


def clip(gen: Any, rows: list[list[int]], params: SamplingParams, limits: Limits) -> None:
    """NeMo's fit: tokens_to_generate shortened to seq_length + 1 - the longest prompt (logged)."""
    ctx = gen.decoder.max_len
    longest = max(map(len, rows))
    if longest > ctx:
        raise bad("sentences", f"sentences: one of {longest} tokens exceeds the model's sequence length {ctx}")
    room = ctx + 1 - longest
    if params.max_new_tokens > room:
        log.warning(
            "PUT /generate: tokens_to_generate %d clipped to %d (the longest prompt has %d tokens, the sequence "
            "length is %d), as NeMo does",
            params.max_new_tokens,
            room,
            longest,
            ctx,
        )
        params.max_new_tokens = room
        params.min_new_tokens = min(params.min_new_tokens, room)
    total = sum(len(r) + params.max_new_tokens for r in rows)
    if total > limits.max_total_tokens:
        raise APIError(
            413,
            f"the request would run {total} tokens through the model, over this server's limit of "
            f"{limits.max_total_tokens} (serve --max-total-tokens)",
            "tokens_to_generate",
        )


def run(gen: Any, sentences: list[str], params: SamplingParams, opts: dict, limits: Limits, gone: Any = None) -> dict:
    """Generate on the model thread; NeMo's response object (``gone`` set: the request gave up, stop)."""
    from snakellm.serve.stream import cancel_on

    rows = gen.encode(sentences, opts["add_bos"])
    for i, r in enumerate(rows):
        if not r:
            raise bad("sentences", f"sentence {i} is empty (no tokens); set add_BOS or give some text")
    clip(gen, rows, params, limits)
    try:
        outs = gen.generate(rows, params, on_step=cancel_on(gone) if gone is not None else None)
    except GenerationError as e:
        f = "tokens_to_generate" if e.field == "max_new_tokens" else e.field or "sentences"
        raise bad(f, str(e)) from None
    return response(gen, outs, opts)


def response(gen: Any, completions: list, opts: dict) -> dict:
    tok = gen.tok
    rows = [c.prompt_ids + c.ids for c in completions]
    out: dict[str, Any] = {"sentences": [], "tokens": [], "logprob": None, "token_ids": rows, "offsets": []}
    for ids in rows:
        out["sentences"].append(tok.decode(ids))
        out["tokens"].append(token_strings(tok, ids))
        out["offsets"].append([len(tok.decode(ids[:i])) for i in range(len(ids))])
    full = None
    if opts["compute_logprob"]:
        out["logprob"], full = gen.score(rows, full=opts["all_probs"])
    if opts["all_probs"]:
        out["full_logprob"] = full
    return out


def error_body(e: APIError) -> dict:
    """NeMo's API keeps its own error shape: the message and the field."""
    return {"error": e.message, "field": e.param}
