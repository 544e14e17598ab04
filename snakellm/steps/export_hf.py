"""``snakellm export-hf``: a Hugging Face model directory from a checkpoint (snakellm.export.hf)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from snakellm.config.sections import ExportHfSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.export.hf import ExportError, export_hf_from_checkpoint, hf_family, tokenizer_from_blend
from snakellm.io.log import log


def _classes() -> str:
    """The Hugging Face classes the export writes, one per registered family."""
    from snakellm.models import families

    return ", ".join(dict.fromkeys(f.hf_architecture for f in families.FAMILIES.values()))


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm export-hf` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm export-hf",
        description=f"Write a Hugging Face model directory ({_classes()}: config.json, "
        "generation_config.json, model.safetensors (sharded above --max-shard-size), tokenizer files) from a "
        "checkpoint.",
    )
    p.add_argument("checkpoint", help="a run dir (runs/NAME), its checkpoints/ dir or one iter_NNNNNNN/ dir")
    p.add_argument("out", help="output directory (replaced atomically)")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    add_arguments(p.add_argument_group("export (config: export_hf)"), ExportHfSettings)
    p.add_argument(
        "--blend",
        default=None,
        help="blend.json whose tokenizer block names the tokenizer files (default: the checkpoint's run_config)",
    )
    p.add_argument(
        "--tokenizer-base",
        default=None,
        help="directory that relative tokenizer file paths are relative to (default: the working directory)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    from snakellm.models.loading import LoadError, describe_run

    try:
        info = describe_run(a.checkpoint, a.iteration)
        family = hf_family(info["arch"])  # before torch: an unsupported model fails at once
        tok = info["tokenizer"]
        if a.blend:
            tok = tokenizer_from_blend(a.blend)
        if not tok.get("files"):
            raise LoadError(f"{info['checkpoint_dir']}: no tokenizer files recorded; pass --blend")
    except (LoadError, ExportError, KeyError) as e:
        print(f"snakellm export-hf: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    from snakellm.launch.runtime import ensure_single_process

    ensure_single_process("cpu")
    out = export_hf_from_checkpoint(  # one layer in memory at a time
        {**info, "tokenizer": tok},
        a.out,
        max_shard_size=a.max_shard_size,
        dtype=a.dtype,
        tokenizer_base=Path(a.tokenizer_base) if a.tokenizer_base else None,
    )
    log(f"exported {info['checkpoint_dir']} ({family}) to {out} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
