# Lookups of the report rules (rules/report.smk) and the report-table registry that later
# stages call at parse time (register_report_table).

import hashlib
import json

from snakellm.report import landing as landingmod

# ---------------------------------------------------------------- lookups of the report rules

REPORT = "results/report"

# `snakemake --report`'s landing page: each rule once in its rule graph (snakellm.report.landing)
landingmod.install()

HTTP_SOURCES = [s for s, spec in SOURCES.items() if spec["kind"] == "http"]

# Later stages add their metrics and samples to the report here, at parse time, from
# their own rules/*.smk (see register_report_table); rule report_table renders each entry.
REPORT_TABLES = (
    {}
)  # {"{stage}/{name}": {"files", "title", "note", "category", "subcategory", "figure"}}


def register_report_table(
    stage, name, files, title, note="", category=None, subcategory=None, figure=None
):
    """Put FILES (a metrics.json, a predictions/samples .jsonl, a .csv/.tsv; or a list of them)
    into `snakemake --report` as one HTML table: results/report/tables/{stage}/{name}.html,
    shown under CATEGORY (default: the stage, capitalised) / SUBCATEGORY (default: NAME) with the
    label FIGURE (default: TITLE). Snakemake's report lists results by their labels: two tables
    with the same category, subcategory and label would collapse into one menu entry, so that is
    an error here. The files must be outputs of rules; the table is rebuilt only when they change.
    """
    key = f"{stage}/{name}"
    if key in REPORT_TABLES:
        raise WorkflowError(f"report table {key!r} registered twice")
    entry = {
        "files": [files] if isinstance(files, str) else list(files),
        "title": title,
        "note": note,
        "category": category or stage.replace("_", " ").capitalize(),
        "subcategory": subcategory or name,
        "figure": figure or title,
    }
    where = (entry["category"], entry["subcategory"], entry["figure"])
    for other, e in REPORT_TABLES.items():
        if (e["category"], e["subcategory"], e["figure"]) == where:
            raise WorkflowError(
                f"report table {key!r}: {other!r} has the same category, subcategory and label "
                f"{where!r}; give one of them another figure= label"
            )
    REPORT_TABLES[key] = entry
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


def _graph_jobs():
    """Every job the dag pictures show, as Snakemake resolves them: (rule, wildcards) -> the files it reads.

    Walked from the default target with the workflow's own rules and input functions (what
    `snakemake --dag --forceall` does), so any stage's lookups count, with nothing to keep in step here.
    """
    all_rules = list(workflow.rules)
    root = workflow.get_rule(workflow.default_target)
    jobs = {(root.name, ()): sorted(map(str, root.expand_input({})[0]))}
    todo, seen = list(jobs[(root.name, ())]), set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for r in all_rules:
            if r.name == root.name or not r.is_producer(f):
                continue
            wc = dict(r.get_wildcards(f))
            key = (r.name, tuple(sorted(wc.items())))
            if key in jobs:
                continue
            # a rule whose output pattern matches but whose lookups refuse these wildcards (not its job)
            try:
                inputs = sorted(map(str, r.expand_input(wc)[0]))
            except Exception:
                continue
            jobs[key] = inputs
            todo += inputs
    return jobs


def get_dag_graph(wildcards):
    """A short digest of what the dag pictures draw: the rules in order, every job and the files it reads.

    The dag rule's only rerun trigger besides its code: editing a training setting changes no picture,
    adding a source, run or fine-tune does (and `snakemake -n` then prints two digests, not the config).
    """
    shape = {
        "rules": [r.name for r in workflow.rules],
        "jobs": sorted(map(list, _graph_jobs().items())),
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def get_dag_config(wildcards, resources):
    """The workflow's whole config in a file for `snakellm dag` (--config-json-file), named by its digest.

    Taking `resources` keeps it out of Snakemake's params rerun trigger (get_dag_graph is the trigger);
    a file, not the command line, keeps the printed command short.
    """
    # in the config's own key order: the sources' order is the corpus order of a curation index, whose plan
    # file every parse rewrites when it differs (sorted keys flipped it, and curation reran after each dag job)
    text = json.dumps(config, default=str)
    path = f".snakemake/snakellm/dag-config-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    return path


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
    if get_lm_eval_targets():
        out += [
            f"{REPORT}/evaluation/{n}.lm_eval.{ext}"
            for n in list(RUNS) + list(IMPORTS)
            for ext in ("html", "svg")
        ]
    for name, ft in FINETUNES.items():
        out += [
            f"{REPORT}/finetune/{ft['run']}/{name}.{ext}"
            for ext in ("html", "loss.svg")
        ]
    out += [f"{REPORT}/tables/{key}.html" for key in REPORT_TABLES]
    return out


def get_report_lm_eval_input(wildcards):
    """The run's suites, then those of its fine-tunes' merged models (one table per suite and model)."""
    return [
        f"runs/{wildcards.run}/lm_eval/{suite}.json" for suite in LM_EVAL["suites"]
    ] + lm_eval_finetune_files(wildcards.run)


def get_report_finetune_input(wildcards):
    """The fine-tune's metrics and summary, and the base and tuned evaluations (rules/common/finetune.smk)."""
    ft = _ft(wildcards)
    d = f"runs/{ft['run']}"
    base, ev = base_eval_dir(wildcards.ft), f"{d}/eval/{wildcards.ft}"
    own = {
        "metrics": f"{d}/finetune/{wildcards.ft}/metrics.jsonl",
        "summary": f"{d}/finetune/{wildcards.ft}/finetune_summary.json",
    }
    # a DPO fine-tune is evaluated in the fine-tune itself (held-out pairs): its comparison is before and after
    if ft["method"] == "dpo":
        return own | (
            {"comparison": f"{ev}/comparison.json"} if _has_test_pairs(ft) else {}
        )
    return own | {
        "base": f"{base}/metrics.json",
        "tuned": f"{ev}/tuned/metrics.json",
        "base_predictions": f"{base}/predictions.jsonl",
        "tuned_predictions": f"{ev}/tuned/predictions.jsonl",
        "comparison": f"{ev}/comparison.json",
    }


def get_report_finetune_evals(wildcards, input):
    """The base-vs-tuned flags of `snakellm report finetune` (none for a DPO fine-tune)."""
    flags = ("base", "tuned", "base_predictions", "tuned_predictions", "comparison")
    return " ".join(
        f"--{k.replace('_', '-')} {input[k]}" for k in flags if k in input.keys()
    )


def on_success():
    """What a successful run ends with (the Snakefile's onsuccess): the data stage's counts by source, the
    chunk that lost the largest share, and the command that writes the HTML report (snakellm.report.summary).
    """
    from snakellm.report import summary

    for line in summary.success_lines(list(SOURCES)):
        print(line, file=sys.stderr)


def on_start():
    """Before the jobs run (the Snakefile's onstart): a job that reruns for a changed setting gets a pointer to
    `snakellm why`, whose answer is the changed keys; Snakemake's reason is both command lines whole.
    (Snakemake's own DAG and reasons, read defensively: nothing here may stop a run.)"""
    try:
        dag = workflow.dag
        changed = [j for j in dag.needrun_jobs() if dag.reason(j).params_changed]
    except Exception:  # an internal of another Snakemake version
        return
    for job in changed[:3]:
        target = str(job.output[0]) if job.output else ""
        print(
            f"snakellm: {job.rule.name} reruns for a changed setting; `snakellm why {target}` lists which",
            file=sys.stderr,
        )
    if len(changed) > 3:
        print(
            f"snakellm: ... and {len(changed) - 3} more jobs for changed settings",
            file=sys.stderr,
        )
