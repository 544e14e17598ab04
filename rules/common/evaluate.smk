# Lookups and targets of lm-evaluation-harness (rules/evaluate.smk); included by the Snakefile after
# rules/common.smk and rules/common/export.smk (IMPORTS).


# ---------------------------------------------------------------- lm-evaluation-harness (rules/evaluate.smk)

LM_EVAL = config["lm_eval"]
LM_EVAL_TASKS = "data/lm_eval/tasks"  # the shipped suite's task YAMLs and jsonl files (rule lm_eval_tasks)


def _shipped(rel):
    """A file of this repository's resources/: relative to the working directory when it lies under it
    (the README's commands), else absolute (a workflow run with -d elsewhere builds from the same files).
    """
    path = os.path.join(workflow.basedir, rel)
    short = os.path.relpath(path)
    return path if short.startswith("..") else short


LM_EVAL_SOURCES = {
    "wikipedia": _shipped("resources/wikipedia/enwiki-pages-articles-excerpt.xml.bz2"),
    "squad": _shipped("resources/squad/squad-dev-subset.json"),
}


wildcard_constraints:
    suite=_names_regex(LM_EVAL["suites"]),


def get_lm_eval_flags(wildcards):
    """The suite's settings (config: lm_eval.suites.NAME): editing one suite reruns that suite only."""
    return flags(S.LmEvalSuiteSettings, LM_EVAL["suites"][wildcards.suite])


def get_lm_eval_targets():
    """runs/{run}/lm_eval/{suite}.json of every run and import (on its Hugging Face export)."""
    if not (LM_EVAL["enabled"] and config["export_hf"]["enabled"]):
        return []
    return [
        f"runs/{n}/lm_eval/{suite}.json"
        for n in list(RUNS) + list(IMPORTS)
        for suite in LM_EVAL["suites"]
    ]


# the Hugging Face model of a fine-tune: LoRA merged into its base (merge_lora_hf), full SFT's own export
FINETUNE_HF = {"lora": "hf_merged", "full": "hf"}


def get_finetune_hf_dir(wildcards):
    ft = config["finetune"][wildcards.ft]
    if ft["run"] != wildcards.run or ft["method"] not in FINETUNE_HF:
        raise WorkflowError(
            f"finetune {wildcards.ft} of run {ft['run']} ({ft['method']}) has no Hugging Face model"
        )
    return f"runs/{wildcards.run}/finetune/{wildcards.ft}/{FINETUNE_HF[ft['method']]}"


def lm_eval_finetune_files(run):
    """runs/{run}/finetune/{ft}/lm_eval/{suite}.json of the run's LoRA and full fine-tunes (their HF models)."""
    if not get_lm_eval_targets():
        return []
    return [
        f"runs/{run}/finetune/{name}/lm_eval/{suite}.json"
        for name, ft in config.get("finetune", {}).items()
        if ft["run"] == run and ft["method"] in FINETUNE_HF
        for suite in LM_EVAL["suites"]
    ]
