"""Evaluation and fine-tuning report pages: lm-eval suites, fine-tune loss curves, base vs tuned.

* lm-eval: ``runs/{run}/lm_eval/{suite}.json`` (lm-eval's own result) -> one table per suite (task,
  metric, value, standard error, documents, shots, per checkpoint where a suite names several models),
  example documents with the model's answers, and a bar chart of the scores that lie in [0, 1].
* fine-tuning: ``metrics.jsonl`` -> training and validation loss; ``finetune_summary.json`` -> the
  settings; the base and tuned ``metrics.json`` -> every metric side by side with its difference; the
  predictions files -> example inputs with both models' answers.

Key names are read loosely so the pages keep working as the files grow: NeMo's names
(``test_exact_string_match``, ``test_loss``; ``inputs``/``preds``/``labels``) and the older ones
(``exact_string_match``, ``answer_only_loss``; ``input``/``pred``/``label``) are both shown.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from . import html as H
from . import plots
from .data import ReportInputError

NOT_METRICS = ("alias", "name", "sample_len")
EXAMPLES = 3  # example documents per task


def read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ReportInputError(f"{path}: not JSON: {e}") from None


def read_jsonl(path: str) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ReportInputError(f"{path}:{n}: not JSON: {e}") from None
    return out


# ---------------------------------------------------------------- lm-eval


def suite_rows(result: dict) -> list[list[Any]]:
    """[task, metric, filter, value, stderr, documents, shots] for each scored metric of an lm-eval result."""
    rows = []
    for task, metrics in result.get("results", {}).items():
        n = result.get("n-samples", {}).get(task, {}).get("effective")
        shots = result.get("n-shot", {}).get(task)
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric in NOT_METRICS or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            err = metrics.get(f"{metric}_stderr,{filt}")
            rows.append([task, metric, filt, float(value), err if isinstance(err, (int, float)) else None, n, shots])
    return rows


def _short(value: Any, limit: int = 300) -> str:
    s = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return s if len(s) <= limit else s[:limit] + f" … ({len(s):,} characters)"


def _examples(result: dict) -> str:
    """The first documents of each task: the prompt lm-eval built, the target and the model's response."""
    parts = []
    for task, samples in result.get("samples", {}).items():
        rows = []
        for s in samples[:EXAMPLES]:
            args = s.get("arguments", {})
            first = next(iter(args.values()), {}) if isinstance(args, dict) else (args[0] if args else {})
            prompt = first.get("arg_0", "") if isinstance(first, dict) else first
            resp = s.get("filtered_resps")
            metrics = {m: s[m] for m in s.get("metrics", []) if m in s}
            rows.append([s.get("doc_id"), _short(prompt), _short(s.get("target")), _short(resp), _short(metrics)])
        if rows:
            parts.append(H.section(f"{task}: examples", H.table(["doc", "prompt", "target", "model", "scores"], rows)))
    return "".join(parts)


def lm_eval_page(run: str, files: list[str]) -> str:
    """One table per suite (and model), then example documents; the values are lm-eval's, unrounded in the JSON."""
    sections = []
    for f in files:
        r = read_json(f)
        meta = r.get("snakellm", {})
        suite = meta.get("suite") or Path(f).stem
        model = meta.get("model_dir") or r.get("config", {}).get("model_args", "")
        note = (
            f"{f}: lm-eval {r.get('lm_eval_version', '?')}, model {r.get('config', {}).get('model', '?')} on "
            f"{model}; limit {meta.get('limit')}, batch size {meta.get('batch_size')}, {meta.get('seconds', '?')} s"
        )
        rows = suite_rows(r)
        table = H.table(["task", "metric", "filter", "value", "± stderr", "documents", "shots"], rows)
        sections.append(H.section(f"suite {suite} ({model})", table, note=note) + _examples(r))
    return H.page(f"{run}: lm-evaluation-harness", *sections, note="lm-eval's own results and per-document samples")


