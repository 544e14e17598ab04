"""``snakellm render-sft``: the token ids and labels finetune trains on (snakellm.finetune.render)."""

from __future__ import annotations

import argparse
import sys

from snakellm.config.sections import PACKING_ONLY, ExamplesSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.finetune.render import FORMATS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm render-sft",
        description="Render SFT records (conversations through the run's chat template, or input/output "
        "records) into what finetune trains on before packing: one {input_ids, labels} line per example, "
        "labels -100 where no loss is taken (Hugging Face's convention).",
    )
    p.add_argument("run", help="the run to fine-tune (its tokenizer and chat template are used)")
    p.add_argument("--data", required=True, help="a jsonl file: messages, conversations or input/output records")
    p.add_argument("--out", required=True, help="the jsonl to write")
    p.add_argument(
        "--format",
        default="auto",
        choices=FORMATS,
        help="record format (default: %(default)s: from each record's keys)",
    )
    p.add_argument("--messages-key", default=None, help="key of the conversation list (default: by format)")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print N examples with trained text in [[ ]]")
    add_arguments(p.add_argument_group("examples, as in training (config: finetune.NAME.examples)"), ExamplesSettings,
                  exclude=PACKING_ONLY)  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    from snakellm.finetune.dataset import SFTFormatError
    from snakellm.finetune.render import render
    from snakellm.models.loading import LoadError

    a = build_parser().parse_args(argv)
    try:
        st = render(a)
    except (SFTFormatError, LoadError, FileNotFoundError) as e:
        print(f"snakellm render-sft: error: {e}", file=sys.stderr)
        return 2
    print(
        f"snakellm render-sft: {st['examples']} examples, {st['tokens']} tokens ({st['trained_tokens']} trained)"
        f" -> {a.out}; {st['rejected']} records rejected {st['rejected_by_reason'] or ''}"
        + (f" at {', '.join(st['rejected_at'][:5])}" if st["rejected"] else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
