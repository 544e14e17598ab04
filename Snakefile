# snakellm: raw text shards -> jsonl chunks -> Megatron .bin/.idx -> checkpoints
# -> .nemo / Hugging Face -> fine-tunes -> evaluation and a report.
# See README.md; the graph and layout are described in docs there.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/common/curate.smk"
include: "rules/common/launch.smk"
include: "rules/common/export.smk"
include: "rules/common/evaluate.smk"
include: "rules/common/finetune.smk"
include: "rules/common/report.smk"
include: "rules/data.smk"
include: "rules/curate.smk"
include: "rules/tokenize.smk"
include: "rules/train.smk"
include: "rules/export.smk"
include: "rules/finetune.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"
include: "rules/tracking.smk"


rule all:
    default_target: True
    input:
        get_all_targets(),


onsuccess:
    on_success()
