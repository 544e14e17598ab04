"""``snakellm dag``: the workflow's rule graph and job DAG as SVG (snakellm.report.dag)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.io.atomic import write_text
from snakellm.report.dag import DagError, add_title, collapse_chunks, parse_dot, render, snakemake_dot


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm dag``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm dag",
        description="Render the workflow's rule graph (`snakemake --rulegraph`) and job DAG (`snakemake --dag`, "
        "every job as if all had to run, per-chunk jobs collapsed past --head/--tail) to SVG. "
        "Run it where you run snakemake; arguments after -- go to snakemake (e.g. -- --configfile my.yaml).",
        epilog="Uses Graphviz's dot where installed (bash scripts/setup-report-tools.sh installs it on "
        "Debian/Ubuntu), else a built-in layered SVG writer. "
        "The same pictures by hand: snakemake --rulegraph | dot -Tsvg > rulegraph.svg",
    )
    p.add_argument(
        "--rulegraph", metavar="SVG", help="write the rule graph here (e.g. results/report/workflow/rulegraph.svg)"
    )
    p.add_argument("--jobs", metavar="SVG", help="write the job DAG here")
    p.add_argument("--dot", action="store_true", help="also keep the dot text next to each picture (.dot)")
    p.add_argument(
        "--head", type=int, default=2, help="chunks kept at the start of each run of per-chunk jobs (default 2)"
    )
    p.add_argument("--tail", type=int, default=1, help="chunks kept at the end (default 1)")
    p.add_argument("--snakefile", help="the Snakefile (default: snakemake's own lookup)")
    p.add_argument("--directory", help="the working directory (default: the current one)")
    p.add_argument("--config-json", help="the complete workflow config as JSON (replaces the workflow's)")
    p.add_argument(
        "--config-json-file",
        metavar="JSON",
        help="the same, read from this file (what the dag rule passes: a command line stays short)",
    )
    p.add_argument("snakemake_args", nargs=argparse.REMAINDER, help="-- then arguments for snakemake")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    extra = a.snakemake_args[1:] if a.snakemake_args[:1] == ["--"] else a.snakemake_args
    if not a.rulegraph and not a.jobs:
        p.error("nothing to do: give --rulegraph and/or --jobs")
    if a.config_json_file:
        try:
            a.config_json = Path(a.config_json_file).read_text()
        except OSError as e:
            p.error(f"--config-json-file: {e}")
    try:
        if a.rulegraph:
            text = snakemake_dot("rulegraph", a.snakefile, a.directory, a.config_json, extra)
            nodes = len(parse_dot(text)[1])
            text = add_title(text, f"snakellm rule graph: {nodes} rules")
            if a.dot:
                write_text(Path(a.rulegraph).with_suffix(".dot"), text)
            render(text, a.rulegraph)
        if a.jobs:
            text = snakemake_dot("dag", a.snakefile, a.directory, a.config_json, extra)
            jobs = len(parse_dot(text)[1])
            text, hidden = collapse_chunks(text, a.head, a.tail)
            title = f"snakellm job DAG: {jobs} jobs" + (f" ({hidden} per-chunk jobs collapsed)" if hidden else "")
            text = add_title(text, title)
            if a.dot:
                write_text(Path(a.jobs).with_suffix(".dot"), text)
            render(text, a.jobs)
    except DagError as e:
        print(f"snakellm dag: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
