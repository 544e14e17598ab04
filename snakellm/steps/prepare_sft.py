"""``snakellm prepare-sft``: SQuAD json / jsonl -> SFT splits (snakellm.finetune.sft_data)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.sections import SftDataSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.finetune.sft_data import SFTDataError, prepare


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm prepare-sft` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm prepare-sft",
        description="SQuAD json (or jsonl with configurable keys, or conversations: OpenAI messages or ShareGPT) -> "
        "{input, output} (or {messages}) jsonl train/validation/test splits for fine-tuning, plus rejected.jsonl and stats.json (bad records quarantined with a count).",
    )
    p.add_argument("source", help="a SQuAD-format .json or a .jsonl file")
    p.add_argument(
        "out_dir", help="directory for train.jsonl, validation.jsonl, test.jsonl, rejected.jsonl, stats.json"
    )
    add_arguments(p.add_argument_group("data set (config: sft_data.NAME)"), SftDataSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        stats = prepare(
            a.source,
            a.out_dir,
            fmt=a.format,
            template=a.template,
            input_key=a.input_key,
            output_key=a.output_key,
            messages_key=a.messages_key,
            split=a.split,
            seed=a.seed,
            limit=a.limit,
        )
    except SFTDataError as e:
        print(f"snakellm prepare-sft: error: {e}", file=sys.stderr)
        return 2
    print(
        f"snakellm prepare-sft: {stats['accepted']} records ({stats['splits']}), {stats['rejected']} rejected, "
        f"{sum(stats['skipped'].values())} skipped (unanswerable)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
