"""Atomic outputs: a killed job must never leave a file that looks complete.

Everything is written to a hidden temporary file in the destination directory
and renamed into place only after it was flushed and fsynced. ``rename`` within
one filesystem is atomic, so readers see either the old file, no file, or the
whole new file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_MODE = 0o666 & ~_umask()  # what open() would give; mkstemp alone makes 0600 files


def _tmp_path(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, _MODE)
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success.

    On any exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open()`` that only becomes visible at ``path`` when the block succeeds."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kwargs) as fh:
            yield fh


@contextlib.contextmanager
def atomic_group(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """Several outputs that appear together: all temporaries are renamed at the end.

    The renames happen in the given order, so put the file that marks completion
    (for example a stats or manifest file) last.
    """
    finals = [Path(p) for p in paths]
    tmps: list[Path] = []
    try:
        for p in finals:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmps.append(_tmp_path(p))
        yield tmps
        for t in tmps:
            with open(t, "rb+") as fh:
                os.fsync(fh.fileno())
        for t, p in zip(tmps, finals):
            os.replace(t, p)
    except BaseException:
        for t in tmps:
            with contextlib.suppress(FileNotFoundError):
                t.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file atomically."""
    with atomic_open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def write_json(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    """Write a JSON file atomically (sorted keys so reruns are byte-stable)."""
    import json

    write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")
