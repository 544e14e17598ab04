"""``snakellm compare-eval``: a fine-tune's base-vs-tuned table (snakellm.eval.compare)."""

from __future__ import annotations

import argparse
import sys

from snakellm import tracking
from snakellm.config.settings import DefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm compare-eval",
        description="Base vs tuned: two `snakellm evaluate` directories on the same test split and decoding -> "
        "comparison.json, comparison.tsv and comparison.md (metrics and their differences) in --out-dir; or, with "
        "--preference, a DPO fine-tune's held-out test pairs before (the initial policy) and after training.",
    )
    p.add_argument("--base", default=None, help="the base model's evaluation directory")
    p.add_argument("--tuned", default=None, help="the fine-tuned model's evaluation directory")
    p.add_argument(
        "--preference",
        default=None,
        metavar="SUMMARY",
        help="in place of --base and --tuned: a DPO fine-tune's finetune_summary.json (its initial and tuned "
        "policy on the held-out test pairs)",
    )
    p.add_argument("--out-dir", required=True, help="where comparison.{json,tsv,md} go")
    p.add_argument("--name", default="", help="the fine-tune's name (in the table's title)")
    tracking.add_results_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from snakellm.eval.compare import CompareError, compare, markdown, preference, write

    p = build_parser()
    a = p.parse_args(argv)
    if not (a.preference and not (a.base or a.tuned) or not a.preference and a.base and a.tuned):
        p.error("give --base and --tuned (two evaluations), or --preference (a DPO fine-tune's summary)")
    try:
        c = preference(a.preference, a.name) if a.preference else compare(a.base, a.tuned, a.name)
    except CompareError as e:
        print(f"snakellm compare-eval: error: {e}", file=sys.stderr)
        return 2
    write(c, a.out_dir)
    print(markdown(c), file=sys.stderr)
    tracking.log_results(a.track_run, "comparison", c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
