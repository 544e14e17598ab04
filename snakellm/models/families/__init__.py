"""The model families, one module each: ``get(style)``, ``by_model_type(hf_type)``, ``for_arch(arch)``.

A module in this package that defines ``FAMILY`` (a :class:`~snakellm.models.families.base.Family`)
is a family; modules are registered in name order, so adding a family is adding one file
(docs/extending.md). Everything else in snakellm asks the family: the architecture defaults
and presets (``snakellm.models.architecture``), megatron-core's build extras, the Hugging Face
export and import, NeMo's config, PEFT adapter names and the KV-cached decoder's RoPE.
Torch-free.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from snakellm.models.families.base import Arch, Family, FamilyError, HFKey, Weight, head_dim

__all__ = [
    "FAMILIES",
    "Family",
    "FamilyError",
    "HFKey",
    "Weight",
    "by_model_type",
    "for_arch",
    "for_features",
    "for_nemo",
    "get",
    "head_dim",
    "presets",
]


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        fam = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(fam, Family):
            if fam.name in found:
                raise FamilyError(f"two families named {fam.name!r}")
            found[fam.name] = fam
    return found


FAMILIES: dict[str, Family] = _discover()


def get(name: str) -> Family:
    """The family of a model style (``runs.<run>.model.style``)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise FamilyError(f"unknown model style {name!r} (styles: {', '.join(FAMILIES)})") from None


def by_model_type(model_type: Any, where: str = "config.json", config: dict[str, Any] | None = None) -> Family:
    """The family of a Hugging Face ``model_type`` (what ``import-hf`` reads).

    Where families share a model_type, one whose ``hf_claims(config)`` is true comes first;
    the one without ``hf_claims`` takes the rest.
    """
    same = [f for f in FAMILIES.values() if f.hf_model_type == model_type]
    for fam in same:
        if fam.hf_claims is not None and config is not None and fam.hf_claims(config):
            return fam
    for fam in same:
        if fam.hf_claims is None:
            return fam
    known = " and ".join(dict.fromkeys(f.hf_model_type for f in FAMILIES.values()))
    raise FamilyError(f"{where}: model_type {model_type!r}: import supports {known}")


def for_arch(arch: Arch) -> Family:
    """The family whose Hugging Face class computes exactly this architecture.

    The architecture's own style is asked first (a later family may share another's features
    and differ in a hook, e.g. Qwen2's qkv bias), then every other family.
    """
    own = FAMILIES.get(str(arch.get("style")))
    order = ([own] if own else []) + [f for f in FAMILIES.values() if f is not own]
    for fam in order:
        reason = fam.computes(arch)
        if reason is None:
            return fam
        if all(arch.get(k) == v for k, v in fam.features.items()):
            raise FamilyError(reason)  # the right class, refusing a detail (GPT-2 and grouped-query attention)
    keys = list(dict.fromkeys(k for f in FAMILIES.values() for k in f.features))
    got = ", ".join(f"{k}={arch.get(k)}" for k in keys)
    raise FamilyError(
        f"no Hugging Face class computes this model ({got}): " + "; ".join(f.needs() for f in FAMILIES.values())
    )


def for_features(position_embedding: str, normalization: str, activation: str) -> Family:
    """The family a foreign config with these features is labelled with (NeMo import).

    All three match: that family; else the first whose position embedding matches; else the first.
    """
    want = dict(position_embedding=position_embedding, normalization=normalization, activation=activation)
    for fam in FAMILIES.values():
        if all(want.get(k) == v for k, v in fam.features.items()):
            return fam
    for fam in FAMILIES.values():
        if fam.features.get("position_embedding") == position_embedding:
            return fam
    return next(iter(FAMILIES.values()))


def for_nemo(cfg: dict[str, Any], position_embedding: str, normalization: str, activation: str) -> Family:
    """The family of a NeMo ``model_config.yaml``: one with these features whose ``nemo_claims`` takes it,
    else :func:`for_features`'s."""
    want = dict(position_embedding=position_embedding, normalization=normalization, activation=activation)
    for fam in FAMILIES.values():
        if fam.nemo_claims is not None and all(want.get(k) == v for k, v in fam.features.items()):
            if fam.nemo_claims(cfg):
                return fam
    return for_features(position_embedding, normalization, activation)


def presets() -> dict[str, dict[str, Any]]:
    """Every family's presets, each with its ``style``, in registry order."""
    return {name: {"style": fam.name, **keys} for fam in FAMILIES.values() for name, keys in fam.presets.items()}
