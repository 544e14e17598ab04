"""The settings framework: one dataclass field per setting, and everything derived from it.

Every config section a step reads is a frozen dataclass whose fields are built
with :func:`setting`: type, default, help text and a few facts:

* ``trajectory``: changing it makes old results a different run (the batch size,
  the schedule, the seed ...). Only these enter fingerprints; everything else
  (intervals, workers, logging) may change between restarts.
* ``cli``: whether the step takes it as a flag (``retries`` is a Snakemake rule
  setting, not a step one).
* ``flag``: the flag's name when it differs from the field's.

From a dataclass come the step's argparse flags with their defaults
(:func:`add_arguments`), the rule's command line (:func:`to_flags`), the
fingerprinted keys (:func:`trajectory_keys`) and the schema's defaults
(:func:`defaults`, compared with ``config/schema.yaml`` by tests/test_settings.py).
This module is torch-free: the Snakefile imports it at parse time.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import types
import typing
from dataclasses import field
from typing import Any


def setting(
    default: Any,
    help: str,
    *,
    trajectory: bool = False,
    choices: tuple[Any, ...] | None = None,
    cli: bool = True,
    flag: str | None = None,
) -> Any:
    """A dataclass field carrying what the CLI, the rule and the resume logic need to know."""
    meta = {"help": help, "trajectory": trajectory, "choices": choices, "cli": cli, "flag": flag}
    return field(default=default, metadata=meta)


REQUIRED: Any = dataclasses.MISSING


def _base_type(tp: Any) -> Any:
    """``int | None`` -> int; ``str | float | None`` -> str (parsed later); ``bool`` stays bool."""
    hints = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    real = [h for h in hints if h is not type(None)]
    return str if len(real) != 1 else real[0]


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def add_arguments(group: Any, cls: type, *, required: bool = True) -> None:
    """Add one ``--flag`` per CLI field of ``cls`` to an argparse parser or group."""
    hints = _resolved_types(cls)
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("cli", True):
            continue
        opt = "--" + (m.get("flag") or f.name).replace("_", "-")
        typ = _base_type(hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "help": m.get("help")}
        if typ is bool:
            kw.update(action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kw.update(type=typ, choices=m.get("choices"))
            if f.default is dataclasses.MISSING:
                kw["required"] = required
            else:
                kw["default"] = f.default
        group.add_argument(opt, **kw)


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """The dataclass from parsed arguments (non-CLI fields take their defaults)."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.metadata["cli"]})


def to_flags(cls: type, values: dict[str, Any], exclude: tuple[str, ...] = ()) -> str:
    """The ``snakellm train`` flags for a config section (defaults filled), as one shell-quoted string.

    ``None`` values are left out (the CLI's own default is then also None).
    """
    out: list[str] = []
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("cli", True) or f.name in exclude or f.name not in values or values[f.name] is None:
            continue
        opt = "--" + (m.get("flag") or f.name).replace("_", "-")
        v = values[f.name]
        if isinstance(v, bool):
            out.append(opt if v else "--no-" + opt[2:])
        else:
            out += [opt, str(v)]
    return shlex.join(out)


def defaults(cls: type) -> dict[str, Any]:
    """Field -> default (required fields left out): what the schema's defaults must equal."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def trajectory_keys(cls: type) -> tuple[str, ...]:
    """The fields marked ``trajectory``: the ones a fingerprint covers."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("trajectory"))
