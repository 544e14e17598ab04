"""The server's model worker on the engine: requests from different clients share the running batch.

The HTTP layer hands each request to ``await worker.run(job)`` where ``job`` is a
function of a :class:`~snakellm.serve.generate.Generator` (serve/worker.py).
:class:`BatchingWorker` keeps that contract but runs jobs on many threads at
once, each with an :class:`EngineGenerator`: the Generator's API whose
``generate`` submits every prompt to one :class:`EngineWorker` (the scheduler
thread that owns the decode step) and waits for its rows. So concurrent
requests join one continuously batched decode instead of queueing for the
model. A request that times out or whose client leaves has its rows cancelled
(their cache rows are freed at the next step); one that can never fit a cache
row is answered 413.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from snakellm.serve.engine.scheduler import Engine, EngineWorker, RequestStream, RequestTooLarge
from snakellm.serve.engine.settings import EngineSettings
from snakellm.serve.generate import Completion, SamplingParams
from snakellm.serve.worker import Abandoned, ModelWorker, _consume

T = TypeVar("T")


class _HostRow(list):
    """One step's values per row, as ``on_step`` reads them (``.tolist()``), without a tensor per step:
    tensors made on the many request threads would each grow that thread's malloc arena."""

    def tolist(self) -> list:
        return list(self)


class EngineGenerator:
    """A Generator whose ``generate`` goes through the shared engine; everything else is the Generator's."""

    def __init__(self, gen: Any, worker: EngineWorker, model_thread: ThreadPoolExecutor, gone: threading.Event) -> None:
        self._gen = gen
        self._worker = worker
        self._model_thread = model_thread
        self._gone = gone  # set when the request gives up (timeout, client gone)
        self._streams: list[RequestStream] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gen, name)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        add_bos: bool = False,
        prompt_logprobs: bool = False,
        on_step: Callable[[int, Any, Any], None] | None = None,
    ) -> list[Completion]:
        """The rows of one request, each its own engine request (seed ``seed + i``), in order.

        ``on_step(step, tokens, done)`` as :meth:`Generator.generate` calls it: the rows' ``step``-th
        tokens (EOD for a row that has ended) once every running row has one.
        """
        from snakellm.serve.errors import APIError

        params.check()
        batch = self._gen.encode(prompts, add_bos)
        if not batch:
            return []
        self._gen._check_batch(batch, params)  # the eager decoder's checks and messages
        try:
            for p in batch:
                self._worker.engine.check(p, params)
        except RequestTooLarge as e:
            raise APIError(413, str(e), e.field) from None
        if self._gone.is_set():
            raise Abandoned()
        streams = [
            self._worker.submit(p, params, None if params.seed is None else params.seed + i, prompt_logprobs, False)
            for i, p in enumerate(batch)
        ]
        self._streams += streams
        if self._gone.is_set():  # gave up while submitting
            self.cancel()
        try:
            self._follow(streams, on_step)
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        if any(s.request.finish_reason == "cancelled" for s in streams):
            raise Abandoned()
        return [s.result() for s in streams]

    def _follow(self, streams: list[RequestStream], on_step: Callable[[int, Any, Any], None] | None) -> None:
        """Read the rows' tokens in step with each other until all have ended (or the request gave up)."""
        eod = self._gen.tok.eod_id
        done = [False] * len(streams)
        step = 0
        while not all(done):
            tokens = []
            for i, s in enumerate(streams):
                ev = None if done[i] else next(s, None)
                if ev is None or ev.token is None:
                    done[i] = True
                    tokens.append(eod)
                    continue
                tokens.append(ev.token)
                done[i] = ev.finish_reason is not None
            if self._gone.is_set():
                raise Abandoned()
            if on_step is not None:
                on_step(step, _HostRow(tokens), _HostRow(done))
            step += 1

    def cancel(self) -> None:
        """Stop this request's rows now (waiting ones never start; running ones free their row)."""
        self._gone.set()
        for s in list(self._streams):
            s.cancel()

    def score(self, rows: Sequence[Sequence[int]], full: bool = False) -> Any:
        """The Generator's scoring forward, on the one model thread (tensor work stays on one thread)."""
        return self._model_thread.submit(self._gen.score, rows, full).result()


class BatchingWorker(ModelWorker):
    """``await run(job)`` as :class:`ModelWorker`, with up to ``max_jobs`` jobs running concurrently over one engine."""

    def __init__(self, gen: Any, settings: EngineSettings | None = None, max_jobs: int = 64) -> None:
        super().__init__(gen)
        self._model_thread = self._pool  # the base class's one model thread: scoring runs there
        self._pool = ThreadPoolExecutor(max_workers=max_jobs, thread_name_prefix="snakellm-request")
        started = threading.Barrier(max_jobs + 1)
        for _ in range(max_jobs):  # start them all now: a server's thread count stays flat under load
            self._pool.submit(started.wait)
        started.wait()
        self.engine_worker = EngineWorker(Engine(gen, settings))

    async def run(
        self, job: Callable[[Any], T], timeout: float | None = None, cancel: threading.Event | None = None
    ) -> T:
        """``job(generator)`` on a request thread; its rows are cancelled if the request gives up."""
        gone = cancel or threading.Event()
        view = EngineGenerator(self.gen, self.engine_worker, self._model_thread, gone)

        def call() -> T:
            if gone.is_set():
                raise Abandoned()
            return job(view)

        fut = asyncio.get_running_loop().run_in_executor(self._pool, call)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except (TimeoutError, asyncio.CancelledError):
            view.cancel()
            fut.add_done_callback(_consume)
            raise

    def close(self) -> None:
        self.engine_worker.close()
        self._model_thread.shutdown(wait=False, cancel_futures=True)
        super().close()
