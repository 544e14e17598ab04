"""Data-stage report: documents, bytes and rejected lines per chunk; downloads.

Reads what ``snakellm chunk`` wrote next to each chunk (``.stats.json`` and
``.rejected.jsonl``) and, for http sources, the download manifests and the
download jobs' logs (retries are only recorded there).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from snakellm.errors import DataError

from . import html as H
from . import plots

EXAMPLES_PER_REASON = 3
EXAMPLE_CHARS = 300


class ReportInputError(DataError):
    """An input file that is not what the step expects (the message names it)."""


def read_json(path: str | Path) -> dict:
    try:
        obj = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ReportInputError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ReportInputError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


def rejected_path(stats_path: str) -> Path:
    if not stats_path.endswith(".stats.json"):
        raise ReportInputError(f"{stats_path}: not a chunk .stats.json")
    return Path(stats_path.removesuffix(".stats.json") + ".rejected.jsonl")


def load_chunks(stats_files: list[str]) -> list[dict]:
    chunks = []
    for path in stats_files:
        st = read_json(path)
        missing = [k for k in ("chunk", "documents", "rejected", "lines_read", "rejected_by_reason") if k not in st]
        if missing:
            raise ReportInputError(f"{path}: not a chunk stats file (no {', '.join(missing)})")
        st["_path"] = path
        chunks.append(st)
    return sorted(chunks, key=lambda s: (s.get("source", ""), s["chunk"]))


def rejection_examples(chunks: list[dict], per_reason: int = EXAMPLES_PER_REASON) -> dict[str, list[dict]]:
    """Up to ``per_reason`` rejected lines per reason, in chunk order.

    A file is read only until every reason its stats count has enough examples,
    so a chunk with millions of bad lines costs a few lines of reading.
    """
    examples: dict[str, list[dict]] = {}
    for st in chunks:
        wanted = {r for r, n in st["rejected_by_reason"].items() if n}
        if not any(len(examples.get(r, [])) < per_reason for r in wanted):
            continue
        path = rejected_path(st["_path"])
        with open(path, encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                try:
                    rec = json.loads(line)
                    reason = rec["reason"]
                except (ValueError, KeyError, TypeError):
                    raise ReportInputError(f"{path}:{lineno}: not a rejected-line record") from None
                got = examples.setdefault(reason, [])
                if len(got) < per_reason:
                    got.append({"chunk": st["chunk"], **rec})
                if all(len(examples.get(r, [])) >= per_reason for r in wanted):
                    break
    return examples


def _short(text: object, limit: int = EXAMPLE_CHARS) -> str:
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    return s if len(s) <= limit else s[:limit] + f" … ({len(s):,} characters)"


def source_table(source: str, chunks: list[dict], examples: dict[str, list[dict]]) -> str:
    reasons = sorted({r for st in chunks for r, n in st["rejected_by_reason"].items() if n})
    cols = ["chunk", "shards", "lines read", "documents", "rejected", *reasons, "bytes in (compressed)", "bytes out"]
    rows = []
    for st in chunks:
        by = st["rejected_by_reason"]
        rows.append(
            [
                st["chunk"],
                st.get("shards"),
                st["lines_read"],
                st["documents"],
                st["rejected"],
                *[by.get(r, 0) for r in reasons],
                st.get("bytes_in_compressed"),
                st.get("bytes_out"),
            ]
        )
    total = ["total", sum(st.get("shards") or 0 for st in chunks)] + [
        sum(r[i] or 0 for r in rows) for i in range(2, len(cols))
    ]
    lines = sum(st["lines_read"] for st in chunks)
    rejected = sum(st["rejected"] for st in chunks)
    sections = [
        H.section(
            "Chunks",
            H.table(cols, rows, total),
            note=f"{len(chunks)} chunks; {rejected:,} of {lines:,} lines rejected"
            + (f" ({100 * rejected / lines:.3g}%)" if lines else "")
            + ". Every line read is either a document or a rejected line.",
        )
    ]
    counts: Counter[str] = Counter()
    for st in chunks:
        counts.update({r: n for r, n in st["rejected_by_reason"].items() if n})
    if counts:
        rrows = []
        for reason, n in counts.most_common():
            ex = examples.get(reason, [])
            shown = "\n".join(
                f"{e['chunk']} {Path(str(e.get('shard', ''))).name}:{e.get('line')}: {_short(e.get('content', ''))}"
                for e in ex
            )
            rrows.append([reason, n, shown])
        sections.append(
            H.section(
                "Rejection reasons",
                H.table(
                    ["reason", "lines", f"examples (first {EXAMPLES_PER_REASON}: chunk shard:line: content)"], rrows
                ),
                note="Most frequent first. Every rejected line is kept whole in data/jsonl/{source}/{chunk}.rejected.jsonl.",
            )
        )
    else:
        sections.append(H.section("Rejection reasons", f"<p>No line of {source} was rejected.</p>"))
    return H.page(f"Data: {source}", *sections)


def source_plot(source: str, chunks: list[dict], path: str) -> None:
    names = [st["chunk"].removeprefix("chunk-") for st in chunks]
    x = range(len(chunks))
    fig, axes = plots.figure(width=max(6.0, min(16.0, 2 + 0.22 * len(chunks))), height=5.2, rows=2, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    top.bar(x, [st["documents"] for st in chunks], color=plots.COLORS[0], label="documents")
    top.set_ylabel("documents")
    mb = top.twinx()
    mb.plot(
        list(x), [(st.get("bytes_out") or 0) / 1e6 for st in chunks], "o-", color=plots.COLORS[1], label="MB of text"
    )
    mb.set_ylabel("MB (jsonl)")
    mb.set_ylim(bottom=0)
    mb.grid(False)
    top.set_title(f"{source}: documents and MB per chunk")
    h1, l1 = top.get_legend_handles_labels()
    h2, l2 = mb.get_legend_handles_labels()
    top.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    reasons = sorted({r for st in chunks for r, n in st["rejected_by_reason"].items() if n})
    base = [0] * len(chunks)
    for i, r in enumerate(reasons):
        vals = [st["rejected_by_reason"].get(r, 0) for st in chunks]
        bottom.bar(x, vals, bottom=base, label=r, color=plots.COLORS[(i + 2) % len(plots.COLORS)])
        base = [b + v for b, v in zip(base, vals, strict=False)]
    if reasons:
        bottom.legend(fontsize=8, title="reason", title_fontsize=8)
    else:
        plots.empty_note(bottom, f"no rejected lines in {sum(st['lines_read'] for st in chunks):,} lines read")
        bottom.set_ylim(0, 1)
    bottom.set_ylabel("rejected lines")
    bottom.set_title("rejected lines per chunk, by reason")
    step = max(1, len(chunks) // 30)
    bottom.set_xticks(list(x)[::step], names[::step], rotation=90 if len(chunks) > 12 else 0)
    bottom.set_xlabel("chunk")
    plots.save(fig, path)


def overview_table(chunks: list[dict]) -> str:
    by_source: dict[str, list[dict]] = {}
    for st in chunks:
        by_source.setdefault(st.get("source") or "?", []).append(st)
    cols = [
        "source",
        "format",
        "chunks",
        "shards",
        "lines read",
        "documents",
        "rejected",
        "compressed",
        "text",
        "MB/s (chunk step)",
    ]
    rows = []
    for s, cs in by_source.items():
        secs = sum(c.get("seconds") or 0 for c in cs)
        out = sum(c.get("bytes_out") or 0 for c in cs)
        rows.append(
            [
                s,
                cs[0].get("format"),
                len(cs),
                sum(c.get("shards") or 0 for c in cs),
                sum(c["lines_read"] for c in cs),
                sum(c["documents"] for c in cs),
                sum(c["rejected"] for c in cs),
                H.human_bytes(sum(c.get("bytes_in_compressed") or 0 for c in cs)),
                H.human_bytes(out),
                round(out / 1e6 / secs, 1) if secs else None,
            ]
        )
    total = [
        "all",
        "",
        sum(r[2] for r in rows),
        sum(r[3] for r in rows),
        sum(r[4] for r in rows),
        sum(r[5] for r in rows),
        sum(r[6] for r in rows),
        H.human_bytes(sum(c.get("bytes_in_compressed") or 0 for c in chunks)),
        H.human_bytes(sum(c.get("bytes_out") or 0 for c in chunks)),
        "",
    ]
    return H.page(
        "Data: all sources",
        H.table(cols, rows, total),
        note="What the chunk step read and kept, per source (data/jsonl/{source}/{chunk}.stats.json).",
    )


# ------------------------------------------------------------------ downloads (http sources)

_SUMMARY = re.compile(r"([\d.]+) MB fetched in (\d+) requests, (\d+) shards already complete\) in ([\d.]+) s")
_RETRY = re.compile(r": ([^;\n]*); retry (\d+)/(\d+) in ")


def parse_download_log(path: str | Path) -> dict:
    """Requests, retries and their reasons from a ``snakellm download`` log (the only place retries are kept)."""
    text = Path(path).read_text(errors="replace") if Path(path).is_file() else ""
    reasons: Counter[str] = Counter()
    for m in _RETRY.finditer(text):
        reasons[re.sub(r"(?<!HTTP )\b\d+(\.\d+)?", "N", m.group(1))[:100]] += 1  # one row per kind, not per byte count
    found = _SUMMARY.findall(text)
    if not found:
        return {
            "retries": sum(reasons.values()),
            "reasons": dict(reasons),
            "requests": None,
            "fetched_mb": None,
            "reused": None,
            "seconds": None,
        }
    mb, req, reused, secs = found[-1]
    return {
        "retries": sum(reasons.values()),
        "reasons": dict(reasons),
        "requests": int(req),
        "fetched_mb": float(mb),
        "reused": int(reused),
        "seconds": float(secs),
    }


def download_table(source: str, manifests: list[str], logs: list[str]) -> str:
    if logs and len(logs) != len(manifests):
        raise ReportInputError(f"{len(manifests)} manifests but {len(logs)} logs: give one log per manifest, in order")
    rows: list[list[Any]] = []
    reasons: Counter[str] = Counter()
    for i, m in enumerate(manifests):
        man = read_json(m)
        if "shards" not in man:
            raise ReportInputError(f"{m}: not a download manifest (no shards)")
        lg = parse_download_log(logs[i]) if logs else {}
        reasons.update(lg.get("reasons", {}))
        hosts = sorted({str(s.get("url", "")).split("/")[2] for s in man["shards"] if "://" in str(s.get("url", ""))})
        rows.append(
            [
                man.get("chunk") or Path(m).name.split(".")[0],
                len(man["shards"]),
                man.get("size"),
                H.human_bytes(man.get("size")),
                lg.get("requests"),
                lg.get("retries"),
                lg.get("reused"),
                lg.get("seconds"),
                ", ".join(hosts),
            ]
        )
    total = [
        "total",
        sum(r[1] for r in rows),
        sum(r[2] or 0 for r in rows),
        H.human_bytes(sum(r[2] or 0 for r in rows)),
        sum(r[4] or 0 for r in rows),
        sum(r[5] or 0 for r in rows),
        sum(r[6] or 0 for r in rows),
        round(sum(r[7] or 0 for r in rows), 1),
        "",
    ]
    cols = ["chunk", "shards", "bytes", "size", "requests (last run)", "retries", "shards reused", "seconds", "hosts"]
    parts = [
        H.section(
            "Chunks",
            H.table(cols, rows, total),
            note="Sizes from data/raw/{source}/{chunk}.manifest.json (every shard complete, sha256 checked); "
            "requests and retries from the last download job's log (logs/download/...).",
        )
    ]
    if reasons:
        parts.append(H.section("Retry reasons", H.table(["reason", "retries"], reasons.most_common())))
    else:
        parts.append(H.section("Retry reasons", "<p>No request was retried.</p>"))
    return H.page(f"Downloads: {source}", *parts)
