"""Continuous batching: one scheduler owns the model; requests join and leave the running batch.

:class:`Engine` is the synchronous core. Each :meth:`Engine.step`:

1. drops cancelled requests (a waiting one never runs; a running one frees its row);
2. admits waiting requests, oldest first, while a cache row is free and the
   step's prefill stays under ``prefill_tokens``, prefills them in one batched
   forward and samples their first token;
3. runs one decode step (a CUDA graph replay on the GPU) for every running row;
4. reads the new tokens (one device-to-host copy per step) and retires rows that
   hit EOD, an end string or ``max_new_tokens``; their rows are free for the next
   step's admissions.

Admission control is the cache itself: :class:`~snakellm.serve.engine.static_cache.StaticKVCache`
has as many rows as the memory budget holds, each ``max_len`` tokens long. A
request waits (never fails) while every row is taken; one whose prompt plus
``max_new_tokens`` exceeds a row can never run and is refused at submission
with :class:`RequestTooLarge` (HTTP 413).

:class:`EngineWorker` runs an :class:`Engine` on its own thread for a server:
``submit()`` (thread-safe) returns a :class:`RequestStream`, iterated with
``for`` or ``async for`` (token events as they are produced), ``cancel()``-able,
with ``result()`` / ``await completion()`` for the whole :class:`Completion`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from snakellm.serve.engine.fast_decoder import FUSED_MAX_ROWS, FastDecoder, fused_kernels_usable
from snakellm.serve.engine.settings import EngineSettings
from snakellm.serve.engine.static_cache import CacheShape, rows_for_budget
from snakellm.serve.generate import Completion, GenerationError, SamplingParams

_ids = itertools.count()


class RequestTooLarge(GenerationError):
    """A request no cache row can ever hold (prompt + max new tokens > the row length): HTTP 413."""

    http_status = 413


@dataclass
class TokenEvent:
    """One generated token of a request; ``finish_reason`` is set on its last one (or on a lone final event)."""

    token: int | None
    logprob: float | None
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    seed: int | None = None
    prompt_logprobs: bool = False
    sink: Callable[[Request, TokenEvent | None], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    row: int = -1
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_lps: list[float] = field(default_factory=list)
    full: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def sampler_variant(requests: Sequence[Request]) -> tuple[bool, bool]:
    """(every request greedy, some request with a penalty or logit bias): which sampler path their rows need."""
    greedy = all(r.params.greedy for r in requests)
    return greedy, any(r.params.penalized for r in requests)


class Engine:
    """Continuous batching over a :class:`FastDecoder` for one loaded :class:`Generator` (one thread)."""

    def __init__(self, generator: Any, settings: EngineSettings | None = None) -> None:
        from snakellm.errors import ConfigError

        self.settings = s = settings or EngineSettings()
        self.gen = generator
        self.tok = generator.tok
        dec = generator.decoder
        max_len = s.max_seq_len or dec.max_len
        if not 1 <= max_len <= dec.max_len:
            raise ConfigError(f"max_seq_len: {max_len} is outside 1..{dec.max_len} (the model's sequence length)")
        shape = CacheShape(len(dec.layers), dec.g, dec.d, max_len, dec.emb.element_size())
        rows = rows_for_budget(shape, s.kv_cache_memory, s.max_batch, dec.device)
        if not 0 <= s.fused_max_batch <= FUSED_MAX_ROWS:
            raise ConfigError(f"fused_max_batch: {s.fused_max_batch} is outside 0..{FUSED_MAX_ROWS}")
        fused = s.fused_max_batch if fused_kernels_usable(dec) else 0
        self.fast = FastDecoder(
            dec, rows, max_len, self.tok.eod_id, graphs=s.cuda_graphs, compile=s.compile, fused=fused
        )
        self.max_len = max_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}
        self.free: list[int] = list(range(rows))  # a heap: the lowest free row first keeps batches compact
        self.pending: tuple[list[Request], int, Any] | None = None  # the decode step whose tokens are unread
        # on the CPU every op runs as it is called: there is nothing to overlap, only a step of latency
        self.pipelined = dec.device.type == "cuda"
        self._slot = 0
        self.host_tokens, self.host_logprobs, self.copied = self._host_buffers(rows, dec.device)

    @staticmethod
    def _host_buffers(rows: int, device: Any) -> tuple[list[Any], list[Any], list[Any]]:
        """Two (pinned, on CUDA) host buffers for a step's tokens and log-probs, and their copy events."""
        import torch

        cuda = device.type == "cuda"
        tokens = [torch.zeros(rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        logprobs = [torch.zeros(rows, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        return tokens, logprobs, events

    # ------------------------------------------------------------------ requests

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise what a request that cannot be served raises: GenerationError (400) or RequestTooLarge (413)."""
        params.check()
        params.check_vocab(self.fast.vocab)
        if not prompt:
            raise GenerationError("a prompt is empty (no tokens); set add_BOS or give some text", "sentences")
        V = self.fast.vocab
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise GenerationError(f"token id {bad[0]} outside the vocabulary of {V}", "sentences")
        # the last new token is never fed back: prompt + new tokens may be one more than a row holds
        if len(prompt) > self.max_len or len(prompt) + params.max_new_tokens > self.max_len + 1:
            raise RequestTooLarge(
                f"tokens_to_generate: a prompt of {len(prompt)} tokens + {params.max_new_tokens} new tokens exceeds "
                f"the {self.max_len} tokens a KV-cache row holds (max_seq_len)",
                "tokens_to_generate",
            )

    def add(self, req: Request) -> Request:
        """Queue a checked request; it joins the batch at a coming step."""
        self.check(req.prompt, req.params)
        if req.params.max_new_tokens == 0:
            self._finish(req, "length")
        else:
            self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending)

    # ------------------------------------------------------------------ one step

    def step(self) -> None:
        """Admit + prefill, one decode step for every running row, emit tokens, retire finished rows.

        Rows admitted in this step take part in its decode step too (their second token), so a
        request's first two tokens cost one step; a row that finished on its first token only
        wastes that one computation.

        The decode step is pipelined: its tokens are copied to the host behind it, and read one
        step later, after the next step is queued, so the device never waits for the host's
        emitting, stop checks and admissions. A row whose request finished at step ``k`` is
        computed once more at ``k + 1`` and that token is dropped. Requests that want every
        step's full distribution run unpipelined, and so does the CPU (``pipelined``), where
        nothing runs behind the host.
        """
        import torch

        with torch.inference_mode():
            self._step()

    def _step(self) -> None:
        self._drop_cancelled()
        joined = self._admit()
        running = list(self.running.values())
        launched = self._launch(running) if running else None
        emitted: list[tuple[Request, int, float, Any]] = []
        if joined is not None:
            batch, nxt, lp, first_full = joined
            for i, (r, t, x) in enumerate(zip(batch, nxt.tolist(), lp.tolist(), strict=True)):
                emitted.append((r, t, x, None if first_full is None else first_full[i]))
        previous, self.pending = self.pending, launched
        if previous is not None:
            emitted += self._collect(*previous)
        if launched is not None and (launched[2] is not None or not self.pipelined):  # this step's tokens now
            self.pending = None
            emitted += self._collect(*launched)
        for r, t, x, f in emitted:
            self._emit(r, t, x, f)

    def _launch(self, running: list[Request]) -> tuple[list[Request], int, Any]:
        """Queue one decode step for ``running`` and the copy of its tokens to the host.

        Returns (requests, host buffer index, full log-probabilities or None); the full
        distribution (``all_probs``) is read at once, which ends the pipelining for that step.
        """
        import torch

        want_full = any(r.params.all_probs for r in running)
        probs = want_full or any(r.params.logprobs for r in running)
        greedy, penalty = sampler_variant(running)
        # + 1: the tokens of the step still in flight are not emitted yet
        longest = min(max(len(r.prompt) + len(r.ids) + 1 for r in running) + 1, self.max_len)
        self.fast.decode(max(r.row for r in running), longest, greedy, penalty, probs)
        slot = self._slot = 1 - self._slot
        self.host_tokens[slot].copy_(self.fast.out_tokens, non_blocking=True)
        self.host_logprobs[slot].copy_(self.fast.out_logprobs, non_blocking=True)
        if self.copied[slot] is not None:
            self.copied[slot].record()
        full = torch.log_softmax(self.fast.logits, dim=-1).cpu() if want_full else None
        return running, slot, full

    def _collect(self, running: list[Request], slot: int, full: Any) -> list[tuple[Request, int, float, Any]]:
        """The tokens of a launched step for its requests (once its copy to the host is done)."""
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()
        toks, lps = self.host_tokens[slot].tolist(), self.host_logprobs[slot].tolist()
        return [(r, toks[r.row], lps[r.row], None if full is None else full[r.row]) for r in running if not r.done]

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self._finish(r, "cancelled")
        for r in [r for r in self.running.values() if r.cancelled]:
            self._finish(r, "cancelled")

    def _take_waiting(self) -> list[Request]:
        """Waiting requests (oldest first) that get a free row and fit this step's prefill budget."""
        batch: list[Request] = []
        longest = 0
        while self.waiting and self.free:
            r = self.waiting[0]
            longest = max(longest, len(r.prompt))
            if batch and longest * (len(batch) + 1) > self.settings.prefill_tokens:
                break
            self.waiting.popleft()
            r.row = heapq.heappop(self.free)
            self.running[r.row] = r
            self.fast.sampler.set_row(r.row, r.params, r.prompt, r.seed)
            batch.append(r)
        return batch

    def _admit(self) -> tuple[list[Request], Any, Any, Any] | None:
        """Prefill the requests that join now; (requests, first tokens, their log-probs, full log-probs)."""
        import torch

        batch = self._take_waiting()
        if not batch:
            return None
        rows, prompts = [r.row for r in batch], [r.prompt for r in batch]
        want_all = any(r.prompt_logprobs for r in batch)
        logits = self.fast.prefill(rows, prompts, want_all=want_all)
        if want_all:
            self._prompt_logprobs(batch, logits)
            last = torch.tensor([len(p) - 1 for p in prompts], device=logits.device)
            logits = logits[torch.arange(len(batch), device=logits.device), last]
        nxt, lp = self.fast.start_rows(rows, prompts, logits, *sampler_variant(batch))
        full = torch.log_softmax(logits, dim=-1).cpu() if any(r.params.all_probs for r in batch) else None
        return batch, nxt, lp, full

    def _prompt_logprobs(self, batch: list[Request], logits: Any) -> None:
        import torch

        for i, r in enumerate(batch):
            n = len(r.prompt)
            lsm = torch.log_softmax(logits[i, : n - 1], dim=-1)
            ids = torch.tensor(r.prompt[1:], dtype=torch.long, device=logits.device)
            r.prompt_lps = lsm.gather(-1, ids[:, None])[:, 0].tolist()

    def _emit(self, r: Request, token: int, lp: float, full: Any) -> None:
        """Record one token of ``r``, tell its sink, and retire it if it is finished."""
        if r.done:
            return
        p = r.params
        r.ids.append(token)
        r.logprobs.append(lp)
        if full is not None and p.all_probs:
            r.full.append(full.tolist())
        step = len(r.ids) - 1
        reason = None
        if p.stop_at_eod and step >= p.min_new_tokens and token == self.tok.eod_id:
            reason = "eod"
        elif any(e and e in self.tok.decode(r.ids[-32:]) for e in p.end_strings):
            reason = "end_string"
        elif len(r.ids) >= p.max_new_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r, reason, tell=False)
        if r.sink is not None:
            r.sink(r, TokenEvent(token, lp, "", reason))

    def _finish(self, r: Request, reason: str, tell: bool = True) -> None:
        r.finish_reason = reason
        if r.row >= 0 and self.running.get(r.row) is r:
            del self.running[r.row]
            self.fast.stop_row(r.row)
            heapq.heappush(self.free, r.row)
        if tell and r.sink is not None:
            r.sink(r, TokenEvent(None, None, "", reason))

    def fail_all(self, error: BaseException) -> None:
        """Finish every request with ``error`` (the step raised: a device error, out of memory)."""
        for r in list(self.waiting) + list(self.running.values()):
            r.error = error
            self._finish(r, "error")
        self.waiting.clear()
        self.pending = None

    # ------------------------------------------------------------------ offline batches

    def completion(self, r: Request) -> Completion:
        return Completion(
            r.prompt,
            list(r.ids),
            self.gen.continuation(r.prompt, r.ids),
            r.finish_reason or "length",
            list(r.logprobs) if (r.params.logprobs or r.params.all_probs) else [],
            list(r.prompt_lps),
            [list(x) for x in r.full] if r.params.all_probs else None,
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        add_bos: bool = False,
        prompt_logprobs: bool = False,
    ) -> list[Completion]:
        """What :meth:`Generator.generate` returns, through continuous batching (any number of prompts).

        A seeded request gives prompt ``i`` the seed ``seed + i``: the same tokens alone or in a batch.
        """
        batch = self.gen.encode(prompts, add_bos)
        reqs = [
            Request(p, params, None if params.seed is None else params.seed + i, prompt_logprobs)
            for i, p in enumerate(batch)
        ]
        for r in reqs:
            self.check(r.prompt, r.params)
        for r in reqs:
            self.add(r)
        while self.has_work():
            self.step()
        return [self.completion(r) for r in reqs]


# ----------------------------------------------------------------------------- a worker thread for servers


class RequestStream:
    """One request's token events, produced on the engine's thread, read with ``for`` or ``async for``."""

    def __init__(self, worker: EngineWorker, request: Request, text: bool = True) -> None:
        self.worker = worker
        self.request = request
        self.text = text  # fill TokenEvent.text (a decode per token); off for callers that want ids only
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._closed = False
        self._finished = threading.Event()
        self._text = ""

    # producer side (the engine thread)
    def _push(self, req: Request, ev: TokenEvent | None) -> None:
        with self._cond:
            if ev is not None:
                self._events.append(ev)
            if req.done:
                self._closed = True
                self._finished.set()
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    # consumer side
    def cancel(self) -> None:
        """Stop generating (a client went away): the row is freed at the next step."""
        self.worker.cancel(self.request)

    def _next_ready(self) -> TokenEvent | None:
        """The next event with its text delta, or None when there is none yet; StopIteration at the end."""
        if self._events:
            ev = self._events.popleft()
            return self._with_text(ev) if self.text else ev
        if self._closed:
            if self.request.error is not None:
                raise self.request.error
            raise StopIteration
        return None

    def _with_text(self, ev: TokenEvent) -> TokenEvent:
        """Fill ``ev.text`` with the new text (held back while it ends in an incomplete character)."""
        r = self.request
        if ev.token is None and not self._events and r.done:
            tail = self.worker.engine.gen.continuation(r.prompt, r.ids)[len(self._text) :]
            self._text += tail
            ev.text = tail
            return ev
        n = len(r.ids) - len(self._events)  # tokens up to and including ev
        full = self.worker.engine.gen.continuation(r.prompt, r.ids[:n])
        if ev.finish_reason is None and full.endswith("\ufffd"):
            return ev
        ev.text = full[len(self._text) :]
        self._text = full
        return ev

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> TokenEvent:
        with self._cond:
            while True:
                ev = self._next_ready()
                if ev is not None:
                    return ev
                self._cond.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        while True:
            with self._cond:
                try:
                    ev = self._next_ready()
                except StopIteration:
                    raise StopAsyncIteration from None
                if ev is not None:
                    return ev
                event = asyncio.Event()
                self._waiters.append((asyncio.get_running_loop(), event))
            await event.wait()

    def result(self) -> Completion:
        """Block until the request is finished; its :class:`Completion` (raises the engine's error, if any).

        Waits for the end only (no wake-up per token, no text deltas): what a non-streaming caller needs.
        """
        self._finished.wait()
        if self.request.error is not None:
            raise self.request.error
        return self.worker.engine.completion(self.request)

    async def completion(self) -> Completion:
        async for _ in self:
            pass
        return self.worker.engine.completion(self.request)


class EngineWorker:
    """An :class:`Engine` on its own thread: the one owner of the model in a server."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="snakellm-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        prompt_logprobs: bool = False,
        text: bool = True,
    ) -> RequestStream:
        """Queue a request (thread-safe); GenerationError / RequestTooLarge raised here, before any streaming."""
        self.engine.check(list(prompt), params)
        req = Request(list(prompt), params, params.seed if seed is None else seed, prompt_logprobs)
        stream = RequestStream(self, req, text)
        req.sink = stream._push
        with self._cond:
            if self._stop:
                raise GenerationError("the engine is shut down")
            self._inbox.append(req)
            self._cond.notify()
        return stream

    def cancel(self, req: Request) -> None:
        with self._cond:
            req.cancelled = True
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not (self._stop or self._inbox or eng.has_work()):
                    self._cond.wait()
                if self._stop:
                    eng.fail_all(GenerationError("the engine is shut down"))
                    for r in self._inbox:
                        r.error = GenerationError("the engine is shut down")
                        eng._finish(r, "error")
                    return
                inbox, self._inbox = self._inbox, []
            for r in inbox:
                try:
                    eng.add(r)
                except GenerationError as e:  # checked at submit; kept for safety
                    r.error = e
                    eng._finish(r, "error")
            try:
                eng.step()
            except Exception as e:  # a device error: every request in flight fails with it, the loop goes on
                eng.fail_all(e)
