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


# evaluate: generation on a fine-tune's test split, NeMo's metric names and predictions file.
# The base model is evaluated once per run, data set and evaluation settings, shared by every fine-tune
# with the same three: runs/{run}/eval/base/{task}/{key}/ (key: snakellm.config.flags.base_eval_key);
# each fine-tune in runs/{run}/eval/{ft}/tuned/, and the two side by side in runs/{run}/eval/{ft}/comparison.*
# (a DPO fine-tune: its initial and tuned policy on the held-out pairs, from its finetune_summary.json)


rule evaluate_base:
    input:
        unpack(get_base_eval_input),
    output:
        metrics="runs/{run}/eval/base/{task}/{key}/metrics.json",
        predictions="runs/{run}/eval/base/{task}/{key}/predictions.jsonl",
        nemo="runs/{run}/eval/base/{task}/{key}/predictions_test_dataloader0_inputs_preds_labels.jsonl",
    log:
        "logs/evaluate/{run}/base/{task}/{key}.log",
    conda:
        "../envs/train.yaml"
    threads: get_base_eval_threads
    resources:
        **get_job_resources("evaluate"),
    params:
        launch=get_launch_prefix("evaluate"),
        flags=get_base_eval_flags,
        out=subpath(output.metrics, parent=True),
    shell:
        "{params.launch} snakellm evaluate --base runs/{wildcards.run} --label base --test {input.test} "
        "--out-dir {params.out} --threads {threads} {params.flags} --track-run runs/{wildcards.run} 2> {log}"


rule evaluate_finetune:
    input:
        unpack(get_evaluate_input),
    output:
        metrics="runs/{run}/eval/{ft}/tuned/metrics.json",
        predictions="runs/{run}/eval/{ft}/tuned/predictions.jsonl",
        nemo="runs/{run}/eval/{ft}/tuned/predictions_test_dataloader0_inputs_preds_labels.jsonl",
    log:
        "logs/evaluate/{run}/{ft}/tuned.log",
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
        "{params.launch} snakellm evaluate {params.model} --label tuned --test {input.test} "
        "--out-dir {params.out} --threads {threads} {params.flags} "
        "--track-run runs/{wildcards.run}/finetune/{wildcards.ft} 2> {log}"


rule compare_finetune:
    input:
        unpack(get_compare_input),
    output:
        multiext("runs/{run}/eval/{ft}/comparison", ".json", ".tsv", ".md"),
    log:
        "logs/compare_finetune/{run}/{ft}.log",
    conda:
        "../envs/train.yaml"
    params:
        sides=get_compare_sides,
        out=subpath(output[0], parent=True),
    shell:
        "snakellm compare-eval {params.sides} --name {wildcards.ft} "
        "--out-dir {params.out} --track-run runs/{wildcards.run}/finetune/{wildcards.ft} 2> {log}"


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
        # the evaluated run: runs/{run}, or runs/{run}/finetune/{ft} (evaluate_lm_finetune)
        track=subpath(output[0], ancestor=2),
    shell:
        "{params.launch} snakellm evaluate-lm {input.hf} --out {output} --suite {wildcards.suite} "
        "--include-path {input.tasks} --device auto --threads {threads} {params.flags} "
        "--track-run {params.track} 2> {log}"


# a fine-tune's own Hugging Face model (LoRA: merged by merge_lora_hf; full SFT: its hf/ export), evaluated
# with the same suites as its base
use rule evaluate_lm as evaluate_lm_finetune with:
    input:
        hf=get_finetune_hf_dir,
        tasks=LM_EVAL_TASKS,
    output:
        "runs/{run}/finetune/{ft}/lm_eval/{suite}.json",
    log:
        "logs/evaluate_lm/{run}/{ft}/{suite}.log",
    benchmark:
        "benchmarks/evaluate_lm/{run}/{ft}/{suite}.tsv"
