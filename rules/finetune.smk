# prepare_sft: a SQuAD json / jsonl -> data/sft/{task}/{train,validation,test}.jsonl (+ rejected, stats)
# finetune:    a pretrained run + a data set -> runs/{run}/finetune/{ft}/ (LoRA, full SFT or p-tuning)
# export_peft: a LoRA adapter (or a p-tuning prompt table) in Hugging Face PEFT format, naming its base
#              (the run's hf/ export) as base_model_name_or_path
# export_finetune_hf, export_finetune_nemo: a full fine-tune's model as hf/ and {ft}.nemo
# merge_lora_hf: base + LoRA folded into one Hugging Face model directory (streamed, one layer at a time)
# finetunes:   the target of the whole chain (`snakemake finetunes`): every fine-tune, its evaluation,
#              PEFT adapter, merged model, and the .nemo of an imported base
#
# As for pretrain, the checkpoint directory is not an output: a killed or stopped
# finetune resumes from it (exit status 75 = stopped with a checkpoint, rerun to resume).


rule prepare_sft:
    input:
        get_sft_source,
    output:
        multiext(
            "data/sft/{task}/",
            "train.jsonl",
            "validation.jsonl",
            "test.jsonl",
            "rejected.jsonl",
            "stats.json",
        ),
    log:
        "logs/prepare_sft/{task}.log",
    conda:
        "../envs/train.yaml"
    params:
        out=subpath(output[0], parent=True),
        flags=get_sft_flags,
    shell:
        "snakellm prepare-sft {input} {params.out} {params.flags} 2> {log}"


rule reference_logprobs:
    input:
        unpack(get_reference_input),
    output:
        "runs/{run}/finetune/{ft}/reference_logprobs.json",
    log:
        "logs/reference_logprobs/{run}/{ft}.log",
    benchmark:
        "benchmarks/reference_logprobs/{run}/{ft}.tsv"
    conda:
        "../envs/train.yaml"
    threads: get_finetune_threads
    resources:
        **get_job_resources("evaluate"),
    params:
        flags=get_reference_flags,
        data=subpath(input.train, parent=True),
    shell:
        "snakellm reference-logprobs --data-dir {params.data} --out {output} "
        "--threads {threads} {params.flags} 2> {log}"


rule finetune:
    input:
        unpack(get_finetune_input),
    output:
        summary="runs/{run}/finetune/{ft}/finetune_summary.json",
        metrics="runs/{run}/finetune/{ft}/metrics.jsonl",
    log:
        "logs/finetune/{run}/{ft}.log",
    benchmark:
        "benchmarks/finetune/{run}/{ft}.tsv"
    conda:
        "../envs/train.yaml"
    threads: get_finetune_threads
    resources:
        **get_job_resources("finetune"),
    params:
        launch=get_launch_prefix("finetune"),
        flags=get_finetune_flags,
        reference=lambda wc, input: (
            f"--reference-logprobs {input.reference}"
            if "reference" in input.keys()
            else ""
        ),
        data=subpath(input.train, parent=True),
        out=subpath(output.summary, parent=True),
        base=get_finetune_base,
    shell:
        "{params.launch} snakellm finetune --base {params.base} --data-dir {params.data} "
        "--out-dir {params.out} --threads {threads} --no-progress {params.flags} "
        "{params.reference} 2> {log}"


rule export_peft:
    input:
        unpack(get_export_peft_input),
    output:
        "runs/{run}/finetune/{ft}/hf_peft/adapter_config.json",
        "runs/{run}/finetune/{ft}/hf_peft/adapter_model.safetensors",
    log:
        "logs/export_peft/{run}/{ft}.log",
    conda:
        "../envs/train.yaml"
    resources:
        **get_job_resources("convert"),
    params:
        source=get_export_peft_source,
        out=subpath(output[0], parent=True),
    shell:
        "snakellm lora export-peft {params.source} --base-model {input.base} "
        "--out {params.out} 2> {log}"


# a full fine-tune's model/ is a run of its own: exported as the run's checkpoint is


rule export_finetune_hf:
    input:
        get_full_finetune_summary,
    output:
        directory("runs/{run}/finetune/{ft}/hf"),
    log:
        "logs/export_hf/{run}/{ft}.log",
    conda:
        "../envs/train.yaml"
    params:
        model=subpath(input[0], parent=True),
        flags=flags(S.ExportHfSettings, config["export_hf"]),
    shell:
        "snakellm export-hf {params.model}/model {output} {params.flags} 2> {log}"


rule export_finetune_nemo:
    input:
        get_full_finetune_summary,
    output:
        "runs/{run}/finetune/{ft}/{ft}.nemo",
    log:
        "logs/export_nemo/{run}/{ft}.log",
    conda:
        "../envs/train.yaml"
    threads: 2
    params:
        model=subpath(input[0], parent=True),
        flags=flags(S.ExportNemoSettings, EXPORT_NEMO),
    shell:
        "snakellm export-nemo {params.model}/model {output} --threads {threads} "
        "{params.flags} 2> {log}"


rule merge_lora_hf:
    input:
        base=get_merge_base_input,
        summary="runs/{run}/finetune/{ft}/finetune_summary.json",
    output:
        directory("runs/{run}/finetune/{ft}/hf_merged"),
    log:
        "logs/merge_lora_hf/{run}/{ft}.log",
    benchmark:
        "benchmarks/merge_lora_hf/{run}/{ft}.tsv"
    conda:
        "../envs/train.yaml"
    resources:
        **get_job_resources("convert"),
    params:
        adapter=subpath(input.summary, parent=True),
        base=get_finetune_base,
        flags=flags(S.ExportHfSettings, config["export_hf"]),
    shell:
        "snakellm lora merge-hf --base {params.base} --adapter {params.adapter}/adapter "
        "--out {output} {params.flags} 2> {log}"


rule finetunes:
    """Every fine-tune with its evaluation and exports: `snakemake finetunes` stops there."""
    input:
        get_finetune_chain_targets(),
