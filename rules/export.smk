# Artifacts that leave the workflow: runs/{run}/hf/ (and runs/{run}/{run}.nemo: export_nemo).
# Paths and flags come from get_* functions in common.smk; the work is in snakellm.export.

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
    params:
        args=get_export_hf_args,
    shell:
        "snakellm export-hf runs/{wildcards.run} {output} {params.args} 2> {log}"


# The checkpoint directory is not an output (as for pretrain): the summary is written
# after the checkpoint is complete.
rule import_hf:
    input:
        get_import_hf_files,
    output:
        "runs/{run}/import_summary.json",
    log:
        "logs/import_hf/{run}.log",
    params:
        hf_dir=get_import_hf_dir,
        args=get_import_hf_args,
    shell:
        "snakellm import-hf {params.hf_dir:q} runs/{wildcards.run} {params.args} 2> {log}"
