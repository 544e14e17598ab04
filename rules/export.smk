# Artifacts that leave the workflow, made from a run's final checkpoint.
# Each export is its own block: .nemo here; Hugging Face (export_hf / import_hf) below it.


# ---------------------------------------------------------------- .nemo (snakellm/export/nemo.py)
# runs/{run}/train_summary.json is written last when pretraining finishes, so it stands for the
# checkpoint: a retrained run rewrites it and the .nemo follows. The blend supplies the tokenizer
# files that are packed; params carry the export's own settings. The output is written atomically.
# `snakellm import-nemo FILE.nemo runs/NAME` is the reverse (a CLI step, no rule: its input is
# a file from outside the workflow).


rule export_nemo:
    input:
        summary="runs/{run}/train_summary.json",
        blend=get_train_blend,
    output:
        "runs/{run}/{run}.nemo",
    log:
        "logs/export_nemo/{run}.log",
    threads: 2
    params:
        args=get_export_nemo_args,
    shell:
        "snakellm export-nemo runs/{wildcards.run} {output} --blend {input.blend} --threads {threads} "
        "{params.args} 2> {log}"
