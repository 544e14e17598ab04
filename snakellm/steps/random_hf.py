"""``snakellm random-hf``: a Hugging Face model directory of a preset's shape with random weights."""

from __future__ import annotations

import argparse
import sys
import time

from snakellm.config.sections import RandomHfSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments, from_namespace
from snakellm.export.hf import ExportError
from snakellm.export.random_hf import RandomHfError, write_random_hf
from snakellm.io.log import log


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm random-hf` flags (snakellm.config.sections.RandomHfSettings, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm random-hf",
        description="Write a transformers model directory (config.json, safetensors shards, GPT-2's tokenizer) of "
        "a preset's shape with random weights, one layer at a time: the start of the import -> fine-tune -> "
        "export chain at full scale without downloading weights (config: import_hf.NAME.random).",
    )
    p.add_argument("out", help="the model directory to write (replaced atomically)")
    add_arguments(p.add_argument_group("model (config: import_hf.NAME.random)"), RandomHfSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    s = from_namespace(RandomHfSettings, a)
    t0 = time.time()
    try:
        write_random_hf(s.preset, a.out, tokenizer_dir=s.tokenizer_dir, seed=s.seed, max_shard_size=s.max_shard_size)
    except (RandomHfError, ExportError) as e:
        print(f"snakellm random-hf: {e}", file=sys.stderr)
        return 2
    log(f"wrote {a.out}: the {s.preset} shape, random weights (seed {s.seed}) in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
