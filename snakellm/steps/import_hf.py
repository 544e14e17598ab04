"""``snakellm import-hf``: a Hugging Face directory into a run (snakellm.export.hf)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from snakellm.config.sections import ImportHfSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.export.hf import ExportError, arch_from_hf, import_hf
from snakellm.io.atomic import write_json
from snakellm.io.log import log


def _types() -> str:
    """The Hugging Face model types the import reads, one per registered family."""
    from snakellm.models import families

    return ", ".join(dict.fromkeys(f.hf_model_type for f in families.FAMILIES.values()))


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm import-hf` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm import-hf",
        description=f"Convert a Hugging Face model directory (model_type {_types()}) into a snakellm run directory: "
        "RUN_DIR/checkpoints/iter_0000000/ (megatron-core torch_dist, model only) + run_config.json, and the "
        "tokenizer under RUN_DIR/tokenizer/. Fine-tuning and export start from it like from a pretrained run.",
    )
    p.add_argument("hf_dir", help="a Hugging Face model directory (config.json + safetensors/pytorch_model.bin)")
    p.add_argument("run_dir", help="output run directory")
    add_arguments(p.add_argument_group("import (config: import_hf.NAME)"), ImportHfSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    hf_dir = Path(a.hf_dir)
    try:
        if not (hf_dir / "config.json").is_file():
            raise ExportError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
        arch_from_hf(json.loads((hf_dir / "config.json").read_text()), str(hf_dir / "config.json"))
    except ExportError as e:
        print(f"snakellm import-hf: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    summary = import_hf(hf_dir, a.run_dir, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
    write_json(Path(a.run_dir) / "import_summary.json", summary)
    log(f"imported {hf_dir} into {a.run_dir} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
