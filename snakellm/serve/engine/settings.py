"""Engine settings: the one source of the fast decode path's knobs and their defaults.

:class:`EngineSettings` is a settings dataclass (``setting()`` fields): the
server and ``snakellm generate`` take its flags through
:func:`snakellm.config.settings.add_arguments`, so each default is written
once, here.
"""

from __future__ import annotations

from dataclasses import dataclass

from snakellm.config.settings import setting


@dataclass(frozen=True)
class EngineSettings:
    """The continuous-batching engine: KV-cache budget, batch size, CUDA graphs."""

    max_batch: int = setting(32, "rows decoded together at most (requests beyond it wait for a free row)")
    max_seq_len: int | None = setting(
        None, "tokens (prompt + new) one request may hold in the KV cache (default: the model's sequence length)"
    )
    kv_cache_memory: str = setting(
        "0.9",
        "KV-cache budget: a fraction of the free device memory after loading the model (0.9), or bytes "
        "(8000000000, 8GB, 512MiB); requests wait for room, one that can never fit is refused (HTTP 413)",
    )
    prefill_tokens: int = setting(
        8192, "prompt tokens (rows x longest prompt) prefilled in one forward when requests join the batch"
    )
    cuda_graphs: bool = setting(True, "capture the decode step in CUDA graphs per batch-size bucket (GPU only)")
    fused_max_batch: int = setting(
        1,
        "decode steps of up to this many rows (0-32; 0: off) run fused Triton kernels, five per layer, and larger "
        "ones cuBLAS around the fused attention kernel (GPU, bf16/fp16 models); on an H200 the fused step doubles "
        "batch 1's speed and loses to cuBLAS from 4 rows up (llama-1b; at 8B 7.5 vs 5.5 ms a step at 16 rows, "
        "9.3 vs 6.0 at 32)",
    )
    compile: bool = setting(
        False,
        "torch.compile the decode step before capturing it (slower start; at 8B on an H200 it measured slower "
        "than the default step: docs/benchmarks.md)",
    )
