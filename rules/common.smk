# Config lookups, chunk planning and path helpers. Input functions are named
# get_* and do dictionary lookups only: they run once per job, and a 60,000-shard
# source must still plan and dry-run in seconds.

import os
import shlex
import sys

from snakemake.exceptions import WorkflowError

from snakellm.config import resolve as resolvemod
from snakellm.config import validate as cfgmod
from snakellm.data import planning as planmod

try:
    cfgmod.validate(
        config, cfgmod.load_schema(workflow.source_path("../config/schema.yaml"))
    )
except cfgmod.ConfigError as e:
    raise WorkflowError(f"invalid config: {e}") from None


SOURCES = config["sources"]


def _plan_all():
    plans = {}
    for name, spec in SOURCES.items():
        chunks = planmod.plan_source(spec)
        if not chunks:
            where = spec.get("path") or spec.get("url") or spec.get("urls")
            raise WorkflowError(
                f"invalid config: config key sources.{name}: no shards found for {where!r}"
            )
        plans[name] = chunks
    return plans


def _write_shard_lists():
    """Each chunk's shard list goes to data/plan/{source}/{chunk}.list (rewritten only when it changed).

    The jobs read their shards from these files, never from the command line
    (one argument is capped at 128 KiB). A chunk whose inputs changed in a way
    Snakemake's mtime check misses gets a note in its list: its content
    changed, so exactly that chunk's job runs again. For an http chunk: its
    manifest no longer matches the shards on disk (one deleted by hand, or
    removed by `snakellm chunk` as damaged); its download fetches what is
    missing. For a local chunk: a shard's size, mtime, ctime or inode differs
    from what the chunk recorded (a file replaced with an older mtime by
    `cp -p`, `rsync -a` or `tar x`); a stat per shard, no reads.
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
    source="|".join(map(__import__("re").escape, SOURCES)),
    chunk=r"chunk-\d{5}",


# ---------------------------------------------------------------- data stage


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


def get_download_url_list(wildcards):
    return shard_list_path(wildcards.source, wildcards.chunk)


def get_download_options(wildcards):
    d = config["download"]
    return (
        f"--concurrency {d['concurrency']} --retries {d['retries']} --backoff {d['backoff_s']} "
        f"--max-backoff {d['max_backoff_s']} --timeout {d['timeout_s']} --deadline {d['deadline_s']} "
        f"--min-rate {d['min_rate_bytes_s']} --format {SOURCES[wildcards.source]['format']}"
    )


def get_source_format(wildcards):
    return SOURCES[wildcards.source]["format"]


def get_source_key(wildcards):
    return SOURCES[wildcards.source]["key"]


def get_chunk_limits(wildcards):
    s = SOURCES[wildcards.source]
    return (
        f"--max-document-bytes {s['max_document_bytes']} "
        f"--max-rejected-fraction {s['max_rejected_fraction']}"
    )


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


try:
    resolvemod.check_tokenizers(config)
except cfgmod.ConfigError as e:
    raise WorkflowError(f"invalid config: {e}") from None


wildcard_constraints:
    tokenizer="|".join(map(__import__("re").escape, TOKENIZERS)) or "(?!)",


def tokens_prefix(tokenizer, source, chunk):
    return f"data/tokens/{tokenizer}/{source}/{chunk}_text_document"


def get_tokenizer_files(wildcards):
    """The files a tokenizer is loaded from (a trained one: the train_tokenizer outputs)."""
    t = TOKENIZERS[wildcards.tokenizer]
    if t["kind"] == "gpt2-bpe":
        return [t["vocab_file"], t["merges_file"]]
    if t["kind"] == "huggingface":
        return [t["tokenizer_file"]]
    return [t.get("model_file") or f"tokenizers/{wildcards.tokenizer}/tokenizer.model"]


def get_tokenizer_options(wildcards):
    """`snakellm tokenize` tokenizer flags: only this tokenizer's entry, so editing another reruns nothing."""
    name = wildcards.tokenizer
    t = TOKENIZERS[name]
    files = get_tokenizer_files(wildcards)
    opts = ["--kind", t["kind"], "--name", name]
    if t["kind"] == "gpt2-bpe":
        opts += ["--vocab-file", files[0], "--merges-file", files[1]]
    elif t["kind"] == "huggingface":
        opts += ["--tokenizer-file", files[0]] + (
            ["--add-special-tokens"] if t.get("add_special_tokens") else []
        )
    else:
        opts += ["--model-file", files[0]]
    if "eod" in t:
        opts += ["--eod", t["eod"]]
    if "vocab_size" in t:
        opts += ["--vocab-size", str(t["vocab_size"])]
    return shlex.join(opts)


