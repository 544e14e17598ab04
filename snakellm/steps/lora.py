"""``snakellm lora``: merge a LoRA adapter into its base (a checkpoint or a Hugging Face directory), or write it
(or a p-tuning prompt table) in PEFT format (snakellm.finetune.adapters, snakellm.finetune.peft_export)."""

from __future__ import annotations

import argparse
import json
import sys

from snakellm.config.sections import ExportHfSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.finetune.adapters import merge, merge_hf


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``snakellm lora``, apart from :func:`main` so that tests and ``--help`` checks build it alone."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm lora",
        description=__doc__.split("\n\n")[0],
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="fold an adapter into its base: a model-only checkpoint directory")
    m.add_argument("--base", required=True, help="the adapter's base run (or checkpoint dir)")
    m.add_argument("--adapter", required=True, help="finetune's adapter/ directory")
    m.add_argument("--out", required=True, help="output run directory (OUT/checkpoints/iter_0000000)")
    m.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to run (default: %(default)s: cuda when available, else cpu)",
    )
    h = sub.add_parser("merge-hf", help="fold an adapter into its base: a Hugging Face model directory")
    h.add_argument("--base", required=True, help="the adapter's base run (or checkpoint dir)")
    h.add_argument("--adapter", required=True, help="finetune's adapter/ directory")
    h.add_argument("--out", required=True, help="output Hugging Face directory (replaced atomically)")
    add_arguments(h.add_argument_group("export (config: export_hf)"), ExportHfSettings)
    e = sub.add_parser(
        "export-peft",
        help="write adapter_config.json + adapter_model.safetensors for peft (LoRA, or p-tuning's prompt table)",
    )
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--adapter", help="finetune's adapter/ directory (LoRA: peft_type LORA)")
    src.add_argument("--prompt", help="finetune's prompt/ directory (p-tuning: peft_type PROMPT_TUNING)")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument(
        "--base-model",
        required=True,
        help="base_model_name_or_path: the base's Hugging Face directory (the run's hf/) or hub name",
    )
    for each in sub.choices.values():  # add_parser does not pass the formatter on
        each.formatter_class = DefaultsHelpFormatter
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    from snakellm.models.loading import LoadError

    try:
        if a.cmd == "merge":
            path = merge(a.base, a.adapter, a.out, a.device)
        elif a.cmd == "merge-hf":
            path = merge_hf(a.base, a.adapter, a.out, max_shard_size=a.max_shard_size, dtype=a.dtype)
        else:
            from snakellm.finetune.peft_export import write_peft, write_prompt_tuning

            if a.adapter:
                path = write_peft(a.adapter, a.out, a.base_model)
            else:
                path = write_prompt_tuning(a.prompt, a.out, a.base_model)
    except (OSError, KeyError, ValueError, json.JSONDecodeError, LoadError) as e:
        print(f"snakellm lora: error: {e}", file=sys.stderr)
        return 2
    print(f"snakellm lora {a.cmd}: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
