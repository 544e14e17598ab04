"""Self-contained HTML pages and tables (no scripts, no external files).

Snakemake's report shows an ``.html`` result in an iframe; these pages carry
their own small stylesheet so tables read well there and in a browser alone.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

STYLE = """
body { font-family: "Liberation Sans", Arial, Helvetica, sans-serif; font-size: 14px; color: #1f2328;
       margin: 16px 20px; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
h2 { font-size: 16px; margin: 22px 0 6px 0; border-bottom: 1px solid #d0d7de; padding-bottom: 3px; }
p.note { color: #57606a; margin: 4px 0 10px 0; }
table { border-collapse: collapse; margin: 6px 0 12px 0; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; vertical-align: top; }
th { background: #f6f8fa; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.total td { font-weight: bold; background: #f6f8fa; }
td pre, pre.block { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 12px;
       font-family: "Liberation Mono", monospace; max-width: 900px; }
span.piece { display: inline-block; border: 1px solid #9ab; border-radius: 3px; padding: 0 2px; margin: 1px;
       background: #eef4fb; font-family: "Liberation Mono", monospace; font-size: 12px; white-space: pre; }
td.pieces { max-width: 640px; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any, digits: int = 4) -> str:
    """Numbers for people: thousands separators for ints, significant digits for floats."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1000:
            return f"{value:,.0f}" if abs(value) < 1e15 else f"{value:.{digits}g}"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.{digits}g}"
        return f"{value:.{digits}g}"
    return str(value)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def cell(value: Any) -> str:
    """One <td>: numbers right-aligned; pre-formatted HTML passes through as Raw."""
    if isinstance(value, Raw):
        return f'<td class="{value.css}">{value.html}</td>' if value.css else f"<td>{value.html}</td>"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<td class="num">{esc(fmt(value))}</td>'
    if isinstance(value, (dict, list)):
        import json

        # Unicode as text (a £ stays a £, not \u00a3)
        return f"<td><pre>{esc(json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False))}</pre></td>"
    text = "–" if value is None else str(value)
    if "\n" in text or len(text) > 200:
        return f"<td><pre>{esc(text)}</pre></td>"
    return f"<td>{esc(text)}</td>"


class Raw:
    """HTML that is already escaped (e.g. a tokenized sentence with piece boxes)."""

    def __init__(self, html_text: str, css: str = "") -> None:
        self.html = html_text
        self.css = css


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], total: Sequence[Any] | None = None) -> str:
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    if total is not None:
        body += '<tr class="total">' + "".join(cell(v) for v in total) + "</tr>"
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def key_values(pairs: Iterable[tuple[str, Any]]) -> str:
    return table(("", ""), ([k, v] for k, v in pairs)).replace("<thead><tr><th></th><th></th></tr></thead>", "")


def page(title: str, *sections: str, note: str = "") -> str:
    intro = f'<p class="note">{esc(note)}</p>' if note else ""
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n"
        f"<body><h1>{esc(title)}</h1>{intro}\n" + "\n".join(sections) + "\n</body></html>\n"
    )


def section(heading: str, *parts: str, note: str = "") -> str:
    intro = f'<p class="note">{esc(note)}</p>' if note else ""
    return f"<h2>{esc(heading)}</h2>{intro}" + "".join(parts)
