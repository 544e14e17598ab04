# Report figures and tables: results/report/... -> `snakemake --report report.html`.
#
# Every output here is a `report(...)` with an RST caption from report/ (what the reader
# sees and how to read it), a category (Workflow, Data, Tokens, Training, later stages)
# and a subcategory (the source, tokenizer or run). They are part of the default target,
# so `snakemake` keeps them current and `snakemake --report report.html` only collects
# them; each is redrawn only when the files it is drawn from change.
#
# Later stages: call register_report_table(stage, name, files, title, ...) (rules/common/report.smk)
# from your rules/*.smk to add a metrics.json / samples .jsonl / .csv of yours as a table
# (rule report_table), or give your own rule `report(...)` outputs with a caption in
# report/ and category="<Stage>" (see README, "Reports and DAG pictures").


# cheap steps that read a few small files: run them where Snakemake runs, not as cluster jobs
localrules:
    dag,
    report_data,
    report_data_overview,
    report_download,
    report_tokens_overview,
    report_tokenizer,
    report_train,
    report_lm_eval,
    report_finetune,
    report_table,


rule dag:
    output:
        rulegraph=report(
            "results/report/workflow/rulegraph.svg",
            caption="../report/rulegraph.rst",
            category="DAG",
            labels={"figure": "rule graph"},
        ),
        jobs=report(
            "results/report/workflow/jobs.svg",
            caption="../report/jobs.rst",
            category="DAG",
            labels={"figure": "job DAG"},
        ),
    log:
        "logs/report/dag.log",
    conda:
        "../envs/data.yaml"
    params:
        graph=get_dag_graph,  # reruns when the pictures can change, not on every config edit
        config=get_dag_config,
        snakefile=get_main_snakefile,
    shell:
        "snakellm dag --rulegraph {output.rulegraph} --jobs {output.jobs} --snakefile {params.snakefile:q} "
        "--config-json-file {params.config:q} 2> {log}"


rule report_data:
    input:
        stats=get_report_data_stats,
        rejected=get_report_data_rejected,
    output:
        table=report(
            "results/report/data/{source}.chunks.html",
            caption="../report/data_chunks.rst",
            category="Data",
            subcategory="{source}",
            labels={"figure": "chunks and rejected lines (table)"},
        ),
        plot=report(
            "results/report/data/{source}.chunks.svg",
            caption="../report/data_plot.rst",
            category="Data",
            subcategory="{source}",
            labels={"figure": "documents and rejected lines per chunk"},
        ),
    log:
        "logs/report/data/{source}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm report data {input.stats:q} --source {wildcards.source} --table {output.table} "
        "--plot {output.plot} 2> {log}"


rule report_data_overview:
    input:
        get_report_all_stats,
    output:
        report(
            "results/report/data/overview.html",
            caption="../report/data_overview.rst",
            category="Data",
            subcategory="All sources",
            labels={"figure": "every source"},
        ),
    log:
        "logs/report/data/overview.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm report data-overview {input:q} --output {output} 2> {log}"


rule report_download:
    input:
        manifests=get_report_download_manifests,
        logs=get_report_download_logs,
    output:
        report(
            "results/report/data/{source}.download.html",
            caption="../report/download.rst",
            category="Data",
            subcategory="{source}",
            labels={"figure": "downloads"},
        ),
    log:
        "logs/report/download/{source}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm report download {input.manifests:q} --logs {input.logs:q} "
        "--source {wildcards.source} --output {output} 2> {log}"


rule report_tokens:
    input:
        blend="data/tokens/{tokenizer}/blend.json",
        stats=get_report_tokens_stats,
        idx=get_report_tokens_idx,
    output:
        table=report(
            "results/report/tokens/{tokenizer}.tokens.html",
            caption="../report/tokens_table.rst",
            category="Tokens",
            subcategory="{tokenizer}",
            labels={"figure": "tokens per source and chunk (table)"},
        ),
        blend=report(
            "results/report/tokens/{tokenizer}.blend.svg",
            caption="../report/tokens_blend.rst",
            category="Tokens",
            subcategory="{tokenizer}",
            labels={"figure": "blend weights used"},
        ),
        lengths=report(
            "results/report/tokens/{tokenizer}.doc_tokens.svg",
            caption="../report/tokens_lengths.rst",
            category="Tokens",
            subcategory="{tokenizer}",
            labels={"figure": "tokens per document"},
        ),
    log:
        "logs/report/tokens/{tokenizer}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm report tokens --blend {input.blend} --stats {input.stats:q} --idx {input.idx:q} "
        "--table {output.table} --blend-plot {output.blend} --lengths-plot {output.lengths} 2> {log}"


rule report_tokens_overview:
    input:
        get_report_tokens_blends,
    output:
        table=report(
            "results/report/tokens/overview.html",
            caption="../report/tokens_overview.rst",
            category="Tokens",
            subcategory="All tokenizers",
            labels={"figure": "tokens per source and tokenizer (table)"},
        ),
        plot=report(
            "results/report/tokens/overview.svg",
            caption="../report/tokens_overview.rst",
            category="Tokens",
            subcategory="All tokenizers",
            labels={"figure": "tokens per source and tokenizer"},
        ),
    log:
        "logs/report/tokens/overview.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm report tokens-overview {input:q} --table {output.table} --plot {output.plot} 2> {log}"


