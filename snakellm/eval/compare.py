"""The base-vs-tuned table of a fine-tune: one evaluation of each, their metrics and the differences.

Both sides are ``snakellm evaluate`` outputs on the same test split with the
same decoding settings (checked: a table across different data or decoding
would compare nothing). Written as ``comparison.json`` (the numbers, with a few
predictions side by side), ``comparison.tsv`` (metric, base, tuned, difference)
and ``comparison.md`` (the same table for people), all or none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError
from snakellm.io.atomic import atomic_group

# (metric, higher is better): NeMo's names first, then SQuAD's
METRICS = (("test_exact_string_match", True), ("squad_exact_match", True), ("squad_f1", True), ("test_loss", False))
SHOWN = 8  # predictions side by side in comparison.json


class CompareError(UsageError):
    """Two evaluations that cannot be compared (other data, other decoding), phrased with both files."""


def _load(d: Path) -> tuple[dict, list[dict]]:
    try:
        m = json.loads((d / "metrics.json").read_text(encoding="utf-8"))
        preds = [json.loads(x) for x in (d / "predictions.jsonl").read_text(encoding="utf-8").splitlines() if x]
    except (OSError, ValueError) as e:
        raise CompareError(f"{d}: not a snakellm evaluate output: {e}") from None
    return m, preds


def compare(base_dir: str | Path, tuned_dir: str | Path, name: str = "") -> dict[str, Any]:
    """The comparison of two evaluation directories (metrics.json + predictions.jsonl each)."""
    bd, td = Path(base_dir), Path(tuned_dir)
    (bm, bp), (tm, tp) = _load(bd), _load(td)
    for key in ("examples", "decoding"):
        if bm.get(key) != tm.get(key):
            raise CompareError(
                f"{bd}/metrics.json and {td}/metrics.json differ in {key}: {bm.get(key)!r} != {tm.get(key)!r}"
            )
    rows = []
    for metric, higher in METRICS:
        b, t = float(bm[metric]), float(tm[metric])
        rows.append({"metric": metric, "base": b, "tuned": t, "difference": t - b, "higher_is_better": higher})
    side = [
        {"input": b["input"], "label": b["label"], "base": b["pred"], "tuned": t["pred"]}
        for b, t in zip(bp[:SHOWN], tp[:SHOWN], strict=False)
    ]
    fixed = sum(1 for b, t in zip(bp, tp, strict=False) if b["pred"] != b["label"] and t["pred"] == t["label"])
    broken = sum(1 for b, t in zip(bp, tp, strict=False) if b["pred"] == b["label"] and t["pred"] != t["label"])
    return {
        "finetune": name,
        "base": str(bd),
        "tuned": str(td),
        "test": tm.get("test"),
        "examples": tm["examples"],
        "decoding": tm.get("decoding"),
        "metrics": rows,
        "newly_exact": fixed,
        "no_longer_exact": broken,
        "predictions": side,
    }


def markdown(c: dict[str, Any]) -> str:
    """The table as Markdown (numbers to 4 places; the difference signed)."""
    title = f"Base vs tuned{': ' + c['finetune'] if c['finetune'] else ''} ({c['examples']} test examples)"
    lines = [f"# {title}", "", "| metric | base | tuned | difference |", "|---|---:|---:|---:|"]
    lines += [f"| {r['metric']} | {r['base']:.4f} | {r['tuned']:.4f} | {r['difference']:+.4f} |" for r in c["metrics"]]
    lines += [
        "",
        f"Exact after tuning, not before: {c['newly_exact']}; exact before, not after: {c['no_longer_exact']}.",
    ]
    return "\n".join(lines) + "\n"


def tsv(c: dict[str, Any]) -> str:
    out = ["metric\tbase\ttuned\tdifference"]
    out += [f"{r['metric']}\t{r['base']!r}\t{r['tuned']!r}\t{r['difference']!r}" for r in c["metrics"]]
    return "\n".join(out) + "\n"


def write(c: dict[str, Any], out_dir: str | Path) -> None:
    out = Path(out_dir)
    with atomic_group(out / "comparison.json", out / "comparison.tsv", out / "comparison.md") as (j, t, m):
        j.write_text(json.dumps(c, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        t.write_text(tsv(c), encoding="utf-8")
        m.write_text(markdown(c), encoding="utf-8")
