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
    threads: get_generate_threads
    params:
        args=get_generate_args,
    shell:
        "snakellm generate runs/{wildcards.run} --device auto --threads {threads} "
        "--out {output.samples} --markdown {output.markdown} {params.args} 2> {log}"


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
    params:
        args=get_evaluate_args,
        out=subpath(output.metrics, parent=True),
    shell:
        "snakellm evaluate --test {input.test} --out-dir {params.out} --threads {threads} "
        "{params.args} 2> {log}"
