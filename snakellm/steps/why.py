"""``snakellm why TARGET``: the settings that differ between a target's last build and now (snakellm.report.why)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.report.why import explain


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm why``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm why",
        description="Why would TARGET rebuild for a changed setting? Prints, key by key, the options of its rule's "
        "command line that differ between its last build (Snakemake's record) and the config now, where "
        "Snakemake's own reason ('Params have changed ...') is both command lines whole. Run it where you run "
        "snakemake; arguments after -- go to snakemake (e.g. -- --configfile my.yaml).",
        usage="snakellm why [-h] [--directory DIR] TARGET [-- SNAKEMAKE ARGUMENTS ...]",
    )
    p.add_argument("target", help="an output file of the workflow (e.g. runs/tiny/train_summary.json)")
    p.add_argument("--directory", default=".", help="the working directory")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    a = build_parser().parse_args(ours)
    print("\n".join(explain(a.target, a.directory, extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
