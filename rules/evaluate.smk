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
    threads: get_generate_threads
    params:
        args=get_generate_args,
    shell:
        "snakellm generate runs/{wildcards.run} --device auto --threads {threads} "
        "--out {output.samples} --markdown {output.markdown} {params.args} 2> {log}"
