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
        r"FSDP2-wrapped module \(FSDP(LanguageModelEmbedding|SnakeGPTModel)\) returned a view tensor.*",
        r"torch\.distributed\.fsdp\..*",
        "FSDP2 (torch 2.13) warns of any view a unit returns: megatron-core's embedding and the GPT's per-token "
        "loss are transposes, and nothing changes them in place (megatron-core's block makes its input viewless); "
        "tests/test_finetune_fsdp_cpu.py and test_fsdp_cpu.py give the unsharded run's losses and gradient norms",
    ),
    (
        r".*(deprecat|will be removed).*",
        r"(megatron|torch|transformers|torchao|tqdm|pydantic|jsonschema|datasets|huggingface_hub)(\..*)?",
        "a library's API deprecation inside another library (or in megatron-core's use of torch): "
        "nothing the user can change; our own code is kept free of deprecated calls by the tests",
    ),
)

# messages logged by libraries (python logging) that are the same kind of noise as NOISE: the
# fallbacks, deprecations inside libraries (torch's pytree on torchao's enums), torchao's CUDA
# kernels that a CPU machine cannot load
LOG_NOISE: tuple[str, ...] = (
    r".*(Transformer Engine|TransformerEngine|Apex|apex).*",
    r".*deprecat.*",
    r"Failed to load .*torchao.*\.so.*",
)
# messages a library logs once per document: the first is shown, the rest say nothing new
# (lm-eval truncating a context longer than the model's sequence length)
LOG_ONCE: tuple[str, ...] = (r"Combined length of context .* exceeds model's maximum length .*",)
# loggers with handlers of their own (torch's) or whose records the filters must see wherever they go:
# a filter on the logger itself applies before any handler
LOGGERS: tuple[str, ...] = ("torch.utils._pytree", "torchao", "lm_eval.models.huggingface", "lm_eval.api.task")


# libraries whose INFO records are bookkeeping ("Detected Megatron Core, using Megatron-FSDP with
# Megatron."): shown only at WARNING and above, where a step sets up logging at INFO (serve)
INFO_CHATTER: tuple[str, ...] = ("megatron", "megatron_fsdp")


def verbose() -> bool:
    """Whether ``--verbose`` (or ``SNAKELLM_VERBOSE=1``) asked for every library message."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def _any(patterns: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.S)


class _DropNoise(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._noise, self._once = _any(LOG_NOISE), [re.compile(p, re.S) for p in LOG_ONCE]
        self._seen: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        # a record passes a logger's filter, then a handler's: judged once
        if record.levelno >= logging.ERROR or record.name.startswith("snakellm") or hasattr(record, "snakellm_kept"):
            return True
        try:
            message = record.getMessage()
        except Exception:  # a library's bad format args: let logging report it as usual
            return True
        if self._noise.fullmatch(message):
            return False
        for i, once in enumerate(self._once):
            if once.fullmatch(message):
                if i in self._seen:
                    return False
                self._seen.add(i)
                record.msg, record.args = f"{message} (once; later ones like it not shown)", None
        record.snakellm_kept = True
        return True


def install(verbose_flag: bool = False) -> None:
    """Silence :data:`NOISE` in this process (``verbose_flag`` or the environment: silence nothing).

    Safe to call again (the warnings module keeps one copy of a filter; a handler gets one log filter).
    """
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    if verbose():
        return
    # datasets draws a progress bar for each split it reads from a local jsonl (lm-eval's tasks): a blink
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for message, module, _why in NOISE:
        warnings.filterwarnings("ignore", message=message, module=module)
    # library loggers without handlers of their own end at logging.lastResort (stderr, WARNING)
    drop = _DropNoise()
    filterers = [logging.lastResort, *logging.getLogger().handlers, *map(logging.getLogger, LOGGERS)]
    for f in filterers:
        if f is not None and not any(isinstance(x, _DropNoise) for x in f.filters):
            f.addFilter(drop)
    for name in INFO_CHATTER:
        lib = logging.getLogger(name)
        if lib.level == logging.NOTSET:
            lib.setLevel(logging.WARNING)
