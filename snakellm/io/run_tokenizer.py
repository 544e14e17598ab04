"""A run carries its tokenizer: ``RUN_DIR/tokenizer/`` holds the files it was trained with.

At training time (and when a model is imported or written by a fine-tune or a
LoRA merge) :func:`carry` copies the tokenizer files named by the tokenizer
block (blend.json's ``tokenizer``: kind, files, vocab size, EOD) into
``RUN_DIR/tokenizer/`` and writes ``manifest.json`` beside them::

    {"kind": "sentencepiece", "files": {"model_file": "tokenizer.model"},
     "sha256": {"tokenizer.model": "..."}, "block": {... the tokenizer block, files as copied ...}}

Every later step (fine-tuning, evaluation, generation, serving, the exports,
LoRA merge) gets the tokenizer from :func:`resolve`, through
:func:`snakellm.models.loading.describe_run`: the block with absolute paths
into the run's own copy, checked against the manifest's checksums. Nothing is
looked up again in the workflow's config, and no path depends on the working
directory, so ``snakellm generate /abs/path/runs/tiny`` works from anywhere.

A run trained before runs carried their tokenizer has none: its recorded
block is used if every file path in it is absolute and exists; otherwise the
error says how to give the run its tokenizer (``python -m
snakellm.io.run_tokenizer RUN_DIR BLEND_JSON``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError
from snakellm.io.atomic import atomic_path, write_json

DIR = "tokenizer"
MANIFEST = "manifest.json"


class RunTokenizerError(UsageError, ValueError):
    """The run's tokenizer is missing, incomplete or altered; the message says what to do."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while buf := fh.read(1 << 20):
            h.update(buf)
    return h.hexdigest()


def carry(block: dict[str, Any], run_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> dict[str, Any]:
    """Copy the block's files into ``run_dir/tokenizer/`` (relative paths: from ``base``, default the working
    directory) and write the manifest; returns the block with absolute paths into the copy."""
    dest = Path(run_dir) / DIR
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    sums: dict[str, str] = {}
    for key, value in sorted((block.get("files") or {}).items()):
        src = Path(value)
        if not src.is_absolute() and base is not None:
            src = Path(base) / src
        if not src.is_file():
            raise RunTokenizerError(f"tokenizer file {value} ({key}) not found: the run cannot carry its tokenizer")
        name = src.name if src.name not in sums else f"{key}-{src.name}"
        target = dest / name
        if not (target.exists() and os.path.samefile(src, target)):
            with atomic_path(target) as tmp:
                shutil.copyfile(src, tmp)
        files[key], sums[name] = name, _sha256(target)
    # paths derived from the original files (NeMo's and Megatron's flags) would name the originals: left out
    carried = {k: v for k, v in block.items() if k not in ("files", "nemo", "megatron_args")}
    if "files" in block:  # a tokenizer with no files (tests' synthetic one) stays as recorded
        carried["files"] = files
    write_json(dest / MANIFEST, {"kind": block.get("kind"), "files": files, "sha256": sums, "block": carried})
    return _absolute(carried, dest)


def _absolute(block: dict[str, Any], dest: Path) -> dict[str, Any]:
    if "files" not in block:
        return dict(block)
    root = dest.resolve()
    return {**block, "files": {k: str(root / v) for k, v in block["files"].items()}}


def resolve(run_dir: str | os.PathLike, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The run's tokenizer block with absolute paths into ``run_dir/tokenizer/`` (checked), for any cwd."""
    dest = Path(run_dir) / DIR
    manifest = dest / MANIFEST
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        for name, digest in m.get("sha256", {}).items():
            if not (dest / name).is_file():
                raise RunTokenizerError(f"{dest / name} is missing (listed in {manifest})")
            if _sha256(dest / name) != digest:
                raise RunTokenizerError(f"{dest / name} differs from the file the run was trained with ({manifest})")
        return _absolute(m["block"], dest)
    files = (recorded or {}).get("files") or {}
    if recorded and all(Path(v).is_absolute() and Path(v).is_file() for v in files.values()):
        return dict(recorded)  # an older run whose recorded paths still hold (or a tokenizer with no files)
    what = ", ".join(f"{v}" for v in files.values()) or "no tokenizer block"
    raise RunTokenizerError(
        f"{run_dir} carries no tokenizer ({dest / MANIFEST} is missing; recorded: {what}): it was trained before "
        f"runs carried their tokenizer. Give it its tokenizer, from the workflow directory it was trained in: "
        f"python -m snakellm.io.run_tokenizer {run_dir} data/tokens/TOKENIZER/blend.json"
    )


def main(argv: list[str] | None = None) -> int:
    """Give an older run its tokenizer: copy a blend.json's tokenizer files into RUN_DIR/tokenizer/."""
    p = argparse.ArgumentParser(prog="python -m snakellm.io.run_tokenizer", description=main.__doc__)
    p.add_argument("run_dir", help="the run directory (runs/NAME)")
    p.add_argument("blend", help="the blend.json the run was trained on (its tokenizer block)")
    a = p.parse_args(argv)
    try:
        block = json.loads(Path(a.blend).read_text())["tokenizer"]
        carried = carry(block, a.run_dir)
    except (OSError, KeyError, ValueError) as e:
        print(f"snakellm: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.run_dir}/{DIR}: {', '.join(carried['files'].values()) or 'no files'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
