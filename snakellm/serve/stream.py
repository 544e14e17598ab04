"""Streaming (``stream: true``): chunks leave as the tokens are generated.

The model thread runs a streaming job; the job puts chunks on the request's
queue through ``emit`` (thread-safe), first :data:`START` once the request has
passed every check (so a bad request still gets its status, not a broken
stream), and :data:`END` when it is done. :class:`TextDeltas` is the engine's
``on_step`` callback: it turns each row's new tokens into new text, holding
back what could still become a stop string (and an unfinished UTF-8
character), and stops the generation when the client has gone.

With ``logprobs`` the log-probabilities come from scoring the finished rows,
so those streams send their chunks when the generation is done.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from snakellm.serve.sampling import visible
from snakellm.serve.worker import Abandoned

START = "start"
END = "end"
Emit = Callable[[Any], None]


def cancel_on(gone: threading.Event) -> Callable[[int, Any, Any], None]:
    """An ``on_step`` that ends the generation once ``gone`` is set (a timeout, a client gone)."""

    def on_step(step: int, tokens: Any, done: Any) -> None:
        if gone.is_set():
            raise Abandoned()

    return on_step


class TextDeltas:
    """``on_step``: each row's new text as its tokens arrive, through ``send(row, text)``."""

    def __init__(
        self,
        gen: Any,
        rows: Sequence[list[int]],
        stops: Sequence[str],
        send: Callable[[int, str], None],
        gone: threading.Event,
    ) -> None:
        self.gen, self.rows, self.send, self.gone = gen, rows, send, gone
        self.hold = max((len(s) for s in stops if s), default=1) - 1
        self.ids: list[list[int]] = [[] for _ in rows]
        self.sent = [0] * len(rows)
        self.finished = [False] * len(rows)

    def __call__(self, step: int, tokens: Any, done: Any) -> None:
        if self.gone.is_set():
            raise Abandoned()
        for i, (t, fin) in enumerate(zip(tokens.tolist(), done.tolist())):
            if self.finished[i]:
                continue
            self.ids[i].append(t)
            if fin:  # the final text (stop string cut, EOD dropped) goes out with the finish
                self.finished[i] = True
                continue
            text = visible(self.gen, self.rows[i], self.ids[i])
            safe = len(text) - self.hold
            while safe > self.sent[i] and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > self.sent[i]:
                self.send(i, text[self.sent[i] : safe])
                self.sent[i] = safe

    def rest(self, row: int, final: str) -> str:
        """What of the final text has not been sent yet."""
        return final[self.sent[row] :]


def completion_job(gen: Any, req: Any, limits: Any, emit: Emit, gone: threading.Event) -> None:
    """A streamed POST /v1/completions on the model thread."""
    from snakellm.serve import openai_api as oa

    prompts = oa.prepare(gen, req, limits)
    emit(START)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if req.logprobs is not None:
        choices = oa.run(gen, req, limits, prompts=prompts, on_step=cancel_on(gone))
        for item in oa.completion_chunks(gen, req, choices, cid, created):
            emit(item)
        return

    def chunk(i: int, text: str, reason: str | None = None) -> dict:
        return oa.completion_chunk(req, cid, created, i, text, None, reason)

    rows = [p for p in prompts for _ in range(req.n)]
    if req.echo:
        for i, ids in enumerate(rows):
            emit(chunk(i, oa.prompt_text(gen, req.prompts[i // req.n], ids)))
    deltas = TextDeltas(gen, rows, req.stop, lambda i, t: emit(chunk(i, t)), gone)
    choices = oa.run(gen, req, limits, prompts=prompts, on_step=deltas)
    for c in choices:
        emit(chunk(c.index, deltas.rest(c.index, c.text), c.finish_reason))
    if req.include_usage:
        emit(oa.usage_chunk(req, cid, created, "text_completion", choices))


def chat_job(gen: Any, req: Any, limits: Any, emit: Emit, gone: threading.Event) -> None:
    """A streamed POST /v1/chat/completions on the model thread."""
    from snakellm.serve import chat
    from snakellm.serve import openai_api as oa

    prompts = oa.prepare(gen, req, limits)
    emit(START)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.logprobs is not None:
        choices = oa.run(gen, req, limits, prompts=prompts, on_step=cancel_on(gone))
        for item in chat.chat_chunks(gen, req, choices, cid, created):
            emit(item)
        return

    def chunk(i: int, delta: dict, reason: str | None = None) -> dict:
        return chat.chat_chunk(req, cid, created, i, delta, None, reason)

    rows = [p for p in prompts for _ in range(req.n)]
    for i in range(len(rows)):
        emit(chunk(i, {"role": "assistant", "content": ""}))
    deltas = TextDeltas(gen, rows, req.stop, lambda i, t: emit(chunk(i, {"content": t})), gone)
    choices = oa.run(gen, req, limits, prompts=prompts, on_step=deltas)
    for c in choices:
        rest = deltas.rest(c.index, c.text)
        if rest:
            emit(chunk(c.index, {"content": rest}))
        emit(chunk(c.index, {}, c.finish_reason))
    if req.include_usage:
        emit(oa.usage_chunk(req, cid, created, "chat.completion.chunk", choices))
