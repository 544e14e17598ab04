# Artifacts that leave the workflow, made from a run's final checkpoint.
# Each export is its own block: .nemo here; Hugging Face (export_hf / import_hf) below it.


# ---------------------------------------------------------------- .nemo (snakellm/export/nemo.py)
# runs/{run}/train_summary.json is written last when pretraining finishes, so it stands for the
# checkpoint: a retrained run rewrites it and the .nemo follows. The tokenizer packed is the one the
# run carries (runs/{run}/tokenizer/); params carry the export's own settings. The output is written atomically.
# `snakellm import-nemo FILE.nemo runs/NAME` is the reverse (a CLI step, no rule: its input is
# a file from outside the workflow).


rule export_nemo:
    input:
        summary=get_run_done,  # train_summary.json, or an import's import_summary.json
    output:
        "runs/{run}/{run}.nemo",
    log:
        "logs/export_nemo/{run}.log",
    conda:
        "../envs/train.yaml"
    threads: 2
    resources:
        **get_job_resources("convert"),
    params:
        flags=flags(S.ExportNemoSettings, EXPORT_NEMO),
    shell:
        "snakellm export-nemo runs/{wildcards.run} {output} --threads {threads} "
        "{params.flags} 2> {log}"


# ---------------------------------------------------------------- Hugging Face: export_hf, import_hf


rule export_hf:
    input:
        done=get_run_done,
    output:
        directory("runs/{run}/hf"),
    log:
        "logs/export_hf/{run}.log",
    benchmark:
        "benchmarks/export_hf/{run}.tsv"
    conda:
        "../envs/train.yaml"
    resources:
        **get_job_resources("convert"),
    params:
        flags=flags(S.ExportHfSettings, config["export_hf"]),
    shell:
        "snakellm export-hf runs/{wildcards.run} {output} {params.flags} 2> {log}"


# import_hf.NAME.random: the Hugging Face directory itself is made here, a preset's shape with random
# weights written one layer at a time (the chain at 7-8B without downloading weights).
rule random_hf:
    output:
        directory("models/random/{name}"),
    log:
        "logs/random_hf/{name}.log",
    benchmark:
        "benchmarks/random_hf/{name}.tsv"
    wildcard_constraints:
        name=_names_regex(RANDOM_IMPORTS),
    conda:
        "../envs/train.yaml"
    resources:
        **get_job_resources("convert"),
    params:
        flags=get_random_hf_flags,
    shell:
        "snakellm random-hf {output} {params.flags} 2> {log}"


# The checkpoint directory is not an output (as for pretrain): the summary is written
# after the checkpoint is complete.
rule import_hf:
    input:
        get_import_hf_files,
    output:
        "runs/{run}/import_summary.json",
    log:
        "logs/import_hf/{run}.log",
    conda:
        "../envs/train.yaml"
    resources:
        **get_job_resources("convert"),
    params:
        hf_dir=get_import_hf_dir,
        flags=get_import_hf_flags,
    shell:
        "snakellm import-hf {params.hf_dir:q} runs/{wildcards.run} {params.flags} 2> {log}"