rule report_tokenizer:
    input:
        tokenizer=get_tokenizer_files,
        sample=get_report_tokenizer_sample,
        train_stats=get_report_tokenizer_train_stats,
    output:
        report(
            "results/report/tokens/{tokenizer}.tokenizer.html",
            caption="../report/tokenizer.rst",
            category="Tokens",
            subcategory="{tokenizer}",
            labels={"figure": "tokenizer and example encodings"},
        ),
    log:
        "logs/report/tokenizer/{tokenizer}.log",
    conda:
        "../envs/data.yaml"
    params:
        tokenizer=get_tokenizer_flags,
        key=get_report_tokenizer_key,
        train=get_report_tokenizer_train_flag,
    shell:
        "snakellm report tokenizer --name {wildcards.tokenizer} {params.tokenizer} --sample {input.sample} --key {params.key:q} "
        "{params.train} --output {output} 2> {log}"


rule report_train:
    input:
        metrics="runs/{run}/metrics.jsonl",
        summary="runs/{run}/train_summary.json",
    output:
        loss=report(
            "results/report/train/{run}.loss.svg",
            caption="../report/train_loss.rst",
            category="Training",
            subcategory="{run}",
            labels={"figure": "1. loss"},
        ),
        lr=report(
            "results/report/train/{run}.lr.svg",
            caption="../report/train_lr.rst",
            category="Training",
            subcategory="{run}",
            labels={"figure": "3. learning rate"},
        ),
        grad_norm=report(
            "results/report/train/{run}.grad_norm.svg",
            caption="../report/train_grad_norm.rst",
            category="Training",
            subcategory="{run}",
            labels={"figure": "4. gradient norm"},
        ),
        throughput=report(
            "results/report/train/{run}.throughput.svg",
            caption="../report/train_throughput.rst",
            category="Training",
            subcategory="{run}",
            labels={"figure": "5. tokens/s and MFU"},
        ),
        summary=report(
            "results/report/train/{run}.summary.html",
            caption="../report/train_summary.rst",
            category="Training",
            subcategory="{run}",
            labels={"figure": "2. settings, final figures, checkpoints"},
        ),
    log:
        "logs/report/train/{run}.log",
    conda:
        "../envs/data.yaml"
    params:
        prefix=subpath(output.loss, strip_suffix=".loss.svg"),
    shell:
        "snakellm report train --run {wildcards.run} --metrics {input.metrics} --summary {input.summary} "
        "--prefix {params.prefix} 2> {log}"


rule report_lm_eval:
    input:
        get_report_lm_eval_input,
    output:
        table=report(
            "results/report/evaluation/{run}.lm_eval.html",
            caption="../report/lm_eval_table.rst",
            category="Evaluation",
            subcategory="{run}",
            labels={"figure": "lm-eval suites (table)"},
        ),
        plot=report(
            "results/report/evaluation/{run}.lm_eval.svg",
            caption="../report/lm_eval_plot.rst",
            category="Evaluation",
            subcategory="{run}",
            labels={"figure": "lm-eval scores"},
        ),
    log:
        "logs/report/evaluation/{run}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "snakellm report lm-eval {input:q} --run {wildcards.run} --table {output.table} "
        "--plot {output.plot} 2> {log}"


rule report_finetune:
    input:
        unpack(get_report_finetune_input),
    output:
        page=report(
            "results/report/finetune/{run}/{ft}.html",
            caption="../report/finetune_page.rst",
            category="Fine-tuning",
            subcategory="{ft}",
            labels={"figure": "base vs tuned, predictions, settings"},
        ),
        loss=report(
            "results/report/finetune/{run}/{ft}.loss.svg",
            caption="../report/finetune_loss.rst",
            category="Fine-tuning",
            subcategory="{ft}",
            labels={"figure": "loss"},
        ),
    log:
        "logs/report/finetune/{run}/{ft}.log",
    conda:
        "../envs/data.yaml"
    params:
        evals=get_report_finetune_evals,
    shell:
        "snakellm report finetune --name {wildcards.ft} --metrics {input.metrics} --summary {input.summary} "
        "{params.evals} --page {output.page} --loss {output.loss} 2> {log}"


rule report_table:
    """Any registered metrics/samples file(s) as a table (register_report_table: rules/common/report.smk)."""
    input:
        get_report_table_input,
    output:
        report(
            "results/report/tables/{stage}/{name}.html",
            caption="../report/table.rst",
            category=get_report_table_category,
            subcategory=get_report_table_subcategory,
            labels=get_report_table_labels,
        ),
    log:
        "logs/report/tables/{stage}/{name}.log",
    conda:
        "../envs/data.yaml"
    params:
        title=get_report_table_title,
        note=get_report_table_note,
    shell:
        "snakellm report table {input:q} --title {params.title:q} {params.note} --output {output} 2> {log}"
