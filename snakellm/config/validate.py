"""Config validation with defaults and errors that name the key.

Snakemake's own ``validate()`` reports the first JSON-schema error in schema
terms; users need "which key, what is wrong, what is allowed". This module
fills defaults from ``config/schema.yaml`` and raises :class:`ConfigError` with
a dotted key path, and then checks that the files the config names exist.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema import Draft202012Validator

from snakellm.errors import ConfigError

__all__ = ["ConfigError", "load", "load_schema", "require_file", "validate"]


def _with_defaults(cls):
    validate_props = cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and prop not in instance:
                    instance[prop] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    return jsonschema.validators.extend(cls, {"properties": set_defaults})


_Validator = _with_defaults(Draft202012Validator)


def load_schema(path: str | os.PathLike) -> dict:
    with open(path) as fh:
        return yaml.safe_load(fh)


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def did_you_mean(unknown: list[str], known: list[str]) -> str:
    """``"; did you mean 'steps'?"`` for the unknown names that are a near miss of a known one (difflib), else ``""``."""
    pairs = [(u, m[0]) for u in unknown if (m := difflib.get_close_matches(u, known, n=1, cutoff=0.6))]
    if not pairs:
        return ""
    if len(pairs) == 1 and len(unknown) == 1:
        return f"; did you mean {pairs[0][1]!r}?"
    return "; did you mean " + ", ".join(f"{m!r} for {u!r}" for u, m in pairs) + "?"


def _describe(err: jsonschema.ValidationError) -> str:
    where = _key(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = sorted(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"config key {where}: unknown key {', '.join(map(repr, extra))}{did_you_mean(extra, allowed)}{hint}"
    if err.validator == "required":
        return f"config key {where}: {err.message}"
    if err.validator == "enum":
        return f"config key {where}: {err.instance!r} is not one of {', '.join(map(str, err.validator_value))}"
    if err.validator == "type":
        return f"config key {where}: {err.instance!r} is not of type {err.validator_value}"
    if "propertyNames" in err.absolute_schema_path:
        return (
            f"config key {where}: bad name {err.instance!r} "
            "(names use letters, digits, '_', '.', '-' and start with a letter or digit)"
        )
    return f"config key {where}: {err.message}"


def validate(config: dict, schema: dict) -> dict:
    """Fill defaults into ``config`` in place and raise ConfigError on the first problem."""
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        # the deepest error under a oneOf/anyOf is the most specific one
        err = jsonschema.exceptions.best_match(errors) if len(errors) > 1 else errors[0]
        raise ConfigError(_describe(err))
    return config


def require_file(key: str, path: str | None) -> None:
    if path and not Path(path).is_file():
        raise ConfigError(f"config key {key}: file not found: {path}")


def load(path: str | os.PathLike, schema_path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config and validate it (for the CLIs and tests; Snakemake passes its own dict)."""
    with open(path) as fh:
        cfg = yaml.safe_load(fh) or {}
    return validate(cfg, load_schema(schema_path))
