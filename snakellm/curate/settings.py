"""The curation steps' command line: a source's ``curate`` section as flags and back.

The flags derive from the settings dataclasses (snakellm.config.sections: CurateSettings,
NearDupSettings, and one per filter); the rule writes them with
:func:`snakellm.config.flags.curate_flags`, and :func:`from_args` rebuilds the section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from snakellm.config import sections as S
from snakellm.config.flags import CURATE_JUDGE_KEYS
from snakellm.config.settings import add_arguments, from_namespace

FILTER_SETTINGS = {
    "gopher_repetition": S.GopherRepetitionSettings,
    "gopher_quality": S.GopherQualitySettings,
    "c4": S.C4Settings,
    "fineweb": S.FineWebSettings,
}


def add(p: argparse.ArgumentParser, filters: bool = True) -> None:
    """The curate settings' flags (config: sources.NAME.curate)."""
    g = p.add_argument_group("curation (config: sources.NAME.curate)")
    add_arguments(g, S.CurateSettings, exclude=("index",) if filters else ("index", *CURATE_JUDGE_KEYS))
    g.add_argument("--near", action=argparse.BooleanOptionalAction, default=False, help="MinHash near dedup")
    add_arguments(p.add_argument_group("near duplicates (config: sources.NAME.curate.near)"), S.NearDupSettings)
    if filters:
        g.add_argument(
            "--filter", action="append", default=[], choices=S.CURATE_FILTERS, help="turn a quality filter on"
        )
        g.add_argument(
            "--filter-setting",
            action="append",
            default=[],
            metavar="NAME.KEY=JSON",
            help="one setting of a filter, e.g. gopher_quality.min_doc_words=30 (the filter's settings: "
            "docs/data.md#curation)",
        )


def from_args(a: argparse.Namespace, p: argparse.ArgumentParser) -> dict[str, Any]:
    """The ``curate`` section the flags describe (an unknown filter setting is a usage error naming it)."""
    names = {f.name for f in dataclasses.fields(S.CurateSettings)}
    top = from_namespace(
        S.CurateSettings,
        a,
        **{n: None for n in names if not hasattr(a, n) or n in ("near", "filters", "index")},
    )
    cur: dict[str, Any] = {
        k: getattr(top, k) for k in ("exact", "languages", "language_threshold", "language_model") if hasattr(a, k)
    }
    cur["near"] = dataclasses.asdict(from_namespace(S.NearDupSettings, a, index_jobs=1)) if a.near else None
    filters: dict[str, dict[str, Any]] = {n: {} for n in getattr(a, "filter", None) or []}
    for item in getattr(a, "filter_setting", None) or []:
        where, eq, value = item.partition("=")
        name, dot, key = where.partition(".")
        if not eq or not dot or name not in filters:
            p.error(f"--filter-setting {item!r}: expected NAME.KEY=JSON for a filter given with --filter")
        if key not in {f.name for f in dataclasses.fields(FILTER_SETTINGS[name])}:
            p.error(f"--filter-setting {item!r}: filter {name} has no setting {key!r}")
        try:
            filters[name][key] = json.loads(value)
        except json.JSONDecodeError as e:
            p.error(f"--filter-setting {item!r}: the value is not JSON ({e})")
    if hasattr(a, "filter"):
        cur["filters"] = filters
    return cur
