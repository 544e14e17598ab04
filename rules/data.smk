# download (http sources) and chunk: sources -> data/jsonl/{source}/{chunk}.jsonl


rule download:
    input:
        urls=get_download_url_list,
    output:
        manifest="data/raw/{source}/{chunk}.manifest.json",
    log:
        "logs/download/{source}/{chunk}.log",
    conda:
        "../envs/data.yaml"
    resources:
        downloads=1,
    params:
        dest=get_raw_dir,
        flags=DOWNLOAD_FLAGS,
        format=lambda w: SOURCES[w.source]["format"],
        token=get_download_token_option,
    shell:
        "snakellm download --dest {params.dest} --manifest {output.manifest} "
        "--source {wildcards.source} --chunk {wildcards.chunk} --format {params.format} {params.flags} "
        "{params.token}--url-file {input.urls} 2> {log}"


rule chunk:
    input:
        get_chunk_input,
    output:
        jsonl="data/jsonl/{source}/{chunk}.jsonl",
        stats="data/jsonl/{source}/{chunk}.stats.json",
        rejected="data/jsonl/{source}/{chunk}.rejected.jsonl",
    log:
        "logs/chunk/{source}/{chunk}.log",
    benchmark:
        "benchmarks/chunk/{source}/{chunk}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 2
    params:
        shards=get_chunk_shards_option,
        flags=get_source_flags,
        limits=get_chunk_limits,
    shell:
        "snakellm chunk {params.shards} --output {output.jsonl} --stats {output.stats} "
        "--rejected {output.rejected} {params.flags} {params.limits} "
        "--source {wildcards.source} --chunk {wildcards.chunk} --threads {threads} 2> {log}"


rule data:
    """Every chunk of every source: `snakemake data` stops after the data stage."""
    input:
        get_all_chunk_targets(),
