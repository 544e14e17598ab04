"""Training settings: ``runs.*.train`` and ``runs.*.parallel`` (defined in :mod:`snakellm.config.sections`).

Kept as the trainer's import point: :data:`TRAJECTORY_KEYS` are the settings
that enter the fingerprint stored with checkpoints; the dataclasses and the
framework (:func:`setting`, :func:`add_arguments`, :func:`to_flags` ...) live in
the torch-free config package, so that the Snakefile, the schema test and
``snakellm train`` read one source.
"""

from __future__ import annotations

from snakellm.config.sections import ParallelSettings, ResumeSettings, TrainSettings
from snakellm.config.settings import (
    REQUIRED,
    add_arguments,
    defaults,
    from_namespace,
    setting,
    to_flags,
    trajectory_keys,
)

# The framework's names stay importable from here (their first home) for code written against it.
__all__ = [
    "REQUIRED",
    "TRAJECTORY_KEYS",
    "ParallelSettings",
    "ResumeSettings",
    "TrainSettings",
    "add_arguments",
    "defaults",
    "from_namespace",
    "setting",
    "to_flags",
]

TRAJECTORY_KEYS: tuple[str, ...] = trajectory_keys(TrainSettings)
