# Config lookups, chunk planning, path builders and target lists. Input functions are
# named get_* and do dictionary lookups only: they run once per job, and a 60,000-shard
# source must still plan and dry-run in seconds. Cross-field checks live in
# snakellm.config.checks and settings flags come from the settings dataclasses
# (snakellm.config.sections, via flags() below): both are unit-tested without Snakemake.

import os
import shlex
import sys
from types import SimpleNamespace

from snakemake.exceptions import WorkflowError

from snakellm.config import checks as checkmod
from snakellm.config import flags as flagmod
from snakellm.config import jobs as jobmod
from snakellm.config import resolve as resolvemod
from snakellm.config import sections as S
from snakellm.config import validate as cfgmod
from snakellm.config.settings import to_flags
from snakellm.data import planning as planmod

# profiles/slurm declares the default resource `launcher` (the launcher of multi-rank jobs):
# under it, a multi-rank job is an MPI-style Slurm job whose shell starts its ranks with srun,
# and the Slurm profile's environment variables are the site defaults of the job resources
# (snakellm.config.jobs); elsewhere ranks start with torchrun and only the config counts.
ON_SLURM = "launcher" in (workflow.resource_settings.default_resources or {})
SITE_ENV = dict(os.environ) if ON_SLURM else None

try:
    cfgmod.validate(
        config, cfgmod.load_schema(workflow.source_path("../config/schema.yaml"))
    )
    RUN_MODELS = checkmod.check_config(config, SITE_ENV)  # {run: complete architecture}
except cfgmod.ConfigError as e:
    raise WorkflowError(f"invalid config: {e}") from None


def flags(cls, values, exclude=()):
    """A config section's settings as `snakellm <step>` flags (snakellm.config.settings.to_flags)."""
    return to_flags(cls, values, exclude)


def _names_regex(names):
    return "|".join(map(__import__("re").escape, names)) or "(?!)"


SOURCES = config["sources"]


def _plan_all():
    plans = {}
    for name, spec in SOURCES.items():
        chunks = planmod.plan_source(spec, cache_dir=f"data/plan/{name}")
        if not chunks:
            where = spec.get("path") or spec.get("url") or spec.get("urls")
            raise WorkflowError(
                f"invalid config: config key sources.{name}: no shards found for {where!r}"
            )
        plans[name] = chunks
    return plans


def _write_shard_lists():
    """Each chunk's shard list goes to data/plan/{source}/{chunk}.list (rewritten only when it changed):
    jobs read shards from files, never the command line (128 KiB an argument). A chunk whose inputs changed
    in a way mtimes miss gets a note in its list, so exactly its job reruns: an http chunk whose manifest no
    longer matches the shards on disk (its download fetches what is missing); a local chunk whose shard's
    size, mtime, ctime or inode differs from what it recorded (`cp -p`, `rsync -a`, `tar x`; a stat a shard).
    """
    import datetime

    for name, chunks in PLAN.items():
        http = SOURCES[name]["kind"] == "http"
        for chunk, shards in chunks.items():
            if http:
                why = planmod.stale_manifest(download_manifest_path(name, chunk))
                what = f"{download_manifest_path(name, chunk)}: {{}}; downloading again"
            else:
                why = planmod.stale_local_chunk(chunk_stats_path(name, chunk), shards)
                what = f"{chunk_stats_path(name, chunk)}: {{}}; chunking again"
            note = None
            if why:
                print(what.format(why), file=sys.stderr)
                note = f"{'download' if http else 'chunk'} again ({datetime.datetime.now().isoformat(timespec='seconds')}): {why}"
            planmod.write_shard_list(shard_list_path(name, chunk), shards, note)


def shard_list_path(source, chunk):
    return f"data/plan/{source}/{chunk}.list"


def download_manifest_path(source, chunk):
    return f"data/raw/{source}/{chunk}.manifest.json"


def chunk_stats_path(source, chunk):
    return f"data/jsonl/{source}/{chunk}.stats.json"


PLAN = _plan_all()  # {source: {chunk: [shard path or URL, ...]}}
if workflow.is_main_process:
    # only the controlling process: a job-side Snakemake (a Slurm job re-parsing this file)
    # must not rewrite a list, or note a manifest stale while another job rewrites it
    _write_shard_lists()


wildcard_constraints:
    source=_names_regex(SOURCES),
    chunk=r"chunk-\d{5}",


# ---------------------------------------------------------------- data stage (rules/data.smk)

