"""Cross-field config checks: keys checked against each other, before any job runs.

JSON-schema validation (:mod:`snakellm.config.validate`) checks each key alone;
these check what one key says about another (a fine-tune's base run exists, an
export can pack its run's tokenizer, an import's directory is a Hugging Face
model). Each raises :class:`~snakellm.errors.ConfigError` naming the key, so
``rules/common.smk`` reports "invalid config: config key ...: ..." and unit
tests call them directly, in milliseconds, without Snakemake. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from snakellm.config import jobs
from snakellm.config.resolve import check_tokenizers, resolve_runs
from snakellm.errors import ConfigError

# what NeMo packs as tokenizer artifacts
NEMO_TOKENIZER_KINDS = ("gpt2-bpe", "sentencepiece")


def _names(d: dict[str, Any]) -> str:
    return ", ".join(d) or "none"


def check_finetunes(config: dict[str, Any]) -> None:
    """A fine-tune names a known base (run or import) and data set, and a batch its micro batch divides."""
    runs, imports, sft = config.get("runs", {}), config.get("import_hf", {}), config.get("sft_data", {})
    bases = list(runs) + list(imports)
    for name, ft in config.get("finetune", {}).items():
        if ft["run"] not in bases:
            raise ConfigError(
                f"config key finetune.{name}.run: unknown run {ft['run']!r} "
                f"(runs and import_hf: {', '.join(bases) or 'none'})"
            )
        if ft["data"] not in sft:
            raise ConfigError(
                f"config key finetune.{name}.data: unknown sft_data {ft['data']!r} (sft_data: {_names(sft)})"
            )
        t = ft["train"]
        if t["global_batch_size"] % t["micro_batch_size"]:
            raise ConfigError(
                f"config key finetune.{name}.train: global_batch_size {t['global_batch_size']} is not "
                f"a multiple of micro_batch_size {t['micro_batch_size']}"
            )


def check_resources(config: dict[str, Any], env: Mapping[str, str] | None = None) -> None:
    """Every GPU stage's allocation fits its parallelism (tp x pp divides the ranks, the global batch splits
    over the data-parallel ranks) before anything is submitted; ``env``: the site defaults (Slurm only)."""
    for name, run in config.get("runs", {}).items():
        par, t = run.get("parallel", {}), run["train"]
        jobs.check_allocation(
            jobs.allocation(config, "pretrain", name, env),
            par.get("tp", 1),
            par.get("pp", 1),
            (t["global_batch_size"], t["micro_batch_size"]),
            slurm=env is not None,
        )
    for name, ft in config.get("finetune", {}).items():
        t = ft["train"]
        jobs.check_allocation(
            jobs.allocation(config, "finetune", name, env),
            ft.get("parallel", {}).get("tp", 1),
            1,
            (t.get("global_batch_size", 8), t.get("micro_batch_size", 4)),
            slurm=env is not None,
        )
    for stage, entries in jobs.STAGES.items():
        if entries is None:
            jobs.check_allocation(jobs.allocation(config, stage, None, env), slurm=env is not None)


def check_export_nemo(config: dict[str, Any]) -> None:
    """A .nemo packs only gpt2-bpe or sentencepiece tokenizers: an export that cannot work fails before training."""
    if not config.get("export_nemo", {}).get("enabled", True):
        return
    tokenizers = config.get("tokenizers", {})
    for name, run in config.get("runs", {}).items():
        kind = tokenizers[run["tokenizer"]]["kind"]
        if kind not in NEMO_TOKENIZER_KINDS:
            raise ConfigError(
                f"config key runs.{name}.tokenizer: a .nemo packs only gpt2-bpe or sentencepiece "
                f"tokenizers, {run['tokenizer']!r} is {kind} (set export_nemo.enabled: false to skip the .nemo)"
            )


def check_imports(config: dict[str, Any]) -> None:
    """An import is not named like a run, and its directory holds a Hugging Face config.json."""
    runs = config.get("runs", {})
    for name, spec in config.get("import_hf", {}).items():
        if name in runs:
            raise ConfigError(f"config key import_hf.{name}: a run of that name exists under runs")
        if not os.path.isfile(os.path.join(spec["hf_dir"], "config.json")):
            raise ConfigError(
                f"config key import_hf.{name}.hf_dir: {spec['hf_dir']!r} has no config.json "
                "(not a Hugging Face model directory)"
            )


def check_hf_exports(config: dict[str, Any], run_models: dict[str, dict[str, Any]]) -> None:
    """Every run's architecture has a Hugging Face class that computes exactly what it does."""
    if not config.get("export_hf", {}).get("enabled", True):
        return
    from snakellm.models import families

    for name, arch in run_models.items():
        try:
            families.for_arch(arch)
        except families.FamilyError as e:
            raise ConfigError(f"config key runs.{name}.model: Hugging Face export: {e}") from None


def import_tokenizer_kind(hf_dir: str) -> str:
    """What import-hf will make of an HF directory's tokenizer (snakellm/export/hf_tokenizer.py)."""

    def has(f: str) -> bool:
        return os.path.isfile(os.path.join(hf_dir, f))

    if has("vocab.json") and has("merges.txt"):
        return "gpt2-bpe"
    return "sentencepiece" if has("tokenizer.model") else "huggingface"


def check_config(config: dict[str, Any], env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every cross-field check, in the order a reader meets the sections; returns each run's architecture.

    ``env``: the environment whose site defaults the job allocations take (under the Slurm profile).
    """
    check_tokenizers(config)
    run_models = resolve_runs(config)
    check_finetunes(config)
    check_resources(config, env)
    check_export_nemo(config)
    check_imports(config)
    check_hf_exports(config, run_models)
    return run_models
