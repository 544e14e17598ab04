"""GPT models on megatron-core: settings, presets, counts (torch-free) and the build/load API.

Importing this package is cheap and torch-free (the Snakefile and the config
checks use it). :func:`build_model`, :func:`load` and :func:`save_model_checkpoint`
import torch and megatron-core on first use.

The one public way to get a trained model back::

    from snakellm.models import load

    m = load("runs/tiny")                 # or runs/tiny/checkpoints, or .../iter_0000300
    m.model        # megatron-core GPTModel, eval mode
    m.arch         # the resolved architecture (ModelSettings keys)
    m.tokenizer    # the tokenizer description recorded with the run
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from snakellm.models.architecture import (
    MODEL_KEYS,
    PRESETS,
    STYLES,
    ModelConfigError,
    ModelSettings,
    check_parallel,
    check_pipeline,
    check_pipeline_batches,
    check_recompute,
    describe,
    grad_reduce_conflict,
    padded_vocab_size,
    parallel_conflict,
    resolve,
)
from snakellm.models.counts import flops_per_token, param_count

if TYPE_CHECKING:
    from snakellm.models.build import build_model
    from snakellm.models.loading import LoadedModel, load, save_model_checkpoint

__all__ = [
    "MODEL_KEYS",
    "PRESETS",
    "STYLES",
    "LoadedModel",
    "ModelConfigError",
    "ModelSettings",
    "build_model",
    "check_parallel",
    "check_pipeline",
    "check_pipeline_batches",
    "parallel_conflict",
    "check_recompute",
    "describe",
    "flops_per_token",
    "grad_reduce_conflict",
    "load",
    "padded_vocab_size",
    "param_count",
    "resolve",
    "save_model_checkpoint",
]

_LAZY = {
    "build_model": "snakellm.models.build",
    "load": "snakellm.models.loading",
    "LoadedModel": "snakellm.models.loading",
    "save_model_checkpoint": "snakellm.models.loading",
}


def __getattr__(name: str) -> Any:
    """The torch-importing parts, on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'snakellm.models' has no attribute {name!r}")
