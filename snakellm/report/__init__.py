"""Report figures and tables for ``snakemake --report``.

Each ``snakellm report <what>`` step reads the files a stage already wrote
(chunk stats, token stats, blend.json, metrics.jsonl, ...) and writes SVG plots
(matplotlib) and self-contained HTML tables; rules/report.smk marks them with
``report(...)`` so Snakemake's report shows them in categories, with captions
from report/*.rst. Nothing here runs inside training or data jobs: plots are
rebuilt only when the files they are drawn from change.
"""
