"""The lines a successful ``snakemake`` run ends with: what the data stage read, rejected and removed, and
where the report is (``onsuccess`` in the Snakefile). Torch-free and fast: it reads the chunks' stats files.

A shard with rejected lines used to pass with nothing on the terminal (its count only in
``logs/chunk/...log``); the summary names each source's counts and the chunk that lost the largest share.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from snakellm.io.log import plural

REPORT_COMMAND = "snakemake --report report.html"


def _stats(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def data_summary(sources: Iterable[str], root: str | Path = ".") -> str | None:
    """``data: wikitext 46 documents read, 0 rejected, 4 removed as duplicates or by filters; ...; most lost:
    wikitext/chunk-00002, 4 of 18 (data/curated/wikitext/chunk-00002.removed.jsonl)``, from data/jsonl/ and data/curated/; None before any chunk."""
    root = Path(root)
    parts, worst = [], None
    for source in sources:
        read = rejected = removed = 0
        chunks = sorted((root / "data/jsonl" / source).glob("chunk-*.stats.json"))
        for p in chunks:
            st = _stats(p)
            if st is None:
                continue
            chunk = p.name.removesuffix(".stats.json")
            cur = _stats(root / "data/curated" / source / p.name) or {}
            n_read = int(st.get("documents", 0)) + int(st.get("rejected", 0))
            lost = int(st.get("rejected", 0)) + int(cur.get("removed", 0))
            read, rejected, removed = (
                read + n_read,
                rejected + int(st.get("rejected", 0)),
                removed + int(cur.get("removed", 0)),
            )
            if lost and (worst is None or lost / max(n_read, 1) > worst[0]):
                files = [f"data/jsonl/{source}/{chunk}.rejected.jsonl"] if st.get("rejected") else []
                files += [f"data/curated/{source}/{chunk}.removed.jsonl"] if cur.get("removed") else []
                worst = (lost / max(n_read, 1), f"{source}/{chunk}", lost, n_read, " and ".join(files))
        if chunks:
            parts.append(f"{source} {plural(read, 'document')} read, {rejected:,} rejected, {removed:,} removed")
    if not parts:
        return None
    tail = (
        f"; most lost: {worst[1]}, {worst[2]:,} of {worst[3]:,} ({worst[4]})"
        if worst
        else "; nothing rejected or removed"
    )
    return "data: " + "; ".join(parts) + tail


def success_lines(sources: Iterable[str], root: str | Path = ".") -> list[str]:
    """What the Snakefile's ``onsuccess`` prints: the data summary and the report command."""
    out = []
    data = data_summary(sources, root)
    if data:
        out.append(f"snakellm: {data}")
    out.append(
        f"snakellm: the HTML report: {REPORT_COMMAND} (the virtual environment's snakemake, .venv/bin/snakemake; "
        "or bash scripts/run.sh --report report.html)"
    )
    return out
