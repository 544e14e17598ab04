"""What snakellm changes about imports in its own processes (installed by ``import snakellm``).

megatron-core imports ``wandb`` at module level, in three places (its timers and its dynamic inference
engine and context, each inside ``try: import wandb / except ImportError``), for logging that snakellm
never asks it for; ``wandb`` costs ~0.7 s of CPU to import, of the ~8 s every process that builds a model
spends on imports (measured here: ``import megatron.core.models.gpt`` 8.66 -> 7.98 s). So those imports
alone are refused: megatron-core then runs as it does where wandb is not installed. Everything else,
snakellm's own W&B tracking (:mod:`snakellm.tracking`) included, imports ``wandb`` as usual, and a process
that imported ``wandb`` before megatron-core hands megatron-core the same module.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

_IMPORT_MACHINERY = ("importlib", "_frozen_importlib")


class MegatronWithoutWandb:
    """A ``sys.meta_path`` finder: ``import wandb`` executed by a ``megatron.core.*`` module raises ImportError
    (Megatron-LM's ``megatron.training``, which logs to W&B when asked, imports it as usual)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name != "wandb":
            return None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:  # up through the import machinery to the module that runs the import
            module = frame.f_globals.get("__name__", "")
            if not module.startswith(_IMPORT_MACHINERY):
                if module.startswith("megatron.core."):
                    raise ModuleNotFoundError("wandb: not imported for megatron-core (snakellm._imports)")
                return None
            frame = frame.f_back
        return None


def install() -> None:
    if not any(isinstance(f, MegatronWithoutWandb) for f in sys.meta_path):
        sys.meta_path.insert(0, MegatronWithoutWandb())
