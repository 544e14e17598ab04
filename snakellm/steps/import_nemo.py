"""``snakellm import-nemo``: a .nemo into a model-only checkpoint (snakellm.export.nemo)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.export.nemo import NemoError, import_nemo
from snakellm.io.atomic import write_json


def build_parser() -> argparse.ArgumentParser:
    """The `snakellm import-nemo` flags (settings from snakellm.config.sections, with the config's defaults)."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm import-nemo",
        description="Import a .nemo (NeMo 1.x layout, mcore GPT, TP=PP=1, as NeMo's save_to writes it) into a "
        "model-only checkpoint RUN_DIR/checkpoints/iter_0000000 (+ the tokenizer files in RUN_DIR/tokenizer/).",
    )
    p.add_argument("nemo", help="the .nemo file (or an extracted .nemo folder)")
    p.add_argument("run_dir", help="the run directory to create (must not hold checkpoints)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        res = import_nemo(a.nemo, a.run_dir)
    except NemoError as e:
        print(f"snakellm import-nemo: error: {e}", file=sys.stderr)
        return 2
    write_json(Path(a.run_dir) / "import_summary.json", {k: v for k, v in res.items()})
    print(f"import-nemo: {res['checkpoint']}: {res['parameters']:,} parameters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
