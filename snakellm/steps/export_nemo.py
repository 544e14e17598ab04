"""``snakellm export-nemo``: a .nemo from a checkpoint (snakellm.export.nemo)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from snakellm.config.sections import ExportNemoSettings
from snakellm.config.settings import DefaultsHelpFormatter, add_arguments
from snakellm.export.nemo import NemoError, check_tokenizer, export_nemo, read_checkpoint_info
from snakellm.io.log import log


def _read_blend_tokenizer(path: str) -> dict[str, Any]:
    import json

    p = Path(path)
    try:
        tok = json.loads(p.read_text())["tokenizer"]
    except FileNotFoundError:
        raise NemoError(f"{p}: blend file not found") from None
    except (ValueError, KeyError, TypeError) as e:
        raise NemoError(f"{p}: no tokenizer block: {e}") from None
    return tok


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm export-nemo` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm export-nemo",
        description="Write a .nemo (NeMo 1.x layout, mcore GPT) from a checkpoint: NeMo's "
        "MegatronGPTModel.restore_from loads it. Written atomically.",
    )
    p.add_argument("checkpoint", help="a run dir (runs/NAME), its checkpoints/ dir or one iter_NNNNNNN/ dir")
    p.add_argument("output", help="the .nemo file to write")
    p.add_argument("--iteration", type=int, help="export this iteration (default: the latest)")
    p.add_argument("--blend", help="blend.json whose tokenizer to pack (default: the one the checkpoint records)")
    add_arguments(p.add_argument_group("export (config: export_nemo)"), ExportNemoSettings)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        info = read_checkpoint_info(a.checkpoint, a.iteration)
        tok = _read_blend_tokenizer(a.blend) if a.blend else info["tokenizer"]
        if tok is None:
            raise NemoError(f"{info['checkpoint_dir']}: the checkpoint does not record its tokenizer; pass --blend")
        check_tokenizer(tok, a.blend or str(a.checkpoint))
        import torch

        if a.threads:
            torch.set_num_threads(a.threads)
        res = export_nemo(a.checkpoint, a.output, tokenizer=tok, transformer_engine=a.transformer_engine, info=info)
    except NemoError as e:
        print(f"snakellm export-nemo: error: {e}", file=sys.stderr)
        return 2
    log(
        f"wrote {res['output']}: iteration {res['iteration']}, {res['parameters']:,} parameters, "
        f"transformer_engine {str(res['transformer_engine']).lower()}, {res['bytes']:,} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
