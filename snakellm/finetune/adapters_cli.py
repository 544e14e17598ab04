"""``snakellm lora merge|export-peft``: LoRA adapters as artifacts.

``merge``: base checkpoint + adapter -> a model-only checkpoint directory
(``OUT/checkpoints/iter_0000000``) holding ``W + (alpha/r) B A`` for every
adapted linear; it loads and exports like any pretrained run, and gives the
logits of base + adapter. ``export-peft``: the adapter in Hugging Face PEFT
format for the Hugging Face export of the base (snakellm.finetune.peft_export).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def merge(base: str, adapter: str, out: str, device: str = "auto", tp: int = 1) -> Path:
    from snakellm import models
    from snakellm.finetune import artifacts, runtime
    from snakellm.finetune.lora import merge as merge_into

    rt = runtime.start(device, tp)
    try:
        m = models.load(base, device=rt.device, tp=rt.tp)
        _, conf, ad = artifacts.attach(rt.device, m.model, m.arch, adapter, None)
        merge_into(m.model, ad)
        return artifacts.save_model(m.model, Path(out), m.arch, m.padded_vocab_size, m.tokenizer)
    finally:
        runtime.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="snakellm lora",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="fold an adapter into its base: a model-only checkpoint directory")
    m.add_argument("--base", required=True, help="the adapter's base run (or checkpoint dir)")
    m.add_argument("--adapter", required=True, help="finetune's adapter/ directory")
    m.add_argument("--out", required=True, help="output run directory (OUT/checkpoints/iter_0000000)")
    m.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    e = sub.add_parser("export-peft", help="write adapter_config.json + adapter_model.safetensors for peft")
    e.add_argument("--adapter", required=True, help="finetune's adapter/ directory")
    e.add_argument("--out", required=True, help="output directory")
    a = p.parse_args(argv)
    from snakellm.models.loading import LoadError

    try:
        if a.cmd == "merge":
            path = merge(a.base, a.adapter, a.out, a.device)
        else:
            from snakellm.finetune.peft_export import write_peft

            path = write_peft(a.adapter, a.out)
    except (OSError, KeyError, ValueError, json.JSONDecodeError, LoadError) as e:
        print(f"snakellm lora: error: {e}", file=sys.stderr)
        return 2
    print(f"snakellm lora {a.cmd}: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
