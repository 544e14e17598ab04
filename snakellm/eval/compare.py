"""The base-vs-tuned table of a fine-tune: one evaluation of each, their metrics and the differences.

Both sides are ``snakellm evaluate`` outputs on the same test split with the
same decoding settings (checked: a table across different data or decoding
would compare nothing). Written as ``comparison.json`` (the numbers, with a few
predictions side by side), ``comparison.tsv`` (metric, base, tuned, difference)
and ``comparison.md`` (the same table for people), all or none.

A DPO fine-tune has no generation to compare: its table (:func:`preference`) is the held-out test pairs'
preference metrics of the initial policy (base) and of the tuned one, both from its finetune_summary.json.
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
# a DPO fine-tune's rows (metric, higher is better): the reward accuracy with ties counted half, TRL's strict
# one, the margin, the policy's summed completion log-probabilities and the loss
PREFERENCE_METRICS = (
    ("reward_accuracy", True),
    ("rewards/accuracies", True),
    ("rewards/margins", True),
    ("logps/chosen", True),
    ("logps/rejected", False),
    ("loss", False),
)


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


def preference(summary_path: str | Path, name: str = "") -> dict[str, Any]:
    """A DPO fine-tune's base-vs-tuned table from its summary: ``test_before`` (the initial policy on the test
    pairs: the reference where the policy starts as it, rewards 0) against ``test`` (after training)."""
    p = Path(summary_path)
    try:
        s = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CompareError(f"{p}: not a snakellm finetune summary: {e}") from None
    if s.get("method") != "dpo":
        raise CompareError(f"{p}: method {s.get('method')!r}, not dpo (compare its evaluations: --base, --tuned)")
    before, after = s.get("test_before"), s.get("test")
    if not isinstance(before, dict) or not isinstance(after, dict):
        raise CompareError(f"{p}: no held-out test pairs evaluated (test and test_before; an empty test split?)")
    rows = []
    for metric, higher in PREFERENCE_METRICS:
        if metric not in before or metric not in after:
            raise CompareError(f"{p}: {metric} missing from test_before or test")
        b, t = float(before[metric]), float(after[metric])
        rows.append({"metric": metric, "base": b, "tuned": t, "difference": t - b, "higher_is_better": higher})
    return {
        "finetune": name,
        "base": "the initial policy (before the first step)",
        "tuned": str(p.parent),
        "examples": after["pairs"],
        "dpo": s.get("dpo"),
        "reference_logps/chosen": after.get("reference_logps/chosen"),
        "metrics": rows,
    }


def markdown(c: dict[str, Any]) -> str:
    """The table as Markdown (numbers to 4 places; the difference signed)."""
    unit = "test pairs" if "dpo" in c else "test examples"
    title = f"Base vs tuned{': ' + c['finetune'] if c['finetune'] else ''} ({c['examples']} {unit})"
    lines = [f"# {title}", "", "| metric | base | tuned | difference |", "|---|---:|---:|---:|"]
    lines += [f"| {r['metric']} | {r['base']:.4f} | {r['tuned']:.4f} | {r['difference']:+.4f} |" for r in c["metrics"]]
    if "newly_exact" in c:
        lines += [
            "",
            f"Exact after tuning, not before: {c['newly_exact']}; exact before, not after: {c['no_longer_exact']}.",
        ]
    else:
        lines += [
            "",
            "base: the initial policy; reward_accuracy counts a tie half (0.5 where the policy is its reference), "
            "rewards/accuracies (TRL's) only a strictly higher chosen reward.",
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
