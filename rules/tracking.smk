# track_data: the data stages' counts (chunk: documents, rejected by reason; curate: documents in and out,
# removed by reason) per source as one W&B / MLflow data run per workflow (docs/tracking.md). Part of the
# default target only when the global `tracking:` configures a tracker; the run's ids stay in
# results/tracking/tracking.json, so a rerun (new shards) updates the same data run.


rule track_data:
    input:
        get_track_data_stats,
    output:
        "results/tracking/data.json",
    log:
        "logs/track_data.log",
    conda:
        "../envs/data.yaml"
    params:
        flags=get_track_data_flags,
        state=subpath(output[0], parent=True),
    shell:
        "snakellm track-data {input:q} --state-dir {params.state} --output {output} {params.flags} 2> {log}"
