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
