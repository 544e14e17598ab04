"""The shape rules of issue #18 that a newcomer relies on, checked in milliseconds.

- No function in ``snakellm/`` is over 100 lines (read with ``ast``: nothing is imported).
- Every ``snakellm <step>`` has ``build_parser()``, and its ``--help`` shows the default of
  every option that has one (a default nobody can see is a default nobody can rely on).
"""

from __future__ import annotations

import argparse
import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from snakellm.cli import STEPS

PKG = Path(__file__).resolve().parents[1] / "snakellm"
MAX_LINES = 100


def _long_functions(limit: int) -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


@pytest.mark.slow  # 2.1 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_no_function_over_100_lines() -> None:
    offenders = _long_functions(MAX_LINES)
    print("\n".join(offenders))
    assert not offenders, f"functions over {MAX_LINES} lines:\n" + "\n".join(offenders)


@pytest.mark.slow  # 1.5 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_long_function_walk_finds_functions() -> None:
    """The walk does see functions (a limit of 0 lists every one), so an empty result means something."""
    assert len(_long_functions(0)) > 500


def _parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def _has_default(action: argparse.Action) -> bool:
    """An option whose default means something ('' and None mean "not given"; plain switches are off)."""
    return (
        bool(action.option_strings)
        and action.help != argparse.SUPPRESS
        and action.default not in (None, "", [], {}, argparse.SUPPRESS)
        and (action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction))
    )


@pytest.mark.parametrize("step", sorted(STEPS))
def test_help_shows_every_default(step: str) -> None:
    module = importlib.import_module(STEPS[step][0])
    assert hasattr(module, "build_parser"), f"snakellm {step}: no build_parser()"
    missing = []
    checked = 0
    for name, parser in _parsers(module.build_parser(), step):
        text = "".join(parser.format_help().split())  # wrapping may break lines at hyphens
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not _has_default(action):
                continue
            checked += 1
            shown = " ".join(formatter._expand_help(action).split()) if action.help else ""
            values = action.default if isinstance(action.default, (list, tuple)) else [action.default]
            if "default" not in shown or not all(str(v) in shown for v in values) or "".join(shown.split()) not in text:
                missing.append(f"snakellm {name} {action.option_strings[0]} (default {action.default!r}): {shown!r}")
    print("\n".join(missing))
    assert not missing, "options whose --help does not show their default:\n" + "\n".join(missing)
    if step in ("train", "generate", "tokenize"):
        assert checked >= 5


def test_help_shows_a_default_once() -> None:
    """A default the help already names is not repeated; one it does not name is added."""
    from snakellm.steps.train import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "show a progress bar (default: True)" in text
    assert text.count("(default: True) (default: True)") == 0
