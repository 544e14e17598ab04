"""The fast generation engine: static KV cache, CUDA-graph decode steps, continuous batching.

* :mod:`.static_cache`: the preallocated cache and its memory budget;
* :mod:`.fast_decoder`: batched prefill and the capturable decode step;
* :mod:`.kernels`: the fused Triton decode step for small batches (GPU; imported only there);
* :mod:`.sampling`: per-row sampling on the device (no host sync per token);
* :mod:`.scheduler`: :class:`Engine` (continuous batching) and :class:`EngineWorker`
  (its thread, with per-request token streams for servers).

The eager :class:`snakellm.serve.generate.Generator` stays the reference (and
the path for scoring); the tests hold the two to the same greedy tokens.
"""

from snakellm.serve.engine.scheduler import (
    Engine,
    EngineWorker,
    Request,
    RequestStream,
    RequestTooLarge,
    TokenEvent,
)
from snakellm.serve.engine.settings import EngineSettings

__all__ = [
    "Engine",
    "EngineSettings",
    "EngineWorker",
    "Request",
    "RequestStream",
    "RequestTooLarge",
    "TokenEvent",
]
