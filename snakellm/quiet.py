"""Library chatter a snakellm user can do nothing about, silenced once for every step.

``snakellm <step>`` calls :func:`install` before it imports the step (and so torch,
megatron-core, transformers): what is left on stderr is ours (progress bars, ``[time]
run ...`` lines, ``snakellm <step>: ...`` messages) or a warning the user can act on.
``snakellm --verbose <step>`` (or ``SNAKELLM_VERBOSE=1`` in the environment, which
``--verbose`` sets so that the step's own child processes see it too) shows everything.

Each entry of :data:`NOISE` says why it tells the user nothing. A warning is silenced
by its message and the library that raises it, never by category alone, so a new
warning of a library still shows until someone decides here that it is noise.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

VERBOSE_ENV = "SNAKELLM_VERBOSE"

# (message regex, module regex of where it is raised, why it is noise)
NOISE: tuple[tuple[str, str, str], ...] = (
    (
        r".*(Transformer Engine|TransformerEngine|Apex|apex).*",
        r"megatron\..*",
        "megatron-core says on import that it falls back to torch code without them: on a CPU (and a GPU "
        "without them) that is the configuration we chose; snakellm's own run line names the layer spec",
    ),
    (
        r"full scope is deprecated.*cuda_graph_scope.*",
        r"megatron\..*",
        "megatron-core's TransformerConfig default, not a setting of ours (we set no CUDA graph scope)",
    ),
    (
        r".*(deprecat|will be removed).*",
        r"(megatron|torch|transformers|torchao|tqdm|pydantic|jsonschema|datasets|huggingface_hub)(\..*)?",
        "a library's API deprecation inside another library (or in megatron-core's use of torch): "
        "nothing the user can change; our own code is kept free of deprecated calls by the tests",
    ),
)

# messages logged by libraries (python logging) that are the same kind of noise as NOISE
LOG_NOISE: tuple[str, ...] = (r".*(Transformer Engine|TransformerEngine|Apex|apex).*",)


# libraries whose INFO records are bookkeeping ("Detected Megatron Core, using Megatron-FSDP with
# Megatron."): shown only at WARNING and above, where a step sets up logging at INFO (serve)
INFO_CHATTER: tuple[str, ...] = ("megatron", "megatron_fsdp")


def verbose() -> bool:
    """Whether ``--verbose`` (or ``SNAKELLM_VERBOSE=1``) asked for every library message."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropNoise(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self._re = re.compile("|".join(f"(?:{p})" for p in patterns), re.S)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.startswith("snakellm"):
            return True
        try:
            return not self._re.fullmatch(record.getMessage())
        except Exception:  # a library's bad format args: let logging report it as usual
            return True


def install(verbose_flag: bool = False) -> None:
    """Silence :data:`NOISE` in this process (``verbose_flag`` or the environment: silence nothing).

    Safe to call again (the warnings module keeps one copy of a filter; a handler gets one log filter).
    """
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    for message, module, _why in NOISE:
        warnings.filterwarnings("ignore", message=message, module=module)
    # library loggers without handlers of their own end at logging.lastResort (stderr, WARNING)
    handlers = [logging.lastResort, *logging.getLogger().handlers]
    for h in handlers:
        if h is not None and not any(isinstance(f, _DropNoise) for f in h.filters):
            h.addFilter(_DropNoise(LOG_NOISE))
    for name in INFO_CHATTER:
        lib = logging.getLogger(name)
        if lib.level == logging.NOTSET:
            lib.setLevel(logging.WARNING)