def lm_eval_plot(run: str, files: list[str], path: str) -> None:
    """Bars of every score in [0, 1] (accuracies, exact match), one group per suite; perplexities are in the table."""
    fig, axes = plots.figure(height=3.8)
    ax = axes[0][0]
    labels, values = [], []
    for f in files:
        r = read_json(f)
        suite = r.get("snakellm", {}).get("suite") or Path(f).stem
        for task, metric, _filt, value, *_ in suite_rows(r):
            if metric in ("acc", "acc_norm", "exact_match") or (0.0 <= value <= 1.0 and "perplexity" not in metric):
                labels.append(f"{suite}: {task} {metric}")
                values.append(value)
    if values:
        ax.barh(range(len(values)), values, color=plots.COLORS[0])
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        for i, v in enumerate(values):
            ax.text(min(v + 0.01, 0.9), i, f"{v:.3f}", va="center", fontsize=8)
    else:
        plots.empty_note(ax, "no scores in [0, 1]")
    ax.set_xlabel("score")
    ax.set_title(f"{run}: lm-eval scores", loc="left")
    plots.save(fig, path)


# ---------------------------------------------------------------- fine-tuning

# metric keys that are counts or settings, not scores (shown in the settings table instead)
NOT_SCORES = {"examples", "tokens_to_generate", "context_truncated", "answer_truncated", "tokens_dropped"}


def _numbers(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_SCORES
    }


def comparison_rows(base: dict, tuned: dict) -> list[list[Any]]:
    """[metric, base, tuned, tuned - base] for every number both files hold (NeMo's names or ours)."""
    b, t = _numbers(base), _numbers(tuned)
    return [[k, b[k], t[k], t[k] - b[k]] for k in t if k in b]


def _field(rec: dict, *names: str) -> Any:
    for n in names:
        if n in rec:
            return rec[n]
    return None


def prediction_rows(base: list[dict], tuned: list[dict], n: int = 10) -> list[list[Any]]:
    """[input, gold, base answer, tuned answer] for the first N test examples."""
    rows = []
    for i, t in enumerate(tuned[:n]):
        b = base[i] if i < len(base) else {}
        gold = _field(t, "answers", "label", "labels")
        rows.append([_field(t, "input", "inputs"), gold, _field(b, "pred", "preds"), _field(t, "pred", "preds")])
    return rows


def settings_rows(summary: dict) -> list[tuple[str, Any]]:
    keep = (
        "method",
        "method_config",
        "dpo",
        "base",
        "steps",
        "steps_run",
        "chosen_iteration",
        "best",
        "stopped_early",
        "train_examples",
        "validation_examples",
        "trainable_parameters",
        "total_parameters",
        "first_loss",
        "final_loss",
        "encode",
        "precision",
    )
    return [(k, summary[k]) for k in keep if k in summary]


def _from_comparison(comparison: dict) -> tuple[list[list[Any]], list[str]]:
    """The rows and notes of a comparison.json (snakellm compare-eval): its metrics first, then any other."""
    rows = []
    for r in comparison.get("metrics", []):
        if isinstance(r, dict) and {"metric", "base", "tuned"} <= set(r):
            hib = r.get("higher_is_better")
            better = "" if hib is None else ("higher" if hib else "lower")
            rows.append([r["metric"], r["base"], r["tuned"], r.get("difference", r["tuned"] - r["base"]), better])
    notes = [f"{k.replace('_', ' ')}: {comparison[k]}" for k in ("newly_exact", "no_longer_exact") if k in comparison]
    return rows, notes


PREFERENCE = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def preference_figure(name: str, recs: list[dict]) -> str | None:
    """A DPO fine-tune's preference metrics per step (inline SVG, TRL's names in metrics.jsonl): the reward
    accuracy and margins, and the chosen and rejected rewards. None without ``rewards/*`` records (SFT)."""
    steps = [r for r in recs if isinstance(r.get("rewards/margins"), (int, float)) and "loss" in r]
    if not steps:
        return None
    fig, axes = plots.figure(height=6.0, rows=2, sharex=True)
    a1, a2 = axes[0][0], axes[1][0]
    x = [r["step"] for r in steps]
    a1.plot(x, [r.get("rewards/accuracies") for r in steps], color=plots.COLORS[2], label="reward accuracy")
    a1.set_ylim(-0.05, 1.05)
    a1.set_ylabel("reward accuracy")
    right = a1.twinx()
    right.plot(x, [r["rewards/margins"] for r in steps], color=plots.COLORS[4], label="reward margin")
    right.set_ylabel("reward margin (chosen − rejected)")
    a1.legend(handles=a1.get_lines() + right.get_lines(), fontsize=8, loc="lower right")
    a1.set_title(f"{name}: preference (DPO) per step", loc="left")
    a2.plot(x, [r.get("rewards/chosen") for r in steps], color=plots.COLORS[0], label="chosen reward")
    a2.plot(x, [r.get("rewards/rejected") for r in steps], color=plots.COLORS[3], label="rejected reward")
    a2.axhline(0, color="#57606a", linewidth=0.8)
    a2.set_ylabel("reward (β · log-ratio; SimPO: β · mean log-prob)")
    a2.set_xlabel("step")
    a2.legend(fontsize=8)
    return plots.inline(fig)


