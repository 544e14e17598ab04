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
import copy
import dataclasses
import shlex
import types
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Any


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every step's ``--help`` formatter: an option's default is shown next to its help.

    ``argparse.ArgumentDefaultsHelpFormatter`` also prints ``(default: None)`` and ``(default: False)``,
    which say nothing; this one shows only real defaults, and leaves a help that already names its
    default (``%(default)s`` or a hand-written "default: ...") as it is, so nothing is said twice.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default in (None, "", [], {}, argparse.SUPPRESS)
            or (action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction))
            or "default" in text.lower()
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def setting(
    default: Any,
    help: str,
    *,
    trajectory: bool = False,
    choices: tuple[Any, ...] | None = None,
    cli: bool = True,
    flag: str | None = None,
    sep: str | None = None,
    section: type | None = None,
    parse: Callable[[str], Any] | None = None,
    cli_default: Any = None,
    path: str | None = None,
    path_unless: str | None = None,
    path_names: tuple[str, ...] = (),
) -> Any:
    """A dataclass field carrying what the CLI, the rule and the resume logic need to know.

    ``flag``: the option's name when it differs from the config key (``backoff_s`` is
    ``--backoff``); the parsed value lands in ``args.<flag>``. A list field is one
    option repeated (``--prompt a --prompt b``) unless ``sep`` joins it into one
    (``--lora-targets linear_qkv,linear_proj``); a dict field is ``--flag KEY=VALUE``
    repeated. ``section``: the field is a nested config section (its own dataclass,
    never a flag). ``parse``: how one option value (a list item) is read.
    ``cli_default``: what the flag defaults to where the config requires the key
    (a step run by hand may leave it out). ``path``: ``"file"``, ``"dir"`` or ``"glob"``, an input that must
    exist when the config is read; ``path_unless``: a sibling key that, when set, means the workflow writes
    it instead (``import_hf.<name>.random``); ``path_names``: values that name a built-in, not a file
    (``chat_template: chatml``).
    """
    if path not in (None, "file", "dir", "glob"):
        raise ValueError(f"setting(path=...): {path!r} is not one of file, dir, glob")
    meta = {
        "help": help,
        "trajectory": trajectory,
        "choices": choices,
        "cli": cli and section is None,
        "flag": flag,
        "sep": sep,
        "section": section,
        "parse": parse,
        "cli_default": cli_default,
        "path": path,
        "path_unless": path_unless,
        "path_names": path_names,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


REQUIRED: Any = dataclasses.MISSING


def _kind(tp: Any) -> tuple[str, Any]:
    """What a field's type hint means on the command line: (bool | list | dict | scalar, item type).

    ``int | None`` -> int; ``str | float | None`` -> str (parsed later); ``list[int] | None`` -> a list of int.
    """
    hints = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    real = [h for h in hints if h is not type(None)]
    if len(real) != 1:
        return "scalar", str
    one = real[0]
    origin = typing.get_origin(one)
    if origin is list:
        (item,) = typing.get_args(one) or (str,)
        return "list", item
    if origin is dict or one is dict:
        return "dict", str
    if one is bool:
        return "bool", bool
    return "scalar", one


def _base_type(tp: Any) -> Any:
    kind, typ = _kind(tp)
    return {"list": list, "dict": dict}.get(kind, typ)


def option(f: dataclasses.Field) -> str:
    """The ``--flag`` of a field."""
    return "--" + (f.metadata.get("flag") or f.name).replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """Where argparse puts a field's value: the flag's name, in Python spelling."""
    return (f.metadata.get("flag") or f.name).replace("-", "_")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (one item of a dict setting)."""
    k, eq, v = text.partition("=")
    if not eq or not k:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return k, v


def _help(f: dataclasses.Field, default: Any, kind: str) -> str:
    text = f.metadata.get("help") or ""
    if kind in ("list", "dict") and not f.metadata.get("sep"):
        text += " (repeatable)"
    if default is dataclasses.MISSING:
        return text + " (required)"
    if default is None or default == [] or default == {}:
        return text
    shown = f.metadata["sep"].join(map(str, default)) if f.metadata.get("sep") else default
    return f"{text} (default: {shown})"


def _argument(f: dataclasses.Field, hint: Any, required: bool) -> dict[str, Any]:
    """argparse keywords for one field."""
    kind, typ = _kind(hint)
    default = _default_of(f)
    m = f.metadata
    parse = m.get("parse") or typ
    kw: dict[str, Any] = {"dest": dest(f), "help": _help(f, default, kind)}
    if kind == "bool":
        kw.update(action=argparse.BooleanOptionalAction, default=default)
    elif kind == "list" and m.get("sep"):
        sep = m["sep"]
        kw.update(type=lambda s: [parse(x) for x in s.split(sep) if x], default=default, metavar=f"X{sep}Y")
    elif kind in ("list", "dict"):
        kw.update(action="append", type=key_value if kind == "dict" else parse, default=None)
        if kind == "dict":
            kw["metavar"] = "KEY=VALUE"
    else:
        kw.update(type=parse, choices=m.get("choices"))
        if default is dataclasses.MISSING and m.get("cli_default") is not None:
            kw["default"] = m["cli_default"]
            kw["help"] = f"{m.get('help')} (default: {m['cli_default']})"
        elif default is dataclasses.MISSING:
            kw["required"] = required
        else:
            kw["default"] = default
    return kw


def add_arguments(group: Any, cls: type, *, required: bool = True, exclude: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per CLI field of ``cls`` to an argparse parser or group, its default in its help."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True) and f.name not in exclude:
            group.add_argument(option(f), **_argument(f, hints[f.name], required))


def from_namespace(cls: type, ns: argparse.Namespace, **given: Any) -> Any:
    """The dataclass from parsed arguments; ``given`` fills non-CLI fields (others take their defaults).

    A repeatable option given no time takes the field's default.
    """
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in given or not f.metadata.get("cli", True):
            continue
        v = getattr(ns, dest(f))
        kind = _kind(hints[f.name])[0]
        if v is None and kind in ("list", "dict") and not f.metadata.get("sep"):
            v = _default_of(f)
        elif kind == "dict":
            v = dict(v)
        values[f.name] = v
    return cls(**values, **given)


def _flag_value(v: Any) -> str:
    """A config value as a command-line word (YAML's booleans as `true`/`false`)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def to_flags(cls: type, values: dict[str, Any], exclude: tuple[str, ...] = ()) -> str:
    """The flags for a config section (defaults filled), as one shell-quoted string.

    ``None`` values are left out (the CLI's own default is then also None), and so
    are fields that are not flags (nested sections, job resources).
    """
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or f.name in exclude or values.get(f.name) is None:
            continue
        opt, v, kind = option(f), values[f.name], _kind(hints[f.name])[0]
        if kind == "bool":
            out.append(opt if v else "--no-" + opt[2:])
        elif kind == "list" and f.metadata.get("sep"):
            out += [opt, f.metadata["sep"].join(map(str, v))] if v else []
        elif kind == "list":
            out += [w for item in v for w in (opt, _flag_value(item))]
        elif kind == "dict":
            out += [w for k, item in sorted(v.items()) for w in (opt, f"{k}={_flag_value(item)}")]
        else:
            out += [opt, _flag_value(v)]
    return shlex.join(out)


def defaults(cls: type) -> dict[str, Any]:
    """Field -> default (required fields left out): what the schema's defaults must equal."""
    return {f.name: _default_of(f) for f in dataclasses.fields(cls) if _default_of(f) is not dataclasses.MISSING}


def required(cls: type) -> set[str]:
    """The fields without a default: what the schema's ``required`` must list."""
    return {f.name for f in dataclasses.fields(cls) if _default_of(f) is dataclasses.MISSING}


def trajectory_keys(cls: type) -> tuple[str, ...]:
    """The fields marked ``trajectory``: the ones a fingerprint covers."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("trajectory"))


def sections(cls: type) -> dict[str, type]:
    """Field -> nested settings class, for the fields that are config sections of their own."""
    return {f.name: f.metadata["section"] for f in dataclasses.fields(cls) if f.metadata.get("section")}


def path_fields(cls: type) -> dict[str, tuple[str, str | None, tuple[str, ...]]]:
    """Field -> (``file`` | ``dir`` | ``glob``, the sibling key that exempts it, the names that are no paths) for
    the fields naming inputs."""
    return {
        f.name: (f.metadata["path"], f.metadata.get("path_unless"), f.metadata.get("path_names", ()))
        for f in dataclasses.fields(cls)
        if f.metadata.get("path")
    }
