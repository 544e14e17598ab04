"""Training report: loss, validation loss, learning rate, grad norm, tokens/s and
MFU against steps and tokens, from ``runs/{run}/metrics.jsonl``; the run's
settings, final figures and kept checkpoints from ``train_summary.json`` and
the checkpoint directory.

Resumed segments: ``snakellm train`` writes ``{"step": N, "resumed": true}``
into the metrics when it continues from checkpoint N; every plot marks those
steps with a dashed line, so a curve that jumps after a restart is visible as such.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import html as H
from . import plots
from .data import ReportInputError

FIGURES = ("loss", "lr", "grad_norm", "throughput")


def load_metrics(path: str) -> list[dict]:
    recs = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ReportInputError(f"{path}:{lineno}: not a JSON record: {e}") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ReportInputError(f"{path}:{lineno}: a metrics record needs an integer 'step'")
            recs.append(rec)
    return sorted(recs, key=lambda r: r["step"])


def resumes(recs: list[dict]) -> list[int]:
    return [r["step"] for r in recs if r.get("resumed")]


def segments(recs: list[dict]) -> list[tuple[int, int]]:
    """(first step, last step) of each training session, split at the resume markers."""
    steps = [r["step"] for r in recs if "loss" in r]
    if not steps:
        return []
    cuts = sorted(set(resumes(recs)))
    out, start = [], steps[0]
    for c in cuts:
        if start <= c < steps[-1]:
            out.append((start, c))
            start = c + 1
    out.append((start, steps[-1]))
    return out


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _mark_resumes(ax, recs: list[dict]) -> None:
    for i, s in enumerate(resumes(recs)):
        ax.axvline(
            s, color="#6e7781", linestyle="--", linewidth=1, label="resumed from a checkpoint" if i == 0 else None
        )


def _tokens_axis(ax, recs: list[dict]) -> None:
    """A second x axis on top: tokens seen (tokens = step x tokens per step)."""
    with_tokens = [r for r in recs if r.get("tokens") and r["step"]]
    if not with_tokens:
        return
    per_step = with_tokens[-1]["tokens"] / with_tokens[-1]["step"]
    top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
    top.set_xlabel("tokens")
    top.xaxis.set_major_formatter(_si_formatter())


def _si_formatter():
    from matplotlib.ticker import FuncFormatter

    def f(v, _pos):
        for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
            if abs(v) >= div:
                return f"{v / div:g}{unit}"
        return f"{v:g}"

    return FuncFormatter(f)


def plot_loss(run: str, recs: list[dict], path: str) -> None:
    fig, axes = plots.figure(height=4.2)
    ax = axes[0][0]
    tr = [r for r in recs if r.get("loss") is not None]
    val = [r for r in recs if r.get("val_loss") is not None]
    if tr:
        steps, loss = [r["step"] for r in tr], [r["loss"] for r in tr]
        ax.plot(steps, loss, color=plots.COLORS[0], alpha=0.35, linewidth=1, label="training loss")
        ax.plot(
            steps,
            _ema(loss, 2 / (1 + max(2, len(loss) // 30))),
            color=plots.COLORS[0],
            linewidth=1.8,
            label="training loss (smoothed)",
        )
    if val:
        ax.plot(
            [r["step"] for r in val], [r["val_loss"] for r in val], "o-", color=plots.COLORS[3], label="validation loss"
        )
    if not tr and not val:
        plots.empty_note(ax, "no loss records")
    _mark_resumes(ax, recs)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/token)")
    ax.set_title(f"{run}: loss", loc="left")
    _tokens_axis(ax, recs)
    ax.legend(fontsize=8)
    plots.save(fig, path)


def _series(run: str, recs: list[dict], key: str, label: str, title: str, path: str, log: bool = False) -> None:
    fig, axes = plots.figure(height=3.6)
    ax = axes[0][0]
    pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
    if pts:
        ax.plot(
            *zip(*pts, strict=False),
            color=plots.COLORS[2] if key == "lr" else plots.COLORS[4],
            linewidth=1.4,
            label=label,
        )
        if log:
            ax.set_yscale("log")
    else:
        plots.empty_note(ax, f"no {key} records")
    _mark_resumes(ax, recs)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.set_title(f"{run}: {title}", loc="left")
    _tokens_axis(ax, recs)
    if resumes(recs):
        ax.legend(fontsize=8)
    plots.save(fig, path)


def plot_throughput(run: str, recs: list[dict], path: str) -> None:
    fig, axes = plots.figure(height=5.0, rows=2, sharex=True)
    a1, a2 = axes[0][0], axes[1][0]
    # tokens_per_s and mfu are per logging window: one point per window (its last step)
    windows: dict[tuple[float, float], dict] = {}
    for r in recs:
        if r.get("tokens_per_s") is not None:
            windows[(r["tokens_per_s"], r.get("mfu") or 0.0)] = r
    pts = sorted(windows.values(), key=lambda r: r["step"])
    if pts:
        a1.plot([r["step"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", markersize=3, color=plots.COLORS[1])
        a1.yaxis.set_major_formatter(_si_formatter())
        a1.set_ylim(bottom=0)
    else:
        plots.empty_note(a1, "no throughput records")
    a1.set_ylabel("tokens/s (all ranks)")
    a1.set_title(f"{run}: throughput per logging window", loc="left")
    mfu = [r for r in pts if r.get("mfu") is not None]
    if mfu:
        a2.plot([r["step"] for r in mfu], [100 * r["mfu"] for r in mfu], "o-", markersize=3, color=plots.COLORS[5])
        a2.set_ylim(bottom=0)
    else:
        plots.empty_note(a2, "no MFU: the device's peak FLOP/s is unknown (CPU)")
        a2.set_yticks([])
    a2.set_ylabel("MFU (%)")
    a2.set_xlabel("step")
    for ax in (a1, a2):
        _mark_resumes(ax, recs)
    plots.save(fig, path)


def checkpoints_kept(ckpt_dir: Path) -> list[dict]:
    if not ckpt_dir.is_dir():
        return []
    best = ckpt_dir / "best.json"
    best_it = json.loads(best.read_text()).get("iteration") if best.is_file() else None
    latest_f = ckpt_dir / "latest_checkpointed_iteration.txt"
    latest = int(latest_f.read_text().strip()) if latest_f.is_file() else None
    out = []
    for d in sorted(ckpt_dir.glob("iter_[0-9]*")):
        if not d.is_dir():
            continue
        it = int(d.name.removeprefix("iter_"))
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        tags = [t for t, on in (("latest", it == latest), ("best validation loss", it == best_it)) if on]
        out.append({"iteration": it, "path": str(d), "size": size, "tags": ", ".join(tags)})
    return out


def router_figure(run: str, recs: list[dict]) -> str | None:
    """A mixture of experts' router health (inline SVG): the load-balancing loss, the busiest expert's load over
    the mean and the dropped tokens per step, and each expert's share of the routed tokens over the run's last
    tenth of steps. None for a dense model (no ``moe_*`` records)."""
    moe = [r for r in recs if r.get("moe_tokens_per_expert")]
    if not moe:
        return None
    fig, axes = plots.figure(height=6.0, rows=2)
    a1, a2 = axes[0][0], axes[1][0]
    steps = [r["step"] for r in moe]
    a1.plot(
        steps, [r.get("moe_aux_loss") for r in moe], color=plots.COLORS[0], label="load-balancing loss (1: balanced)"
    )
    a1.plot(steps, [r.get("moe_max_load") for r in moe], color=plots.COLORS[3], label="busiest expert / mean load")
    if any(r.get("moe_dropped_tokens") for r in moe):
        a1.plot(steps, [r.get("moe_dropped_tokens") for r in moe], color=plots.COLORS[5], label="dropped tokens")
    a1.set_xlabel("step")
    a1.set_title(f"{run}: router health", loc="left")
    a1.legend(fontsize=8)
    _mark_resumes(a1, recs)
    last = moe[-max(1, len(moe) // 10) :]
    totals = [sum(c) for c in zip(*(r["moe_tokens_per_expert"] for r in last), strict=True)]
    share = [100 * t / max(sum(totals), 1) for t in totals]
    a2.bar(range(len(share)), share, color=plots.COLORS[1])
    a2.axhline(100 / len(share), color="#57606a", linestyle="--", linewidth=1, label="balanced")
    a2.set_xlabel(f"expert (steps {last[0]['step']}-{last[-1]['step']}, all layers)")
    a2.set_ylabel("routed tokens (%)")
    a2.legend(fontsize=8)
    return plots.inline(fig)


def summary_page(run: str, recs: list[dict], summary: dict, summary_path: str) -> str:
    tr = [r for r in recs if r.get("loss") is not None]
    model = summary.get("model") or {}
    settings = [
        ("status", summary.get("status")),
        ("iterations", summary.get("iteration")),
        ("parameters", summary.get("params")),
        ("model", ", ".join(f"{k}={v}" for k, v in sorted(model.items()))),
        ("padded vocab size", summary.get("padded_vocab_size")),
        ("precision", summary.get("precision")),
        ("world size (ranks)", summary.get("world_size")),
        ("global batch (sequences)", summary.get("global_batch_size")),
        ("micro batch", summary.get("micro_batch_size")),
        ("sequence length", model.get("seq_length")),
        ("blend", summary.get("blend")),
        ("settings fingerprint", summary.get("fingerprint")),
    ]
    ckpt_dir = Path(summary.get("checkpoint_dir") or Path(summary_path).parent / "checkpoints")
    run_cfg = ckpt_dir / "run_config.json"
    if run_cfg.is_file():
        cfg = json.loads(run_cfg.read_text()).get("config", {})
        keys = (
            "lr",
            "min_lr",
            "warmup_steps",
            "decay_steps",
            "lr_decay_style",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "clip_grad",
            "seed",
            "split",
        )
        settings += [(k.replace("_", " "), cfg.get(k)) for k in keys if k in cfg]
    best = summary.get("best") or {}
    finals = [
        ("first training loss", summary.get("first_loss")),
        ("final training loss (mean of the last 10 steps)", summary.get("final_loss")),
        ("final validation loss", summary.get("final_val_loss")),
        ("best validation loss", f"{best.get('val_loss'):.4f} at iteration {best.get('iteration')}" if best else None),
        ("tokens trained on", summary.get("tokens")),
        ("median tokens/s", summary.get("median_tokens_per_s")),
        ("FLOPs per token", summary.get("flops_per_token")),
        ("wall time of the last session (s)", summary.get("last_session_wall_s")),
        ("steps with metrics", len(tr)),
    ]
    segs = segments(recs)
    seg_rows = [
        [i + 1, a, b, b - a + 1, "fresh start" if i == 0 else f"resumed from iteration {a - 1}"]
        for i, (a, b) in enumerate(segs)
    ]
    ck = checkpoints_kept(ckpt_dir)
    parts = [
        H.section("Final figures", H.key_values(finals)),
        H.section("Settings", H.key_values(settings)),
        H.section(
            "Sessions",
            H.table(["session", "first step", "last step", "steps", "how it started"], seg_rows),
            note="A new session starts where `snakellm train` resumed from a checkpoint (after a stop, a time "
            "limit or a failure); the plots mark these steps with dashed lines.",
        ),
        H.section(
            "Checkpoints kept",
            H.table(
                ["iteration", "path", "size", "tags"],
                [[c["iteration"], c["path"], H.human_bytes(c["size"]), c["tags"]] for c in ck],
            )
            if ck
            else f"<p>No checkpoint in {H.esc(ckpt_dir)}.</p>",
            note="megatron.core.dist_checkpointing directories; train.keep_last and the best one are kept.",
        ),
    ]
    router = router_figure(run, recs)
    if router is not None:
        parts.insert(
            1,
            H.section(
                "Router health (mixture of experts)",
                router,
                note="From metrics.jsonl's moe_* records: megatron-core's load-balancing loss without its "
                "coefficient, the busiest expert's routed tokens over the mean, dropped tokens (0 while dropless), "
                "and each expert's share of the routed tokens.",
            ),
        )
    return H.page(f"Training: {run}", *parts)
