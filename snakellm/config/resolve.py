"""Cross-field config checks and run resolution, torch-free (what the Snakefile needs at parse time).

JSON-schema validation (:mod:`snakellm.config.validate`) checks each key alone;
this module checks keys against each other (a run's tokenizer exists, its model
splits over its tensor-parallel size, a trained tokenizer samples known
sources) and resolves each run to its complete architecture and its
``snakellm train`` flags. ``rules/common.smk`` calls these once per Snakemake
start; unit tests call them directly, in milliseconds.
"""

from __future__ import annotations

from typing import Any

from snakellm import models
from snakellm.config.sections import ParallelSettings, TrainSettings
from snakellm.config.settings import to_flags
from snakellm.config.validate import ConfigError
from snakellm.models import moe


def check_tokenizers(config: dict[str, Any]) -> None:
    """``tokenize.tokenizers`` names configured tokenizers; only untrained SentencePiece has ``train``."""
    tokenizers, sources = config.get("tokenizers", {}), config.get("sources", {})
    tokenized = config.get("tokenize", {}).get("tokenizers", list(tokenizers))
    for name in tokenized:
        if name not in tokenizers:
            raise ConfigError(
                f"config key tokenize.tokenizers: unknown tokenizer {name!r} "
                f"(configured: {', '.join(tokenizers) or 'none'})"
            )
    for name, t in tokenizers.items():
        if "train" in t and not (t["kind"] == "sentencepiece" and "model_file" not in t):
            raise ConfigError(
                f"config key tokenizers.{name}.train: only a sentencepiece tokenizer without model_file is trained"
            )
        for s in t.get("train", {}).get("sample", {}).get("sources", []):
            if s not in sources:
                raise ConfigError(f"config key tokenizers.{name}.train.sample.sources: unknown source {s!r}")
    if not sources and (config.get("runs") or tokenized):
        what = f"runs {', '.join(config['runs'])}" if config.get("runs") else f"tokenizers {', '.join(tokenized)}"
        raise ConfigError(
            f"config key sources: {what} need a corpus; configure at least one source "
            "(only a config that imports and fine-tunes needs none)"
        )


# how a config message names the setting at fault of models.parallel_conflict (the step names its flag)
_PARALLEL_SUBJECTS = {
    "sequence_parallel": "sequence parallelism",
    "overlap_param_gather": "overlap_param_gather",
    "fsdp": "FSDP",
    "fp8_all_gather": "the float8 all-gather",
    "distributed_optimizer": "the distributed optimizer",
}


def check_parallel_conflict(where: str, par: dict[str, Any]) -> None:
    """A ConfigError naming ``{where}.parallel.<key>`` for the first settings of ``par`` that cannot go
    together (:func:`snakellm.models.parallel_conflict`: runs' and fine-tunes' one rule)."""
    conflict = models.parallel_conflict(par)
    if conflict:
        key, why = conflict
        raise ConfigError(f"config key {where}.parallel.{key}: {_PARALLEL_SUBJECTS[key]} {why}")


def resolve_run(name: str, run: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    """A run's complete architecture (preset expanded), checked against its tokenizer and parallelism."""
    if run["tokenizer"] not in tokenizers:
        raise ConfigError(
            f"config key runs.{name}.tokenizer: unknown tokenizer {run['tokenizer']!r} "
            f"(configured: {', '.join(tokenizers) or 'none'})"
        )
    model = dict(run.get("model", {}))
    par = run.get("parallel", {})
    try:
        arch = models.resolve(model.pop("preset", None), model)
        models.check_parallel(arch, par.get("tp", 1), 1)
    except models.ModelConfigError as e:
        raise ConfigError(f"config key runs.{name}.model: {e}") from None
    pp, vpp = par.get("pp", 1), par.get("virtual_pp", 1)
    try:
        models.check_pipeline(arch, pp, vpp)
        models.check_recompute(
            arch,
            pp,
            vpp,
            par.get("recompute", "none"),
            par.get("recompute_method", "uniform"),
            par.get("recompute_num_layers", 1),
        )
    except models.ModelConfigError as e:
        raise ConfigError(f"config key runs.{name}.parallel: {e}") from None
    check_parallel_conflict(f"runs.{name}", par)
    why = moe.check_tp(arch, par.get("tp", 1), bool(par.get("sequence_parallel")), lambda k: f"parallel.{k}")
    if why:
        raise ConfigError(f"config key runs.{name}.parallel.sequence_parallel: {why}")
    return arch


def resolve_runs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every run's architecture, by name (the first problem raises ConfigError naming the key)."""
    return {name: resolve_run(name, run, config.get("tokenizers", {})) for name, run in config.get("runs", {}).items()}


def train_flags(run: dict[str, Any], arch: dict[str, Any]) -> str:
    """Every ``snakellm train`` setting of a run, spelled out and fully resolved (the preset expanded).

    The pretrain rule's params are this string, so a run reruns exactly when one
    of its own settings changes; whether old checkpoints are resumed is then
    decided by ``snakellm train`` from the settings stored with them.
    """
    arch_flags = to_flags(models.ModelSettings, arch)
    return " ".join(
        f
        for f in (
            arch_flags,
            to_flags(TrainSettings, run["train"]),
            # threads: the rule passes its own {threads}, which Snakemake may lower
            to_flags(ParallelSettings, run.get("parallel", {}), exclude=("threads",)),
        )
        if f
    )


def train_retries(config: dict[str, Any]) -> int | None:
    """The pretrain rule's ``retries``: the largest a run asks for; None leaves the profile's in force."""
    asked = [r["train"]["retries"] for r in config.get("runs", {}).values() if r["train"].get("retries") is not None]
    return max(asked) if asked else None
