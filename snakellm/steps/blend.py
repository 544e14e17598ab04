"""``snakellm blend``: Megatron's data_prefix blend of a tokenizer's chunks (snakellm.tokenize.blend)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.io.atomic import atomic_group
from snakellm.tokenize.blend import BlendError, blend_line, build_blend


def _weight(s: str) -> tuple[str, float]:
    name, sep, w = s.partition("=")
    try:
        value = float(w)
    except ValueError:
        value = -1.0
    if not sep or not name or not value > 0:
        raise argparse.ArgumentTypeError(f"expected SOURCE=WEIGHT with a weight > 0, got {s!r}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm blend``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm blend",
        description="Write Megatron's data_prefix blend [w1, p1, w2, p2, ...] (weights = tokens x source weight, "
        "normalised) for one tokenizer's chunks, as blend.json and a one-line blend.txt.",
    )
    p.add_argument("stats", nargs="+", help="the chunks' {prefix}.stats.json files written by snakellm tokenize")
    p.add_argument("-o", "--output", required=True, help="blend.json")
    p.add_argument("--text", help="blend.txt (default: next to blend.json)")
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        type=_weight,
        metavar="SOURCE=W",
        help="a source's sampling weight (repeat per source)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    text = a.text or str(Path(a.output).with_name("blend.txt"))
    try:
        blend = build_blend(a.stats, dict(a.weight))
        with atomic_group(text, a.output) as (tt, tj):
            tt.write_text(blend_line(blend) + "\n")
            tj.write_text(json.dumps(blend, indent=2) + "\n")
    except (BlendError, OSError) as e:
        print(f"snakellm blend: error: {e}", file=sys.stderr)
        return 1
    shares = ", ".join(f"{s} {v['share']:.1%} ({v['tokens']:,} tokens)" for s, v in blend["sources"].items())
    print(f"{a.output}: {len(blend['datasets'])} datasets, {blend['tokens']:,} tokens: {shares}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
