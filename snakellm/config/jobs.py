"""The allocation of a GPU stage's jobs, from config: what `rules/common.smk` declares as resources.

One lookup for every GPU stage (``pretrain``, ``finetune``, ``evaluate``, ``generate``,
``convert``), each key taken from the first place that sets it:

1. the run's or fine-tune's own block (``runs.<name>.resources``, ``finetune.<name>.resources``);
2. the workflow's ``resources.<stage>``;
3. the site: the Slurm profile's environment variables (:data:`SITE`; only where the caller passes
   the environment, i.e. under ``profiles/slurm`` and in ``snakellm plan``);
4. the built-in default (:data:`BUILTIN`).

:func:`snakemake_resources` turns an :class:`Allocation` into the resources that
snakemake-executor-plugin-slurm maps to sbatch flags (``nodes``, ``gpu``, ``tasks``, ``mpi``,
``cpus_per_task``, ``mem_mb``, ``runtime``, ``slurm_partition`` ...), and
:func:`check_allocation` checks it against the job's parallelism before anything is submitted.
Torch-free: the Snakefile imports it at parse time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from snakellm.config.sections import JobResourceSettings
from snakellm.errors import ConfigError
from snakellm.models.architecture import check_pipeline_batches

# stage -> (config section of its entries, the rule's wildcard naming one), or None: stage-wide only
STAGES: dict[str, tuple[str, str] | None] = {
    "pretrain": ("runs", "run"),
    "finetune": ("finetune", "ft"),
    "evaluate": None,
    "generate": None,
    "convert": None,
}
TRAINING = ("pretrain", "finetune")  # multi-rank stages: srun, SIGUSR1 before the limit, the workflow's container

_COMMON = {"nodes": 1, "gpus_per_node": 1, "signal_s": 0}
BUILTIN: dict[str, dict[str, Any]] = {
    "pretrain": {**_COMMON, "time_limit": 240, "signal_s": 300, "mem_mb": 0},
    "finetune": {**_COMMON, "time_limit": 240, "signal_s": 300, "mem_mb": 0},
    "evaluate": dict(_COMMON),
    "generate": dict(_COMMON),
    "convert": {**_COMMON, "gpus_per_node": 0},
}
"""What a key is when nothing sets it (``mem_mb`` 0: the cluster's default). An unset time limit or memory of a
stage without one here is the profile's ``default-resources`` (the data jobs' 60 min / 4000 MB, doubled on each
retry)."""

# key -> (environment variable, the stages it is the site default of)
SITE: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "nodes": (("SNAKELLM_TRAIN_NODES", ("pretrain",)),),
    "gpus_per_node": (("SNAKELLM_TRAIN_GPUS_PER_NODE", ("pretrain",)),),
    "cpus_per_gpu": (("SNAKELLM_TRAIN_CPUS_PER_GPU", ("pretrain",)),),
    "mem_mb": (("SNAKELLM_TRAIN_MEM_MB", ("pretrain",)),),
    "time_limit": (("SNAKELLM_TRAIN_RUNTIME", ("pretrain",)),),
    "signal_s": (("SNAKELLM_TRAIN_SIGNAL_S", ("pretrain",)),),
    "partition": (
        ("SNAKELLM_SLURM_GPU_PARTITION", ("pretrain", "finetune", "evaluate", "generate")),
        ("SNAKELLM_SLURM_PARTITION", tuple(STAGES)),
    ),
    "account": (("SNAKELLM_SLURM_ACCOUNT", tuple(STAGES)),),
}
_INT_KEYS = ("nodes", "gpus_per_node", "cpus_per_gpu", "mem_mb", "signal_s")
KEYS = tuple(f.name for f in fields(JobResourceSettings))


def minutes(value: int | str) -> int:
    """A time limit as minutes: an int is minutes; ``[D-]HH:MM[:SS]`` is Slurm's spelling (seconds round up)."""
    if isinstance(value, int) or str(value).strip().isdigit():  # an environment variable's "240" too
        return int(value)
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{2})(?::(\d{2}))?", str(value).strip())
    if not m:
        raise ValueError(f"{value!r} is not minutes or [D-]HH:MM[:SS]")
    days, hours, mins, secs = (int(g or 0) for g in m.groups())
    return days * 1440 + hours * 60 + mins + (1 if secs else 0)


@dataclass(frozen=True)
class Allocation:
    """One job's allocation, every key resolved; ``where``: the config key that holds it (for messages)."""

    stage: str
    where: str
    nodes: int
    gpus_per_node: int
    cpus_per_gpu: int | None
    mem_mb: int | None
    time_limit: int | None  # minutes
    signal_s: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    sbatch_extra: str | None
    container: dict[str, Any] | None

    @property
    def ranks(self) -> int:
        """One rank per GPU; a CPU job (no GPUs) is one process."""
        return self.nodes * self.gpus_per_node if self.gpus_per_node else 1

    @property
    def size(self) -> str:
        """``8 nodes x 8 GPUs = 64 ranks`` (``1 node, no GPU`` for a CPU job)."""
        if not self.gpus_per_node:
            return f"{self.nodes} node, no GPU"
        return (
            f"{self.nodes} node{'s' if self.nodes != 1 else ''} x {self.gpus_per_node} GPU"
            f"{'s' if self.gpus_per_node != 1 else ''} = {self.ranks} rank{'s' if self.ranks != 1 else ''}"
        )

    def describe(self) -> str:
        """``8 nodes x 8 GPUs = 64 ranks, 8 CPUs per GPU, time limit 1440 min`` (what plan and dry runs print)."""
        parts = [self.size]
        parts += [f"{self.cpus_per_gpu} CPUs per GPU"] if self.cpus_per_gpu else []
        parts += [f"{self.mem_mb} MB per node"] if self.mem_mb else []
        parts += [f"time limit {self.time_limit} min"] if self.time_limit else []
        parts += [f"partition {self.partition}"] if self.partition else []
        image = (self.container or {}).get("image")
        parts += [f"container {image}"] if image and (self.container or {}).get("runtime", "none") != "none" else []
        return ", ".join(parts)


