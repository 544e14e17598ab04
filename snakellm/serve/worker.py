"""The model worker: the one place requests meet the model.

Every request handler hands a job (a function of the :class:`Generator`) to
:meth:`ModelWorker.run` and awaits its result. Today one thread owns the model
and runs jobs one at a time, in arrival order, so two requests never share a
batch or a cache. Continuous batching (issue #22) replaces this class with a
scheduler behind the same ``await worker.run(job)``; the HTTP layer does not
change.

A job whose request has timed out or whose client went away before the job
started is skipped, so a queue of abandoned requests does not keep the model
busy.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from snakellm.errors import StepFailed

T = TypeVar("T")


class Abandoned(StepFailed):
    """The request gave up before its job reached the model."""


class ModelWorker:
    """One thread owns the model; jobs run in arrival order."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.started = time.time()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snakellm-model")
        self.busy = threading.Lock()  # held while a job runs (for /health and the tests)

    async def run(
        self, job: Callable[[Any], T], timeout: float | None = None, cancel: threading.Event | None = None
    ) -> T:
        """``job(generator)`` on the model thread; ``TimeoutError`` after ``timeout`` seconds.

        ``cancel`` is set when the request gives up: a job that watches it (the engine's ``on_step``)
        stops generating, so an abandoned request frees the model.
        """
        cancelled = cancel or threading.Event()

        def call() -> T:
            if cancelled.is_set():
                raise Abandoned()
            with self.busy:
                return job(self.gen)

        fut = asyncio.get_running_loop().run_in_executor(self._pool, call)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except (TimeoutError, asyncio.CancelledError):
            cancelled.set()  # not started yet: skipped; running: finishes, its result is dropped
            fut.add_done_callback(_consume)
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a dropped job's outcome so that asyncio does not log 'exception never retrieved'."""
    if not fut.cancelled():
        fut.exception()
