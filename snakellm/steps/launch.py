"""``snakellm launch``: print the launch prefix the pretrain rule runs (snakellm.launch.prefix)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.launch.prefix import LaunchConfigError, launch_args


def _parse_resource(item: str) -> tuple[str, Any]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{item!r} is not NAME=VALUE")
    try:
        return name, int(value)
    except ValueError:
        return name, value


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm launch``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm launch",
        description="Print the command line that the pretrain rule runs for the given resources "
        "and container config (what `snakemake --profile profiles/slurm` would execute).",
    )
    p.add_argument(
        "--configfile",
        default="config/config.yaml",
        help="config with an optional container: block (default: %(default)s)",
    )
    p.add_argument(
        "--resource",
        "-r",
        action="append",
        default=[],
        type=_parse_resource,
        metavar="NAME=VALUE",
        help="a Snakemake resource, e.g. -r mpi=srun -r nodes=2 -r tasks=16 -r cpus_per_task=8",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to launch (after --)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    import yaml

    container = None
    if a.configfile and os.path.exists(a.configfile):
        with open(a.configfile) as fh:
            container = (yaml.safe_load(fh) or {}).get("container")
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    try:
        prefix = launch_args(dict(a.resource), container)
    except LaunchConfigError as e:
        print(f"snakellm launch: {e}", file=sys.stderr)
        return 2
    print(shlex.join(prefix + command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