DOWNLOAD_FLAGS = flags(S.DownloadSettings, config["download"])


def get_raw_dir(wildcards):
    """Downloaded shards live by URL path, not by chunk: re-planning never re-downloads."""
    return f"data/raw/{wildcards.source}/shards"


def get_chunk_input(wildcards):
    """A local chunk reads its shard list, an http chunk its download manifest.

    The shards themselves are no inputs: the planner compares each one with
    what the chunk recorded (`_write_shard_lists`), which catches what an mtime
    check misses, and holds any name a filesystem allows.
    """
    if SOURCES[wildcards.source]["kind"] == "http":
        return [download_manifest_path(wildcards.source, wildcards.chunk)]
    return [shard_list_path(wildcards.source, wildcards.chunk)]


def get_chunk_shards_option(wildcards):
    """How `snakellm chunk` finds its shards: a file, never a list on the command line."""
    if SOURCES[wildcards.source]["kind"] == "http":
        return f"--manifest {download_manifest_path(wildcards.source, wildcards.chunk)}"
    return f"--shard-list {shard_list_path(wildcards.source, wildcards.chunk)}"


def get_download_token_option(wildcards):
    """`--token-env VAR ` (config: sources.NAME.token_env): the variable's name only, never its value."""
    var = SOURCES[wildcards.source].get("token_env")
    return f"--token-env {var} " if var else ""


def get_download_url_list(wildcards):
    return shard_list_path(wildcards.source, wildcards.chunk)


def get_source_flags(wildcards):
    """The source's `--format` and `--key` (parquet, arrow: `--id-key`, `--columns`) (config: sources.NAME)."""
    spec = SOURCES[wildcards.source]
    columnar = spec["format"] in S.COLUMNAR_FORMATS
    return flags(S.SourceSettings, spec, () if columnar else ("id_key", "columns"))


def get_chunk_limits(wildcards):
    """`snakellm chunk`'s limits (config: sources.NAME); by hand the command line has none."""
    s = SOURCES[wildcards.source]
    return (
        f"--max-document-bytes {s['max_document_bytes']} "
        f"--max-rejected-fraction {s['max_rejected_fraction']}"
    )


def get_source_key(wildcards):
    return SOURCES[wildcards.source]["key"]


def chunk_outputs(source, chunk):
    stem = f"data/jsonl/{source}/{chunk}"
    return [f"{stem}.jsonl", f"{stem}.stats.json", f"{stem}.rejected.jsonl"]


def get_all_chunk_targets():
    return [
        p for s, chunks in PLAN.items() for c in chunks for p in chunk_outputs(s, c)
    ]


# ---------------------------------------------------------------- tokenize stage (rules/tokenize.smk)

TOKENIZERS = config["tokenizers"]  # {name: spec}
TOKENIZE_THREADS = config["tokenize"]["threads"]
TOKENIZE_DEFAULT = config["tokenize"].get("tokenizers", list(TOKENIZERS))
TRAINED_TOKENIZERS = [
    n
    for n, t in TOKENIZERS.items()
    if t["kind"] == "sentencepiece" and "model_file" not in t
]


wildcard_constraints:
    tokenizer=_names_regex(TOKENIZERS),


def tokens_prefix(tokenizer, source, chunk):
    return f"data/tokens/{tokenizer}/{source}/{chunk}_text_document"


def get_tokenizer_files(wildcards):
    """The files a tokenizer is loaded from (a trained one: the train_tokenizer outputs)."""
    return flagmod.tokenizer_files(wildcards.tokenizer, TOKENIZERS[wildcards.tokenizer])


def get_tokenizer_flags(wildcards):
    """The tokenizer's own entry only (config: tokenizers.NAME): editing another reruns nothing."""
    name = wildcards.tokenizer
    return flagmod.tokenizer_flags(name, TOKENIZERS[name])


def _train_sample(tokenizer):
    """(source, chunk jsonl) sampled to train `tokenizer`: the first `chunks` chunks of each sampled source."""
    sample = TOKENIZERS[tokenizer]["train"]["sample"]
    n = sample["chunks"]
    pairs = []
    for s in sample.get("sources") or list(SOURCES):
        chunks = sorted(PLAN[s])
        pairs += [(s, text_chunk(s, c)) for c in (chunks[:n] if n else chunks)]
    return pairs


def get_train_tokenizer_input(wildcards):
    return [f for _, f in _train_sample(wildcards.tokenizer)]