def _preference_sections(name: str, summary: dict, recs: list[dict]) -> list[str]:
    """A DPO fine-tune's page in place of base vs tuned: the per-step figure and the held-out test metrics."""
    fig = preference_figure(name, recs)
    out = []
    if fig is not None:
        out.append(
            H.section(
                "Preference metrics (DPO)",
                fig,
                note="From metrics.jsonl's TRL-named records of each training step: rewards/accuracies (the share of "
                "pairs whose chosen reward beats the rejected one), rewards/margins, rewards/chosen, rewards/rejected.",
            )
        )
    test = summary.get("test")
    if isinstance(test, dict):
        out.append(H.section("held-out test pairs", H.key_values(sorted(test.items()))))
    return out


def finetune_page(
    name: str,
    summary: dict,
    base: dict,
    tuned: dict,
    base_preds: list[dict],
    tuned_preds: list[dict],
    comparison: dict | None = None,
    recs: list[dict] | None = None,
) -> str:
    """Base vs tuned (the comparison file's table where there is one, else every number both metrics hold),
    example predictions, settings; a DPO fine-tune (no base-vs-tuned evaluation): its preference metrics."""
    if summary.get("method") == "dpo":
        held_out = []
        if comparison:  # the initial policy against the tuned one on the held-out pairs (compare.preference)
            rows, _ = _from_comparison(comparison)
            table = H.table(["metric", "base (initial policy)", "tuned", "tuned − base", "better"], rows)
            held_out.append(
                H.section(
                    "base vs tuned on the held-out test pairs",
                    table,
                    note=f"{comparison.get('examples', '?')} pairs; reward_accuracy counts a tie half (0.5 where the "
                    "policy is its reference), rewards/accuracies (TRL's) only a strictly higher chosen reward",
                )
            )
        return H.page(
            f"fine-tune {name}",
            *held_out,
            *_preference_sections(name, summary, recs or []),
            H.section("settings and training", H.key_values(settings_rows(summary))),
            note=f"dpo fine-tune of {summary.get('base', '?')}",
        )
    rows, notes = _from_comparison(comparison) if comparison else ([], [])
    shown = {r[0] for r in rows}
    rows += [[*r, ""] for r in comparison_rows(base, tuned) if r[0] not in shown]
    cols = ["metric", "base", "tuned", "tuned − base", "better"]
    cmp = H.table(cols, rows) if rows else "<p>no metric in both files</p>"
    counts = {k: tuned[k] for k in ("examples", "tokens_to_generate") if k in tuned}
    if notes:
        cmp += f'<p class="note">{H.esc("; ".join(notes))}</p>'
    return H.page(
        f"fine-tune {name}",
        H.section("base vs tuned on the test split", cmp, note=", ".join(f"{k} {v}" for k, v in counts.items())),
        H.section(
            "example predictions",
            H.table(["input", "gold", "base", "tuned"], prediction_rows(base_preds, tuned_preds)),
        ),
        H.section("settings and training", H.key_values(settings_rows(summary))),
        note=f"{summary.get('method', '?')} fine-tune of {summary.get('base', '?')}",
    )


def plot_finetune_loss(name: str, recs: list[dict], path: str) -> None:
    """Training loss per step and validation loss at each evaluation (the best marked)."""
    fig, axes = plots.figure(height=3.8)
    ax = axes[0][0]
    tr = [(r["step"], r["loss"]) for r in recs if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in recs if isinstance(r.get("val_loss"), (int, float))]
    if tr:
        ax.plot(*zip(*tr, strict=False), color=plots.COLORS[0], linewidth=1.4, label="training loss")
    if val:
        ax.plot(*zip(*val, strict=False), "o-", color=plots.COLORS[3], label="validation loss")
        best = min(val, key=lambda p: p[1])
        ax.annotate(f"best {best[1]:.3f}", best, textcoords="offset points", xytext=(5, 8), fontsize=8)
    if not tr and not val:
        plots.empty_note(ax, "no loss records")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{name}: fine-tuning loss", loc="left")
    if tr or val:
        ax.legend(fontsize=8)
    plots.save(fig, path)