def _site(key: str, stage: str, env: Mapping[str, str]) -> Any:
    for var, stages in SITE.get(key, ()):
        if stage in stages and env.get(var):
            return env[var]
    return None


def allocation(
    config: Mapping[str, Any], stage: str, name: str | None = None, env: Mapping[str, str] | None = None
) -> Allocation:
    """The allocation of ``stage``'s job for entry ``name`` (a run or fine-tune; None: stage-wide only).

    ``env``: the site's environment variables (:data:`SITE`), or None where site defaults do not apply.
    """
    entry_where = STAGES[stage]
    own: Mapping[str, Any] = {}
    where = f"resources.{stage}"
    if entry_where and name is not None:
        own = config.get(entry_where[0], {}).get(name, {}).get("resources") or {}
        where = f"{entry_where[0]}.{name}.resources"
    stage_block = (config.get("resources") or {}).get(stage) or {}
    values: dict[str, Any] = {}
    for key in KEYS:
        v = own.get(key)
        if v is None:
            v = stage_block.get(key)
        if v is None and key != "container":
            v = _site(key, stage, env or {})
        if v is None:
            v = BUILTIN[stage].get(key)
        values[key] = v
    try:
        for key in _INT_KEYS:
            if values[key] is not None:
                values[key] = int(values[key])
        if values["time_limit"] is not None:
            values["time_limit"] = minutes(values["time_limit"])
    except ValueError as e:
        raise ConfigError(f"config key {where}: {e}") from None
    if values["container"] is None and stage in TRAINING:
        values["container"] = config.get("container") or None
    return Allocation(stage=stage, where=where, **values)


def snakemake_resources(a: Allocation, threads: int) -> dict[str, Any]:
    """The rule's resources for snakemake-executor-plugin-slurm (unset ones left out).

    A multi-rank job is MPI-style (``mpi="srun"``): the plugin runs the rule's shell once and
    the shell starts the ranks with its own ``srun`` (snakellm.launch.prefix). One rank is a
    plain job (the plugin refuses MPI jobs of one task). ``cpus_per_task`` is always explicit,
    since the inner ``srun`` must repeat it.
    """
    out: dict[str, Any] = {"nodes": a.nodes, "cpus_per_task": a.cpus_per_gpu or threads}
    if a.gpus_per_node:
        out.update(gpu=a.ranks, tasks=a.ranks, tasks_per_gpu=1)
    if a.ranks > 1:
        out["mpi"] = "srun"
    extra = []
    if a.ranks > 1 and a.signal_s:
        extra.append(f"--signal=USR1@{a.signal_s}")
    if a.sbatch_extra:
        extra.append(a.sbatch_extra)
    optional = {
        "mem_mb": a.mem_mb,  # 0: no --mem, the cluster's default
        "runtime": a.time_limit,
        "slurm_partition": a.partition,
        "slurm_account": a.account,
        "qos": a.qos,
        "constraint": a.constraint,
        "slurm_extra": " ".join(extra) or None,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def check_allocation(
    a: Allocation,
    tp: int = 1,
    pp: int = 1,
    batch: tuple[int, int] | None = None,
    *,
    slurm: bool = False,
    virtual_pp: int = 1,
) -> None:
    """The job's ranks fit its parallelism: ``tp x pp`` divides them, and the global batch splits over
    the data-parallel ranks (``batch``: global, micro batch size). One-GPU stages take one rank.
    ``slurm``: a pyxis container needs the rule's inner ``srun``, which only a multi-rank job has."""
    if slurm and a.ranks == 1 and (a.container or {}).get("runtime") == "pyxis":
        raise ConfigError(
            f"config key {a.where}: a pyxis container needs the job's own srun, which only a multi-rank job "
            f"has ({a.size}): use runtime apptainer, or more than one GPU"
        )
    if a.stage not in TRAINING and a.ranks > 1:
        raise ConfigError(
            f"config key {a.where}: {a.size}: {a.stage} runs one process (one GPU); "
            "set nodes 1 and gpus_per_node 1 (or 0)"
        )
    if a.gpus_per_node == 0 and a.nodes != 1:
        raise ConfigError(f"config key {a.where}.nodes: a CPU job (gpus_per_node 0) runs on one node, not {a.nodes}")
    if a.ranks % (tp * pp):
        raise ConfigError(
            f"config key {a.where}: {a.size} are not divisible by tensor-parallel size {tp} x "
            f"pipeline-parallel size {pp}"
        )
    if a.time_limit and a.signal_s and a.ranks > 1 and a.signal_s >= a.time_limit * 60:
        raise ConfigError(
            f"config key {a.where}.signal_s: {a.signal_s} s is not before the time limit ({a.time_limit} min)"
        )
    if batch:
        gbs, mbs = batch
        dp = a.ranks // (tp * pp)
        if gbs % (mbs * dp):
            raise ConfigError(
                f"config key {a.where}: global_batch_size {gbs} is not divisible by micro_batch_size {mbs} x "
                f"data-parallel size {dp} ({a.size} / (tp {tp} x pp {pp})): choose a multiple of {mbs * dp}"
            )
        why = check_pipeline_batches(pp, virtual_pp, gbs // (mbs * dp))
        if why:
            raise ConfigError(f"config key {a.where}: global_batch_size {gbs}: {why}")
