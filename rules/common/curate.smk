# Lookups and targets of the curate stage (rules/curate.smk; the tokenizers read text_chunk);
# included by the Snakefile after rules/common.smk.

# ---------------------------------------------------------------- curate stage (rules/curate.smk)

CURATE_INDEXES = checkmod.curate_indexes(config)  # {index: [sources, in config order]}
CURATED = {
    s: SOURCES[s]["curate"] for members in CURATE_INDEXES.values() for s in members
}
INDEX_OF = {s: i for i, members in CURATE_INDEXES.items() for s in members}


wildcard_constraints:
    index=_names_regex(CURATE_INDEXES),


def signature_path(source, chunk):
    return f"data/curated/{source}/signatures/{chunk}.npy"


def removal_list_path(source, chunk):
    """Written by the index (checkpoint) job, only when its content changes: not a declared output."""
    return f"data/curated/{source}/removal/{chunk}.json"


def index_summary_path(index):
    return f"data/curated-index/{index}/index.json"


def index_chunks(index):
    """(source, chunk) of an index in corpus order: sources in config order, then chunks."""
    return [(s, c) for s in CURATE_INDEXES[index] for c in sorted(PLAN[s])]


def index_settings(index):
    return CURATED[CURATE_INDEXES[index][0]]


def index_jobs(index):
    near = index_settings(index).get("near")
    return near["index_jobs"] if near else 1


def get_index_signatures(wildcards):
    return [signature_path(s, c) for s, c in index_chunks(wildcards.index)]


def get_index_pairs(wildcards):
    n = index_jobs(wildcards.index)
    return [
        f"data/curated-index/{wildcards.index}/pairs-{j}-of-{n}.npy" for j in range(n)
    ]


def index_plan_path(index):
    """The index's chunks, one `source/chunk<TAB>signatures<TAB>removal list` line each, in corpus order: the
    bucket and index jobs read them from this file (a source of 10^4 chunks is no command line).
    """
    return f"data/plan/curate-index/{index}.tsv"


def _write_index_plans():
    """Each index's chunk list, rewritten only when it changed (like the shard lists)."""
    from snakellm.io.atomic import write_text

    for index in CURATE_INDEXES:
        text = "".join(
            f"{s}/{c}\t{signature_path(s, c)}\t{removal_list_path(s, c)}\n"
            for s, c in index_chunks(index)
        )
        path = index_plan_path(index)
        try:
            with open(path, encoding="utf-8") as fh:
                if fh.read() == text:
                    continue
        except FileNotFoundError:
            pass
        write_text(path, text)


def get_index_plan(wildcards):
    return index_plan_path(wildcards.index)


# computed once: a source of 10^6 shards has a signature job per chunk
CURATE_FLAGS = {s: flagmod.curate_flags(cur) for s, cur in CURATED.items()}
BUCKET_FLAGS = {
    i: flagmod.curate_flags(index_settings(i), filters=False) for i in CURATE_INDEXES
}


def get_curate_flags(wildcards):
    """The source's curate settings (config: sources.NAME.curate): a change reruns its signature jobs."""
    return CURATE_FLAGS[wildcards.source]


def get_bucket_flags(wildcards):
    return BUCKET_FLAGS[wildcards.index]


def get_removal_list(wildcards):
    """The chunk's removal list, known once its index (a checkpoint) has run; a list whose content the index
    did not change keeps its mtime, so the curated chunk is not rebuilt."""
    checkpoints.curate_index.get(index=INDEX_OF[wildcards.source])
    return removal_list_path(wildcards.source, wildcards.chunk)


def text_chunk(source, chunk):
    """The jsonl the tokenizers read: the curated chunk when the source is curated, else the chunk."""
    if source in CURATED:
        return f"data/curated/{source}/{chunk}.jsonl"
    return f"data/jsonl/{source}/{chunk}.jsonl"


def get_text_chunk(wildcards):
    return text_chunk(wildcards.source, wildcards.chunk)


EMPTY_OK_FORMATS = (*S.COLUMNAR_FORMATS, "warc")


def get_tokenize_empty_flag(wildcards):
    """A curated chunk may be empty (every document removed), and so may a parquet, arrow or warc chunk (a file
    cut short, quarantined whole; a WARC of no HTML): a dataset of no documents, left out of the blend.
    """
    fmt = SOURCES[wildcards.source]["format"]
    return (
        "--allow-empty"
        if wildcards.source in CURATED or fmt in EMPTY_OK_FORMATS
        else ""
    )


def curated_outputs(source, chunk):
    stem = f"data/curated/{source}/{chunk}"
    return [f"{stem}.jsonl", f"{stem}.stats.json", f"{stem}.removed.jsonl"]


def get_all_curate_targets():
    return [p for s in CURATED for c in PLAN[s] for p in curated_outputs(s, c)]


def _check_removal_lists():
    """A removal list deleted by hand: its index runs again (the lists are no declared outputs)."""
    for index in CURATE_INDEXES:
        summary = index_summary_path(index)
        if os.path.exists(summary) and any(
            not os.path.exists(removal_list_path(s, c)) for s, c in index_chunks(index)
        ):
            print(
                f"{summary}: a chunk's removal list is missing; indexing again",
                file=sys.stderr,
            )
            os.remove(summary)


if workflow.is_main_process:
    _check_removal_lists()
    _write_index_plans()
