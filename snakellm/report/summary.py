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


def _schema_change(first: dict, sch: dict) -> str:
    """``adds 'score'; drops 'url'; retypes 'id' (string -> int64)``: how a file's columns differ from the first's."""
    from snakellm.data.columnar import schema_diff  # pyarrow-free at import

    d = schema_diff(first, sch)
    what = [f"adds {', '.join(map(repr, d['added']))}"] if d["added"] else []
    what += [f"drops {', '.join(map(repr, d['removed']))}"] if d["removed"] else []
    what += [f"retypes {', '.join(f'{k!r} ({first[k]} -> {sch[k]})' for k in d['retyped'])}"] if d["retyped"] else []
    return "; ".join(what)


def schema_notes(sources: Iterable[str], root: str | Path = ".") -> list[str]:
    """One line per parquet/Arrow source whose files do not all have its first file's schema, across its
    chunks (a chunk's stats name the changes within it; this names those between chunks): the files, what
    each adds, drops or retypes, and the stats file that records it. Their records carry other fields."""
    root, out = Path(root), []
    for source in sources:
        first: tuple[str, dict] | None = None
        changed: list[str] = []
        for p in sorted((root / "data/jsonl" / source).glob("chunk-*.stats.json")):
            st = _stats(p) or {}
            for r in st.get("per_shard") or []:
                sch = r.get("schema")
                if not isinstance(sch, dict):
                    continue
                if first is None:
                    first = (str(r.get("shard")), sch)
                elif sch != first[1] and (change := _schema_change(first[1], sch)):
                    changed.append(f"{r.get('shard')} {change} ({p.relative_to(root)})")
        if first is not None and changed:
            shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3:,} more" if len(changed) > 3 else "")
            out.append(
                f"note: source {source}: {plural(len(changed), 'file')} with another schema than its first file "
                f"({first[0]}), so their records carry other fields: {shown}"
            )
    return out


def success_lines(sources: Iterable[str], root: str | Path = ".") -> list[str]:
    """What the Snakefile's ``onsuccess`` prints: the data summary, schema changes between a columnar source's
    files, and the report command."""
    out = []
    data = data_summary(sources, root)
    if data:
        out.append(f"snakellm: {data}")
    out += [f"snakellm: {line}" for line in schema_notes(sources, root)]
    out.append(
        f"snakellm: the HTML report: {REPORT_COMMAND} (the virtual environment's snakemake, .venv/bin/snakemake; "
        "or bash scripts/run.sh --report report.html)"
    )
    return out
