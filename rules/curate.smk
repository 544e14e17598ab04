# curate (sources with a `curate:` section): chunks -> signatures -> duplicate index -> curated chunks
# data/curated/{source}/{chunk}.jsonl, which the tokenizers then read (docs/data.md#curation).


rule curate_signatures:
    input:
        "data/jsonl/{source}/{chunk}.jsonl",
    output:
        npy="data/curated/{source}/signatures/{chunk}.npy",
        json="data/curated/{source}/signatures/{chunk}.json",
    log:
        "logs/curate_signatures/{source}/{chunk}.log",
    benchmark:
        "benchmarks/curate_signatures/{source}/{chunk}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 2
    params:
        flags=get_curate_flags,
        key=get_source_key,
    shell:
        "snakellm curate-signatures {input:q} --output {output.npy} --summary {output.json} --key {params.key:q} "
        "--source {wildcards.source} --chunk {wildcards.chunk} --threads {threads} {params.flags} 2> {log}"


rule curate_buckets:
    input:
        plan=get_index_plan,
        signatures=get_index_signatures,
    output:
        "data/curated-index/{index}/pairs-{job}-of-{jobs}.npy",
    log:
        "logs/curate_buckets/{index}/{job}-of-{jobs}.log",
    benchmark:
        "benchmarks/curate_buckets/{index}/{job}-of-{jobs}.tsv"
    wildcard_constraints:
        job=r"\d+",
        jobs=r"\d+",
    conda:
        "../envs/data.yaml"
    params:
        flags=get_bucket_flags,
    shell:
        "snakellm curate-buckets --chunks-file {input.plan} --output {output} --job {wildcards.job} --jobs {wildcards.jobs} "
        "{params.flags} 2> {log}"


checkpoint curate_index:
    input:
        plan=get_index_plan,
        pairs=get_index_pairs,
        signatures=get_index_signatures,
    output:
        "data/curated-index/{index}/index.json",
    log:
        "logs/curate_index/{index}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm curate-index --pairs {input.pairs:q} --chunks-file {input.plan} --summary {output} 2> {log}"


rule curate_chunk:
    input:
        jsonl="data/jsonl/{source}/{chunk}.jsonl",
        npy="data/curated/{source}/signatures/{chunk}.npy",
        json="data/curated/{source}/signatures/{chunk}.json",
        removal=get_removal_list,
    output:
        jsonl="data/curated/{source}/{chunk}.jsonl",
        stats="data/curated/{source}/{chunk}.stats.json",
        removed="data/curated/{source}/{chunk}.removed.jsonl",
    log:
        "logs/curate_chunk/{source}/{chunk}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm curate {input.jsonl:q} --signatures {input.npy} --signature-summary {input.json} "
        "--removal-list {input.removal} --output {output.jsonl} --removed {output.removed} --stats {output.stats} "
        "--source {wildcards.source} --chunk {wildcards.chunk} 2> {log}"


rule curate:
    """Every curated chunk: `snakemake curate` stops after curation."""
    input:
        get_all_curate_targets(),


# the report: Data / {source}: the curated chunks' counts, and each duplicate index's summary
for _source in CURATED:
    register_report_table(
        "curation",
        _source,
        [curated_outputs(_source, c)[1] for c in sorted(PLAN[_source])],
        f"{_source}: curated chunks",
        note="documents in and kept, removed by reason (data/curated/{source}/{chunk}.stats.json; each removed "
        "document is in {chunk}.removed.jsonl with its reason)",
        category="Data",
        subcategory=_source,
        figure="curated chunks",
    )
for _index, _members in CURATE_INDEXES.items():
    register_report_table(
        "curation",
        f"index-{_index}",
        index_summary_path(_index),
        f"duplicate index {_index} (sources {', '.join(_members)})",
        note="pairs, clusters and removed documents by reason across the index (data/curated-index/{index}/index.json)",
        category="Data",
        subcategory=_members[0],
        figure=f"duplicate index {_index}",
    )
