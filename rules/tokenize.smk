# train_tokenizer, tokenize, blend: chunks -> data/tokens/{tokenizer}/...
# Paths come from get_* functions in common.smk, settings flags from the settings dataclasses
# (snakellm.config.sections); the work is in snakellm.


rule train_tokenizer:
    input:
        get_train_tokenizer_input,
    output:
        model="tokenizers/{tokenizer}/tokenizer.model",
        vocab="tokenizers/{tokenizer}/tokenizer.vocab",
        stats="tokenizers/{tokenizer}/tokenizer.stats.json",
    log:
        "logs/train_tokenizer/{tokenizer}.log",
    benchmark:
        "benchmarks/train_tokenizer/{tokenizer}.tsv"
    wildcard_constraints:
        tokenizer="|".join(map(__import__("re").escape, TRAINED_TOKENIZERS)) or "(?!)",
    conda:
        "../envs/data.yaml"
    threads: get_train_tokenizer_threads
    params:
        key_flags=get_train_tokenizer_keys,
        flags=get_train_tokenizer_flags,
    shell:
        "snakellm train-tokenizer {input:q} {params.key_flags} --model {output.model} --vocab {output.vocab} "
        "--stats {output.stats} {params.flags} 2> {log}"


rule tokenize:
    input:
        jsonl=get_text_chunk,
        tokenizer=get_tokenizer_files,
    output:
        multiext(
            "data/tokens/{tokenizer}/{source}/{chunk}_text_document",
            ".bin",
            ".idx",
            ".stats.json",
        ),
    log:
        "logs/tokenize/{tokenizer}/{source}/{chunk}.log",
    benchmark:
        "benchmarks/tokenize/{tokenizer}/{source}/{chunk}.tsv"
    conda:
        "../envs/data.yaml"
    threads: TOKENIZE_THREADS
    params:
        prefix=subpath(output[0], strip_suffix=".bin"),
        tokenizer=get_tokenizer_flags,
        key=get_source_key,
        empty=get_tokenize_empty_flag,
    shell:
        "snakellm tokenize {input.jsonl} {params.prefix} --key {params.key:q} --threads {threads} {params.empty} "
        "--source {wildcards.source} --chunk {wildcards.chunk} --name {wildcards.tokenizer} {params.tokenizer} 2> {log}"


rule blend:
    input:
        stats=get_blend_stats,
        data=get_blend_data,
    output:
        json="data/tokens/{tokenizer}/blend.json",
        txt="data/tokens/{tokenizer}/blend.txt",
    log:
        "logs/blend/{tokenizer}.log",
    conda:
        "../envs/data.yaml"
    params:
        weights=get_blend_weights,
    shell:
        "snakellm blend {input.stats:q} --output {output.json} --text {output.txt} {params.weights} 2> {log}"