def _train_sample(tokenizer):
    """(source, chunk jsonl) sampled to train `tokenizer`: the first `chunks` chunks of each sampled source."""
    sample = TOKENIZERS[tokenizer]["train"]["sample"]
    n = sample["chunks"]
    pairs = []
    for s in sample.get("sources") or list(SOURCES):
        chunks = sorted(PLAN[s])
        pairs += [
            (s, f"data/jsonl/{s}/{c}.jsonl") for c in (chunks[:n] if n else chunks)
        ]
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


def get_train_tokenizer_options(wildcards):
    """The training settings as flags: any change retrains (and re-tokenizes with) this tokenizer only."""
    t = TOKENIZERS[wildcards.tokenizer]
    tr = t["train"]
    opts = [
        "--vocab-size",
        str(t["vocab_size"]),
        "--model-type",
        tr["model_type"],
        "--character-coverage",
        str(tr["character_coverage"]),
        "--max-sentence-length",
        str(tr["max_sentence_length"]),
        "--max-bytes",
        str(tr["sample"]["max_bytes"]),
        "--seed",
        str(tr["sample"]["seed"]),
        "--threads",
        str(tr["threads"]),
    ]
    opts += ["--byte-fallback"] if tr["byte_fallback"] else []
    for sym in tr["user_defined_symbols"]:
        opts += ["--user-defined-symbol", sym]
    for k, v in sorted(tr["options"].items()):
        opts += ["--option", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return shlex.join(opts)


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

from types import SimpleNamespace

RUNS = config.get("runs", {})  # {name: {tokenizer, model, train, parallel}}
try:
    RUN_MODELS = resolvemod.resolve_runs(config)  # {run: complete architecture dict}
except cfgmod.ConfigError as e:
    raise WorkflowError(f"invalid config: {e}") from None
TRAIN_RETRIES = resolvemod.train_retries(config)


wildcard_constraints:
    run="|".join(map(__import__("re").escape, RUNS)) or "(?!)",


def get_train_blend(wildcards):
    return get_blend(RUNS[wildcards.run]["tokenizer"])


def get_train_data(wildcards):
    """The token files the run's blend lists (the blend rule's own inputs)."""
    return get_blend_data(SimpleNamespace(tokenizer=RUNS[wildcards.run]["tokenizer"]))


def get_train_args(wildcards):
    """Every `snakellm train` setting of the run (snakellm.config.resolve.train_flags): reruns on its own settings."""
    return resolvemod.train_flags(RUNS[wildcards.run], RUN_MODELS[wildcards.run])


def get_train_threads(wildcards):
    return RUNS[wildcards.run]["parallel"]["threads"]


def get_train_targets():
    return [f"runs/{run}/train_summary.json" for run in RUNS]


# ---------------------------------------------------------------- fine-tuning stage (rules/finetune.smk, rules/evaluate.smk)

SFT_DATA = config.get("sft_data", {})  # {task: {path, format, template, ...}}
FINETUNES = config.get(
    "finetune", {}
)  # {name: {run, data, method, lora, ptuning, examples, train, parallel, evaluate}}


def _check_finetunes():
    for name, ft in FINETUNES.items():
        bases = list(RUNS) + list(config.get("import_hf", {}))
        if ft["run"] not in bases:
            raise WorkflowError(
                f"invalid config: config key finetune.{name}.run: unknown run {ft['run']!r} "
                f"(runs and import_hf: {', '.join(bases) or 'none'})"
            )
        if ft["data"] not in SFT_DATA:
            raise WorkflowError(
                f"invalid config: config key finetune.{name}.data: unknown sft_data {ft['data']!r} "
                f"(sft_data: {', '.join(SFT_DATA) or 'none'})"
            )
        t = ft["train"]
        if t["global_batch_size"] % t["micro_batch_size"]:
            raise WorkflowError(
                f"invalid config: config key finetune.{name}.train: global_batch_size {t['global_batch_size']} is not "
                f"a multiple of micro_batch_size {t['micro_batch_size']}"
            )


_check_finetunes()


wildcard_constraints:
    task="|".join(map(__import__("re").escape, SFT_DATA)) or "(?!)",
    ft="|".join(map(__import__("re").escape, FINETUNES)) or "(?!)",
    which="base|tuned",


def get_sft_source(wildcards):
    return SFT_DATA[wildcards.task]["path"]


def get_sft_args(wildcards):
    """`snakellm prepare-sft` options of one data set: editing another reruns nothing."""
    d = SFT_DATA[wildcards.task]
    opts = [
        "--format",
        d["format"],
        "--split",
        d["split"],
        "--seed",
        str(d["seed"]),
        "--input-key",
        d["input_key"],
        "--output-key",
        d["output_key"],
    ]
    if d.get("template") is not None:
        opts += ["--template", d["template"]]
    if d.get("limit") is not None:
        opts += ["--limit", str(d["limit"])]
    return shlex.join(opts)


def _ft(wildcards):
    ft = FINETUNES[wildcards.ft]
    if ft["run"] != wildcards.run:
        raise WorkflowError(
            f"finetune {wildcards.ft} is based on run {ft['run']}, not {wildcards.run}"
        )
    return ft


def _base_inputs(ft):
    """The base model's final file (the run carries its tokenizer: runs/RUN/tokenizer/)."""
    if ft["run"] in RUNS:
        return {"base": f"runs/{ft['run']}/train_summary.json"}
    return {"base": f"runs/{ft['run']}/import_summary.json"}


def get_finetune_input(wildcards):
    ft = _ft(wildcards)
    d = f"data/sft/{ft['data']}"
    return _base_inputs(ft) | {
        "train": f"{d}/train.jsonl",
        "validation": f"{d}/validation.jsonl",
    }


def _example_flags(ex):
    flags = [
        "--template",
        ex["template"],
        "--truncation-method",
        ex["truncation_method"],
    ]
    flags += [
        "--add-bos" if ex["add_bos"] else "--no-add-bos",
        "--add-eos" if ex["add_eos"] else "--no-add-eos",
    ]
    flags += [
        "--answer-only-loss" if ex["answer_only_loss"] else "--no-answer-only-loss"
    ]
    if ex.get("max_seq_length") is not None:
        flags += ["--max-seq-length", str(ex["max_seq_length"])]
    return flags


def get_finetune_args(wildcards):
    """Every `snakellm finetune` setting, spelled out: the rule reruns exactly when one changes."""
    ft = _ft(wildcards)
    flags = ["--method", ft["method"]] + _example_flags(ft["examples"])
    flags += ["--packing" if ft["examples"]["packing"] else "--no-packing"]
    if ft["method"] == "lora":
        lo = ft["lora"]
        flags += [
            "--lora-rank",
            str(lo["rank"]),
            "--lora-dropout",
            str(lo["dropout"]),
            "--lora-targets",
            ",".join(lo["targets"]),
            "--lora-column-init",
            lo["column_init"],
            "--lora-row-init",
            lo["row_init"],
        ]
        if lo.get("alpha") is not None:
            flags += ["--lora-alpha", str(lo["alpha"])]
        if lo.get("layers"):
            flags += ["--lora-layers", ",".join(map(str, lo["layers"]))]
        if lo["modules_to_save"]:
            flags += ["--lora-modules-to-save", ",".join(lo["modules_to_save"])]
    elif ft["method"] == "ptuning":
        pt = ft["ptuning"]
        flags += [
            "--virtual-tokens",
            str(pt["virtual_tokens"]),
            "--prompt-encoder",
            pt["encoder"],
            "--prompt-encoder-hidden",
            str(pt["hidden"]),
        ]
    for k, v in ft["train"].items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(flags)


def get_finetune_threads(wildcards):
    return FINETUNES[wildcards.ft]["parallel"]["threads"]


def get_evaluate_input(wildcards):
    ft = _ft(wildcards)
    inp = _base_inputs(ft) | {"test": f"data/sft/{ft['data']}/test.jsonl"}
    if wildcards.which == "tuned":
        inp["finetune"] = (
            f"runs/{ft['run']}/finetune/{wildcards.ft}/finetune_summary.json"
        )
    return inp


def get_evaluate_args(wildcards):
    """The model (base run, + adapter / prompt table, or the full fine-tune's model) and the options."""
    ft = _ft(wildcards)
    d = f"runs/{ft['run']}/finetune/{wildcards.ft}"
    flags = ["--base", f"runs/{ft['run']}", "--label", wildcards.which]
    if wildcards.which == "tuned":
        if ft["method"] == "lora":
            flags += ["--adapter", f"{d}/adapter"]
        elif ft["method"] == "ptuning":
            flags += ["--prompt", f"{d}/prompt"]
        else:
            flags[1] = f"{d}/model"
    flags += _example_flags(ft["examples"])
    ev = ft["evaluate"]
    flags += [
        "--tokens-to-generate",
        str(ev["tokens_to_generate"]),
        "--batch-size",
        str(ev["batch_size"]),
    ]
    if ev.get("limit") is not None:
        flags += ["--limit", str(ev["limit"])]
    return shlex.join(flags)


def get_finetune_targets():
    out = []
    for name, ft in FINETUNES.items():
        d = f"runs/{ft['run']}"
        out += [f"{d}/finetune/{name}/finetune_summary.json"]
        out += [
            f"{d}/eval/{name}/{w}/{f}"
            for w in ("base", "tuned")
            for f in ("metrics.json", "predictions.jsonl")
        ]
        if ft["method"] == "lora":
            out.append(f"{d}/finetune/{name}/hf_peft/adapter_config.json")
    return out


# ---------------------------------------------------------------- launch (snakellm/launch/prefix.py)


def get_launch_prefix(wildcards, resources):
    """`srun ...` (Slurm profile, mpi="srun"), `torchrun ...` (tasks > 1) or "" in front of a
    training command, plus the configured container. Taking `resources` keeps it out of
    Snakemake's params rerun trigger: changing profile or node count retrains nothing.
    """
    from snakellm.launch.prefix import launch_prefix

    return launch_prefix(resources, config.get("container"))


# ---------------------------------------------------------------- export stage: .nemo (rules/export.smk)

EXPORT_NEMO = config["export_nemo"]
_NEMO_TOKENIZER_KINDS = (
    "gpt2-bpe",
    "sentencepiece",
)  # what NeMo packs as tokenizer artifacts


def _check_export_nemo():
    """An export that cannot work is a config error before any job runs, not a failure after training."""
    if not EXPORT_NEMO["enabled"]:
        return
    for name, run in RUNS.items():
        kind = TOKENIZERS[run["tokenizer"]]["kind"]
        if kind not in _NEMO_TOKENIZER_KINDS:
            raise WorkflowError(
                f"invalid config: config key runs.{name}.tokenizer: a .nemo packs only gpt2-bpe or sentencepiece "
                f"tokenizers, {run['tokenizer']!r} is {kind} (set export_nemo.enabled: false to skip the .nemo)"
            )


_check_export_nemo()


def get_export_nemo_args(wildcards):
    """The export's own settings: part of params, so a change rewrites the .nemo (and nothing else)."""
    te = EXPORT_NEMO["transformer_engine"]
    return f"--transformer-engine {str(te).lower()}"


def get_export_nemo_targets():
    return [f"runs/{run}/{run}.nemo" for run in RUNS] if EXPORT_NEMO["enabled"] else []


# ---------------------------------------------------------------- Hugging Face export/import, generation
# (rules/export.smk export_hf/import_hf blocks, rules/evaluate.smk generate)

IMPORTS = config.get("import_hf", {})  # {name: {hf_dir, make_vocab_size_divisible_by}}


def _check_exports():
    """Errors before any job runs: an import named like a run, a missing HF directory, a run no HF class computes."""
    from snakellm.export.hf import ExportError, hf_family

    for name, spec in IMPORTS.items():
        if name in RUNS:
            raise WorkflowError(
                f"invalid config: config key import_hf.{name}: a run of that name exists under runs"
            )
        if not os.path.isfile(os.path.join(spec["hf_dir"], "config.json")):
            raise WorkflowError(
                f"invalid config: config key import_hf.{name}.hf_dir: {spec['hf_dir']!r} has no config.json "
                "(not a Hugging Face model directory)"
            )
    if config["export_hf"]["enabled"]:
        for name, arch in RUN_MODELS.items():
            try:
                hf_family(arch)
            except ExportError as e:
                raise WorkflowError(
                    f"invalid config: config key runs.{name}.model: Hugging Face export: {e}"
                ) from None


_check_exports()


def _import_files():
    """The files of each HF directory, listed once at parse time: an edited weight file reruns the import."""
    return {
        name: sorted(
            os.path.join(spec["hf_dir"], f)
            for f in os.listdir(spec["hf_dir"])
            if os.path.isfile(os.path.join(spec["hf_dir"], f))
        )
        for name, spec in IMPORTS.items()
    }


IMPORT_FILES = _import_files()


wildcard_constraints:
    run="|".join(map(__import__("re").escape, list(RUNS) + list(IMPORTS))) or "(?!)",


def get_import_hf_files(wildcards):
    return IMPORT_FILES[wildcards.run]


def get_import_hf_dir(wildcards):
    return IMPORTS[wildcards.run]["hf_dir"]


def get_import_hf_args(wildcards):
    return f"--make-vocab-size-divisible-by {IMPORTS[wildcards.run]['make_vocab_size_divisible_by']}"


def get_run_done(wildcards):
    """The file that says a run's checkpoint is final: train_summary.json, or an import's import_summary.json."""
    if wildcards.run in IMPORTS:
        return f"runs/{wildcards.run}/import_summary.json"
    return f"runs/{wildcards.run}/train_summary.json"


def get_export_hf_args(wildcards):
    e = config["export_hf"]
    return (
        f"--max-shard-size {shlex.quote(str(e['max_shard_size']))} --dtype {e['dtype']}"
    )


def get_generate_args(wildcards):
    """Every sampling setting and prompt, spelled out: a change reruns the samples, nothing else does."""
    g = config["generate"]
    flags = [
        f"--max-new-tokens {g['max_new_tokens']}",
        f"--min-new-tokens {g['min_new_tokens']}",
        f"--seed {g['seed']}",
    ]
    if g["greedy"]:
        flags.append("--greedy")
    else:
        flags += [
            f"--temperature {g['temperature']}",
            f"--top-k {g['top_k']}",
            f"--top-p {g['top_p']}",
        ]
    flags.append(f"--repetition-penalty {g['repetition_penalty']}")
    flags += [f"--end-string {shlex.quote(s)}" for s in g["end_strings"]]
    flags += [f"--prompt {shlex.quote(p)}" for p in g["prompts"]]
    return " ".join(flags)


def get_generate_threads(wildcards):
    return config["generate"]["threads"]


def _import_tokenizer_kind(hf_dir):
    """What import-hf will make of an HF directory's tokenizer (snakellm/export/hf_tokenizer.py)."""
    has = lambda f: os.path.isfile(os.path.join(hf_dir, f))  # noqa: E731
    if has("vocab.json") and has("merges.txt"):
        return "gpt2-bpe"
    return "sentencepiece" if has("tokenizer.model") else "huggingface"


def get_hf_targets():
    """HF directories and samples of every run and import; imports' .nemo when NeMo can pack their tokenizer."""
    names = list(RUNS) + list(IMPORTS)
    out = [f"runs/{n}/import_summary.json" for n in IMPORTS]
    if EXPORT_NEMO["enabled"]:
        out += [
            f"runs/{n}/{n}.nemo"
            for n, spec in IMPORTS.items()
            if _import_tokenizer_kind(spec["hf_dir"]) in _NEMO_TOKENIZER_KINDS
        ]
    if config["export_hf"]["enabled"]:
        out += [f"runs/{n}/hf" for n in names]
    if config["generate"]["enabled"]:
        out += [f"runs/{n}/samples.jsonl" for n in names]
    return out


# ---------------------------------------------------------------- report (rules/report.smk)

import json as _json

REPORT = "results/report"
HTTP_SOURCES = [s for s, spec in SOURCES.items() if spec["kind"] == "http"]

# Later stages add their metrics and samples to the report here, at parse time, from
# their own rules/*.smk (see register_report_table); rule report_table renders each entry.
REPORT_TABLES = (
    {}
)  # {"{stage}/{name}": {"files", "title", "note", "category", "subcategory", "figure"}}


def register_report_table(
    stage, name, files, title, note="", category=None, subcategory=None, figure="table"
):
    """Put FILES (a metrics.json, a predictions/samples .jsonl, a .csv/.tsv; or a list of them)
    into `snakemake --report` as one HTML table: results/report/tables/{stage}/{name}.html,
    shown under CATEGORY (default: the stage, capitalised) / SUBCATEGORY (default: NAME).
    The files must be outputs of rules; the table is rebuilt only when they change."""
    key = f"{stage}/{name}"
    if key in REPORT_TABLES:
        raise WorkflowError(f"report table {key!r} registered twice")
    REPORT_TABLES[key] = {
        "files": [files] if isinstance(files, str) else list(files),
        "title": title,
        "note": note,
        "category": category or stage.replace("_", " ").capitalize(),
        "subcategory": subcategory or name,
        "figure": figure,
    }
    return f"{REPORT}/tables/{key}.html"


def _report_table(wildcards):
    return REPORT_TABLES[f"{wildcards.stage}/{wildcards.name}"]


def get_report_table_input(wildcards):
    return _report_table(wildcards)["files"]


def get_report_table_title(wildcards):
    return _report_table(wildcards)["title"]


def get_report_table_note(wildcards):
    note = _report_table(wildcards)["note"]
    return f"--note {shlex.quote(note)}" if note else ""


def get_report_table_category(wildcards):
    return _report_table(wildcards)["category"]


def get_report_table_subcategory(wildcards):
    return _report_table(wildcards)["subcategory"]


def get_report_table_labels(wildcards):
    return {"figure": _report_table(wildcards)["figure"]}


def get_report_data_stats(wildcards):
    return [
        f"data/jsonl/{wildcards.source}/{c}.stats.json" for c in PLAN[wildcards.source]
    ]


def get_report_data_rejected(wildcards):
    return [
        f"data/jsonl/{wildcards.source}/{c}.rejected.jsonl"
        for c in PLAN[wildcards.source]
    ]


def get_report_all_stats(wildcards):
    return [
        f"data/jsonl/{s}/{c}.stats.json" for s, chunks in PLAN.items() for c in chunks
    ]


def get_report_download_manifests(wildcards):
    return [
        f"data/raw/{wildcards.source}/{c}.manifest.json" for c in PLAN[wildcards.source]
    ]


def get_report_download_logs(wildcards):
    """The download jobs' logs: the only record of requests and retries (the manifest is byte-stable)."""
    return [f"logs/download/{wildcards.source}/{c}.log" for c in PLAN[wildcards.source]]


def get_report_tokens_stats(wildcards):
    return get_blend_stats(wildcards)


def get_report_tokens_idx(wildcards):
    return [
        f"{tokens_prefix(wildcards.tokenizer, s, c)}.idx"
        for s, chunks in PLAN.items()
        for c in chunks
    ]


def get_report_tokens_blends(wildcards):
    return [get_blend(name) for name in TOKENIZE_DEFAULT]


def _tokenizer_sample(tokenizer):
    """(source, chunk jsonl) the example encodings come from: a trained tokenizer's first sampled chunk."""
    if tokenizer in TRAINED_TOKENIZERS:
        return _train_sample(tokenizer)[0]
    s = next(iter(PLAN))
    return s, f"data/jsonl/{s}/{sorted(PLAN[s])[0]}.jsonl"


def get_report_tokenizer_sample(wildcards):
    return _tokenizer_sample(wildcards.tokenizer)[1]


def get_report_tokenizer_key(wildcards):
    return SOURCES[_tokenizer_sample(wildcards.tokenizer)[0]]["key"]


def get_report_tokenizer_train_stats(wildcards):
    return (
        [f"tokenizers/{wildcards.tokenizer}/tokenizer.stats.json"]
        if wildcards.tokenizer in TRAINED_TOKENIZERS
        else []
    )


def get_report_tokenizer_train_flag(wildcards):
    return (
        f"--train-stats {get_report_tokenizer_train_stats(wildcards)[0]}"
        if wildcards.tokenizer in TRAINED_TOKENIZERS
        else ""
    )


def get_main_snakefile(wildcards):
    """The Snakefile `snakellm dag` draws (the one this workflow was started with)."""
    return workflow.main_snakefile


def get_dag_config(wildcards):
    """The workflow's whole config: the pictures are redrawn when it changes (the DAG depends on all of it)."""
    return _json.dumps(config, sort_keys=True, default=str)


def get_report_targets():
    """Every report output of the default graph (results/report/...)."""
    out = [
        f"{REPORT}/workflow/rulegraph.svg",
        f"{REPORT}/workflow/jobs.svg",
        f"{REPORT}/data/overview.html",
    ]
    out += [
        f"{REPORT}/data/{s}.chunks.{ext}" for s in SOURCES for ext in ("html", "svg")
    ]
    out += [f"{REPORT}/data/{s}.download.html" for s in HTTP_SOURCES]
    if TOKENIZE_DEFAULT:
        out += [f"{REPORT}/tokens/overview.html", f"{REPORT}/tokens/overview.svg"]
    for t in TOKENIZE_DEFAULT:
        out += [
            f"{REPORT}/tokens/{t}.{what}"
            for what in ("tokens.html", "blend.svg", "doc_tokens.svg", "tokenizer.html")
        ]
    for run in RUNS:
        out += [
            f"{REPORT}/train/{run}.{what}"
            for what in (
                "loss.svg",
                "lr.svg",
                "grad_norm.svg",
                "throughput.svg",
                "summary.html",
            )
        ]
    out += [f"{REPORT}/tables/{key}.html" for key in REPORT_TABLES]
    return out


# ---------------------------------------------------------------- targets


def get_all_targets():
    """What `snakemake` with no target builds: every stage of the default graph and its report figures."""
    return (
        get_all_chunk_targets()
        + get_tokenize_targets()
        + get_train_targets()
        + get_export_nemo_targets()
        + get_hf_targets()
        + get_finetune_targets()
        + get_report_targets()
    )
