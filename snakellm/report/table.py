"""Any stage's metrics or samples as a report table: the plug-in point for later stages.

``snakellm report table FILE... --output X.html --title T`` renders

* a JSON object (``metrics.json``, ``train_summary.json``): one key/value table,
  nested objects flattened to dotted keys (``rouge.f1``);
* a JSON array of objects, or JSONL (``predictions.jsonl``, generated samples):
  one row per record (the first ``--max-rows``), columns in first-seen order,
  long texts wrapped;
* CSV / TSV: as is.

Several files give one section each (e.g. one per evaluation task). See
rules/report.smk (``REPORT_TABLES``) for how a rule adds its outputs to the report.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from . import html as H
from .data import ReportInputError


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict) and obj:
        out: list[tuple[str, Any]] = []
        for k, v in obj.items():
            out += flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, obj)]


def _records_table(records: list[dict], max_rows: int) -> str:
    cols: list[str] = []
    for r in records[:max_rows]:
        for k in r:
            if k not in cols:
                cols.append(k)
    rows = [[r.get(c) for c in cols] for r in records[:max_rows]]
    more = f'<p class="note">{len(records) - max_rows:,} more records not shown.</p>' if len(records) > max_rows else ""
    return H.table(cols, rows) + more


def render_file(path: str, max_rows: int = 50) -> tuple[str, str]:
    """(a one-line description, the HTML of the file's table)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ReportInputError(f"{path}: not UTF-8 text: {e}") from None
    name = p.name
    if name.endswith((".csv", ".tsv")):
        rows = list(csv.reader(text.splitlines(), delimiter="\t" if name.endswith(".tsv") else ","))
        if not rows:
            return "empty", "<p>empty file</p>"
        body = rows[1 : max_rows + 1]
        return f"{len(rows) - 1:,} rows", H.table(rows[0], body)
    if name.endswith(".jsonl"):
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ReportInputError(f"{path}:{lineno}: not JSON: {e}") from None
            records.append(rec if isinstance(rec, dict) else {"value": rec})
        return f"{len(records):,} records", _records_table(records, max_rows)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ReportInputError(f"{path}: not JSON, JSONL, CSV or TSV: {e}") from None
    if isinstance(obj, list):
        records = [r if isinstance(r, dict) else {"value": r} for r in obj]
        return f"{len(records):,} records", _records_table(records, max_rows)
    pairs = flatten(obj)
    return f"{len(pairs):,} values", H.key_values(pairs)


def table_page(files: list[str], title: str, note: str = "", max_rows: int = 50) -> str:
    sections = []
    for f in files:
        what, body = render_file(f, max_rows)
        sections.append(H.section(f, body, note=what) if len(files) > 1 else H.section(f"{f} ({what})", body))
    return H.page(title, *sections, note=note)
