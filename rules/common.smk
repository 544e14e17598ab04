# Config lookups, chunk planning and path helpers. Input functions are named
# get_* and do dictionary lookups only: they run once per job, and a 60,000-shard
# source must still plan and dry-run in seconds.

import os
import shlex

from snakemake.exceptions import WorkflowError

from snakellm import config as cfgmod
from snakellm import plan as planmod


try:
    cfgmod.validate(config, cfgmod.load_schema(workflow.source_path("../config/schema.yaml")))
except cfgmod.ConfigError as e:
    raise WorkflowError(f"invalid config: {e}") from None


SOURCES = config["sources"]


def _plan_all():
    plans = {}
    for name, spec in SOURCES.items():
        chunks = planmod.plan_source(spec)
        if not chunks:
            where = spec.get("path") or spec.get("url") or spec.get("urls")
            raise WorkflowError(f"invalid config: config key sources.{name}: no shards found for {where!r}")
        plans[name] = chunks
    return plans


PLAN = _plan_all()  # {source: {chunk: [shard path or URL, ...]}}


wildcard_constraints:
    source="|".join(map(__import__("re").escape, SOURCES)),
    chunk=r"chunk-\d{5}",


# ---------------------------------------------------------------- data stage


def get_raw_dir(wildcards):
    """Downloaded shards live by URL path, not by chunk: re-planning never re-downloads."""
    return f"data/raw/{wildcards.source}/shards"


def get_chunk_input(wildcards):
    """A local chunk reads its shards; an http chunk reads its download manifest."""
    if SOURCES[wildcards.source]["kind"] == "http":
        return [f"data/raw/{wildcards.source}/{wildcards.chunk}.manifest.json"]
    return PLAN[wildcards.source][wildcards.chunk]


def get_download_urls(wildcards):
    return PLAN[wildcards.source][wildcards.chunk]


def get_download_options(wildcards):
    d = config["download"]
    return (
        f"--concurrency {d['concurrency']} --retries {d['retries']} --backoff {d['backoff_s']} "
        f"--max-backoff {d['max_backoff_s']} --timeout {d['timeout_s']}"
    )


def get_source_format(wildcards):
    return SOURCES[wildcards.source]["format"]


def get_source_key(wildcards):
    return SOURCES[wildcards.source]["key"]


def chunk_outputs(source, chunk):
    stem = f"data/jsonl/{source}/{chunk}"
    return [f"{stem}.jsonl", f"{stem}.stats.json", f"{stem}.rejected.jsonl"]


def get_all_chunk_targets():
    return [p for s, chunks in PLAN.items() for c in chunks for p in chunk_outputs(s, c)]


# ---------------------------------------------------------------- tokenize stage (rules/tokenize.smk)


def get_tokenize_targets():
    return []


# ---------------------------------------------------------------- train stage (rules/train.smk)


def get_train_targets():
    return []


# ---------------------------------------------------------------- launch (snakellm/launch.py)


def get_launch_prefix(wildcards, resources):
    """`srun ...` (Slurm profile, mpi="srun"), `torchrun ...` (tasks > 1) or "" in front of a
    training command, plus the configured container. Taking `resources` keeps it out of
    Snakemake's params rerun trigger: changing profile or node count retrains nothing."""
    from snakellm.launch import launch_prefix

    return launch_prefix(resources, config.get("container"))


# ---------------------------------------------------------------- targets


def get_all_targets():
    """What `snakemake` with no target builds: every stage of the default graph."""
    return get_all_chunk_targets() + get_tokenize_targets() + get_train_targets()
