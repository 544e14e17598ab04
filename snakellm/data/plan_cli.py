"""``snakellm plan``: show how the configured sources are sliced into chunks.

The same planning code the Snakefile runs, without Snakemake: handy to check a
new source (how many shards a glob or URL template gives, which shards land in
which chunk) before launching anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from snakellm.config import validate as cfgmod
from snakellm.data import planning as plan

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="snakellm plan",
        description="Print the chunk plan of the configured sources (shards sorted naturally, "
        "sliced into runs of shards_per_chunk; one job per chunk).",
    )
    p.add_argument("--config", default="config/config.yaml", help="workflow config (default config/config.yaml)")
    p.add_argument("--schema", default=str(SCHEMA), help=argparse.SUPPRESS)
    p.add_argument("--source", action="append", help="only these sources")
    p.add_argument("--json", action="store_true", help="print {source: {chunk: [shards]}} as JSON")
    a = p.parse_args(argv)
    try:
        cfg = cfgmod.load(a.config, a.schema)
    except (cfgmod.ConfigError, OSError) as e:
        print(f"snakellm plan: {a.config}: {e}", file=sys.stderr)
        return 1
    plans = {
        name: plan.plan_source(spec)
        for name, spec in cfg["sources"].items()
        if not a.source or name in a.source
    }
    if a.json:
        json.dump(plans, sys.stdout, indent=1)
        print()
        return 0
    for name, chunks in plans.items():
        n = sum(map(len, chunks.values()))
        print(f"{name}: {n} shards -> {len(chunks)} chunks of <= {cfg['sources'][name]['shards_per_chunk']}")
        items = list(chunks.items())
        shown = items if len(items) <= 3 else items[:2] + [None] + items[-1:]
        for item in shown:
            if item is None:
                print(f"  ... {len(items) - 3} more")
                continue
            c, shards = item
            print(f"  {c}: {len(shards)} shards, {shards[0]} .. {shards[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
