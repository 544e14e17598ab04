# Evaluation and samples of the trained (or imported) models.

# ---------------------------------------------------------------- generate


rule generate:
    input:
        done=get_run_done,
    output:
        samples="runs/{run}/samples.jsonl",
        markdown="runs/{run}/samples.md",
    log:
        "logs/generate/{run}.log",
    conda:
        "../envs/train.yaml"
    threads: config["generate"]["threads"]
    resources:
        **get_job_resources("generate"),
    params:
        launch=get_launch_prefix("generate"),
        flags=flags(S.GenerateSettings, config["generate"]),
    shell:
        "{params.launch} snakellm generate runs/{wildcards.run} --device auto --threads {threads} "
        "--out {output.samples} --markdown {output.markdown} {params.flags} 2> {log}"


# the samples in the report: Generation / {run}
if config["generate"]["enabled"]:
    for _name in list(RUNS) + list(IMPORTS):
        register_report_table(
            "generation",
            _name,
            f"runs/{_name}/samples.jsonl",
            f"{_name}: generated samples",
            note="continuations of the configured prompts (config: generate), as snakellm generate wrote them",
            subcategory=_name,
            figure="samples",
        )


# evaluate: greedy generation on a fine-tune's test split, for the base model and the tuned one side by side
# -> runs/{run}/eval/{ft}/{base,tuned}/metrics.json + predictions.jsonl


rule evaluate_finetune:
    input:
        unpack(get_evaluate_input),
    output:
        metrics="runs/{run}/eval/{ft}/{which}/metrics.json",
        predictions="runs/{run}/eval/{ft}/{which}/predictions.jsonl",
    log:
        "logs/evaluate/{run}/{ft}/{which}.log",
    conda:
        "../envs/train.yaml"
    threads: get_finetune_threads
    resources:
        **get_job_resources("evaluate"),
    params:
        launch=get_launch_prefix("evaluate"),
        model=get_evaluate_model,
        flags=get_evaluate_flags,
        out=subpath(output.metrics, parent=True),
    shell:
        "{params.launch} snakellm evaluate {params.model} --label {wildcards.which} --test {input.test} "
        "--out-dir {params.out} --threads {threads} {params.flags} 2> {log}"


# ---------------------------------------------------------------- lm-evaluation-harness (snakellm/eval/lm_harness.py)
# lm_eval_tasks: the shipped suite (snakellm_wikitext, _lambada, _cont4, _squad), lm-eval task YAMLs over
# jsonl files built from resources/ (docs/evaluation.md). evaluate_lm: every suite of lm_eval.suites on
# each run's Hugging Face export, offline -> runs/{run}/lm_eval/{suite}.json (lm-eval's results and samples).


rule lm_eval_tasks:
    input:
        **LM_EVAL_SOURCES,
    output:
        directory(LM_EVAL_TASKS),
    log:
        "logs/lm_eval_tasks.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm evaluate-lm --build-tasks {output} --wikipedia {input.wikipedia:q} "
        "--squad {input.squad:q} 2> {log}"


rule evaluate_lm:
    input:
        hf="runs/{run}/hf",
        tasks=LM_EVAL_TASKS,
    output:
        "runs/{run}/lm_eval/{suite}.json",
    log:
        "logs/evaluate_lm/{run}/{suite}.log",
    benchmark:
        "benchmarks/evaluate_lm/{run}/{suite}.tsv"
    conda:
        "../envs/train.yaml"
    threads: LM_EVAL["threads"]
    resources:
        **get_job_resources("evaluate"),
    params:
        launch=get_launch_prefix("evaluate"),
        flags=get_lm_eval_flags,
    shell:
        "{params.launch} snakellm evaluate-lm {input.hf} --out {output} --suite {wildcards.suite} "
        "--include-path {input.tasks} --device auto --threads {threads} {params.flags} 2> {log}"


# a LoRA fine-tune's merged Hugging Face model (rule merge_lora_hf), evaluated with the same suites as its base
use rule evaluate_lm as evaluate_lm_finetune with:
    input:
        hf="runs/{run}/finetune/{ft}/hf_merged",
        tasks=LM_EVAL_TASKS,
    output:
        "runs/{run}/finetune/{ft}/lm_eval/{suite}.json",
    log:
        "logs/evaluate_lm/{run}/{ft}/{suite}.log",
    benchmark:
        "benchmarks/evaluate_lm/{run}/{ft}/{suite}.tsv"
