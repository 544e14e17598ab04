"""``snakellm track-data``: the data stages' counts as one W&B / MLflow data run per workflow.

Reads every chunk's ``.stats.json`` (the chunk step's: lines read, documents,
rejected lines by reason) and every curated chunk's (documents in and out,
removed by reason), sums them per source and stage, and logs them as the
summary of one tracker run (kind ``data``, named ``data``) whose ids stay in
``--state-dir``/tracking.json, so a rerun after new shards updates the same
run. ``--output`` records what was logged (the rule's target). The tracker
calls cost at most 30 s and one warning (:mod:`snakellm.tracking`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from snakellm import tracking
from snakellm.config.settings import DefaultsHelpFormatter
from snakellm.errors import UsageError
from snakellm.io.atomic import write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="snakellm track-data",
        description="The data stages' counts (chunk: documents, rejected by reason; curate: documents in and out, "
        "removed by reason) per source, as one W&B / MLflow data run.",
    )
    p.add_argument("stats", nargs="+", help="chunk and curated chunk .stats.json files")
    p.add_argument("--state-dir", required=True, help="where the data run's tracking.json is kept")
    p.add_argument("--output", required=True, help="the counts logged, as json")
    p.add_argument("--name", default="data", help="the tracker run's name")
    tracking.add_arguments(p)
    return p


def _add(out: dict[str, float], key: str, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out[key] = out.get(key, 0) + value


def counts(paths: list[str]) -> dict[str, float]:
    """``{stage}/{source}/{count}`` and ``{stage}/{count}`` (all sources) over the stats files."""
    out: dict[str, float] = {}
    for path in paths:
        try:
            st = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: not a readable stats json ({e})") from None
        source = st.get("source") or "?"
        keys: tuple[str, ...]
        if "documents_in" in st:
            stage, keys, reasons = "curate", ("documents_in", "documents", "removed"), "removed_by_reason"
        elif "lines_read" in st:
            stage, keys, reasons = "chunk", ("lines_read", "documents", "rejected", "skipped"), "rejected_by_reason"
        else:
            raise UsageError(f"{path}: neither a chunk's nor a curated chunk's stats (no lines_read, no documents_in)")
        for where in (f"{stage}/{source}", stage):
            _add(out, f"{where}/chunks", 1)
            for k in keys:
                _add(out, f"{where}/{k}", st.get(k))
            for reason, n in (st.get(reasons) or {}).items():
                _add(out, f"{where}/{reasons.split('_')[0]}/{reason}", n)
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    values = counts(a.stats)
    settings = tracking.settings_from_args(a)
    sources = sorted({k.split("/")[1] for k in values if k.count("/") >= 2})
    t = tracking.open_tracker(
        settings,
        tracking.RunInfo(
            name=a.name,
            kind="data",
            dir=Path(a.state_dir),
            params={"sources": sources, "stats_files": len(a.stats)},
        ),
    )
    if t is not None:
        t.summary(values)
        t.close("completed")
    backends = [n for n, (on, _) in tracking.BACKENDS.items() if on(settings)]
    write_json(a.output, {"backends": backends, "counts": values})
    print(
        f"snakellm track-data: {len(values)} counts over {len(a.stats)} stats files -> {', '.join(backends) or 'no tracker'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