def get_train_tokenizer_keys(wildcards):
    """One --key per sampled chunk, in input order (sources may keep their text under different keys)."""
    return shlex.join(
        a
        for s, _ in _train_sample(wildcards.tokenizer)
        for a in ("--key", SOURCES[s]["key"])
    )


def get_train_tokenizer_flags(wildcards):
    """The training settings (config: tokenizers.NAME.train): a change retrains this tokenizer only."""
    return flagmod.train_tokenizer_flags(TOKENIZERS[wildcards.tokenizer])


def get_train_tokenizer_threads(wildcards):
    return TOKENIZERS[wildcards.tokenizer]["train"]["threads"]


def get_blend_stats(wildcards):
    return [
        f"{tokens_prefix(wildcards.tokenizer, s, c)}.stats.json"
        for s, chunks in PLAN.items()
        for c in chunks
    ]


def get_blend_data(wildcards):
    return [
        f"{tokens_prefix(wildcards.tokenizer, s, c)}{ext}"
        for s, chunks in PLAN.items()
        for c in chunks
        for ext in (".bin", ".idx")
    ]


def get_blend_weights(wildcards):
    """Each source's weight (config: sources.NAME.weight)."""
    return " ".join(f"--weight {s}={spec['weight']}" for s, spec in SOURCES.items())


def get_blend(tokenizer):
    """The blend a trainer reads (data_prefix, vocab size, EOD id): data/tokens/{tokenizer}/blend.json."""
    return f"data/tokens/{tokenizer}/blend.json"


def get_tokenize_targets():
    return [
        p
        for name in TOKENIZE_DEFAULT
        for p in [get_blend(name), f"data/tokens/{name}/blend.txt"]
        + [
            f"{tokens_prefix(name, s, c)}{ext}"
            for s, chunks in PLAN.items()
            for c in chunks
            for ext in (".bin", ".idx", ".stats.json")
        ]
    ]


# ---------------------------------------------------------------- train stage (rules/train.smk)

RUNS = config.get("runs", {})  # {name: {tokenizer, model, train, parallel}}
TRAIN_RETRIES = resolvemod.train_retries(config)


wildcard_constraints:
    run=_names_regex(RUNS),


def get_train_blend(wildcards):
    return get_blend(RUNS[wildcards.run]["tokenizer"])


def get_train_data(wildcards):
    """The token files the run's blend lists (the blend rule's own inputs)."""
    return get_blend_data(SimpleNamespace(tokenizer=RUNS[wildcards.run]["tokenizer"]))


def get_train_flags(wildcards):
    """Every `snakellm train` setting of the run (snakellm.config.resolve.train_flags): reruns on its own settings."""
    run = RUNS[wildcards.run]
    return flagmod.join(
        resolvemod.train_flags(run, RUN_MODELS[wildcards.run]),
        flagmod.tracking_flags(config.get("tracking"), run.get("tracking")),
    )


def get_train_threads(wildcards):
    return RUNS[wildcards.run]["parallel"]["threads"]


def get_train_targets():
    return [f"runs/{run}/train_summary.json" for run in RUNS]


# ---------------------------------------------------------------- tracking (docs/tracking.md)


def get_track_data_stats(wildcards):
    """Every chunk's and curated chunk's stats: the data run's counts."""
    return get_report_all_stats(wildcards) + [
        f"data/curated/{s}/{c}.stats.json" for s in CURATED for c in PLAN[s]
    ]


def get_track_data_flags(wildcards):
    return flagmod.tracking_flags(config.get("tracking"))


def get_tracking_targets():
    """The data run, when the global tracking configures a tracker (else nothing: the graph is unchanged)."""
    return (
        ["results/tracking/data.json"]
        if flagmod.tracked(config.get("tracking"))
        else []
    )


# ---------------------------------------------------------------- targets


def get_all_targets():
    """What `snakemake` with no target builds: every stage of the default graph and its report figures
    (get_report_targets: rules/report.smk)."""
    return (
        get_all_chunk_targets()
        + get_all_curate_targets()
        + get_tokenize_targets()
        + get_train_targets()
        + get_export_nemo_targets()
        + get_hf_targets()
        + get_lm_eval_targets()
        + [f for n in list(RUNS) + list(IMPORTS) for f in lm_eval_finetune_files(n)]
        + get_finetune_targets()
        + get_report_targets()
        + get_tracking_targets()
    )
