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


class EngineGenerator:
    """A Generator whose ``generate`` goes through the shared engine; everything else is the Generator's."""

    def __init__(self, gen: Any, worker: EngineWorker, model_thread: ThreadPoolExecutor) -> None:
        self._gen = gen
        self._worker = worker
        self._model_thread = model_thread
        self._streams: list[RequestStream] = []
        self._lock = threading.Lock()
        self._cancelled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gen, name)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        add_bos: bool = False,
        prompt_logprobs: bool = False,
    ) -> list[Completion]:
        """The rows of one request, each its own engine request (seed ``seed + i``), in order."""
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
        streams = []
        with self._lock:
            if self._cancelled:
                raise Abandoned()
            for i, p in enumerate(batch):
                seed = None if params.seed is None else params.seed + i
                streams.append(self._worker.submit(p, params, seed=seed, prompt_logprobs=prompt_logprobs))
            self._streams += streams
        out = [s.result() for s in streams]
        if any(s.request.finish_reason == "cancelled" for s in streams):
            raise Abandoned()
        return out

    def score(self, rows: Sequence[Sequence[int]], full: bool = False) -> Any:
        """The Generator's scoring forward, on the one model thread (tensor work stays on one thread)."""
        return self._model_thread.submit(self._gen.score, rows, full).result()

    def cancel(self) -> None:
        """Stop this request's rows (the client left or the request timed out)."""
        with self._lock:
            self._cancelled = True
            for s in self._streams:
                s.cancel()


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

    async def run(self, job: Callable[[Any], T], timeout: float | None = None) -> T:
        """``job(generator)`` on a request thread; its rows are cancelled if the request gives up."""
        view = EngineGenerator(self.gen, self.engine_worker, self._model_thread)

        def call() -> T:
            if view._cancelled:
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
