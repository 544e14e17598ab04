# pretrain: data/tokens/{tokenizer}/blend.json -> runs/{run}/ (checkpoints, metrics, summary)
#
# The checkpoint directory is deliberately not an output: Snakemake deletes a
# job's outputs before it runs and after it fails, and a retry, a Slurm requeue
# or a rerun after a settings change must find the checkpoints to resume from
# (or to move aside, see `snakellm train --on-config-change`). The declared
# outputs are written atomically once the run reached its last step.
# Exit status 75 means "stopped cleanly with a checkpoint" (SIGTERM/SIGUSR1 or
# train.max_time); with retries (train.retries, else the profile's) Snakemake starts the next attempt,
# which resumes.


rule pretrain:
    input:
        blend=get_train_blend,
        data=get_train_data,
    output:
        summary="runs/{run}/train_summary.json",
        metrics="runs/{run}/metrics.jsonl",
    log:
        "logs/pretrain/{run}.log",
    benchmark:
        "benchmarks/pretrain/{run}.tsv"
    retries: TRAIN_RETRIES
    conda:
        "../envs/train.yaml"
    threads: get_train_threads
    resources:
        **get_job_resources("pretrain"),
    params:
        launch=get_launch_prefix("pretrain"),
        flags=get_train_flags,
    shell:
        "{params.launch} snakellm train --blend {input.blend} --run-dir runs/{wildcards.run} "
        "--run-name {wildcards.run} --threads {threads} {params.flags} 2> {log}"
