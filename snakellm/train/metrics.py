"""Training metrics: per-step loss, learning rate, gradient norm, tokens/s and MFU.

Losses stay on the device until a flush (every ``log_interval`` steps and
before evaluations and saves), so logging costs one host sync per interval, not
per step. Rank 0 appends the records to the checkpoint directory's live file
(``metrics.live.jsonl``, truncated to the checkpoint's step on resume), to
TensorBoard and to the W&B/MLflow tracker if one is configured
(:mod:`snakellm.tracking`: the same records, queued, never waited for); :func:`merge_metrics` turns the live file into the run's
``metrics.jsonl`` at the end. The throughput window excludes evaluation and
checkpoint time (:meth:`MetricsLogger.restart_window`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

# Peak dense bf16 tensor FLOP/s per GPU, for MFU (override with --peak-tflops).
PEAK_TFLOPS = {
    "H100": 989.4,
    "H200": 989.4,
    "H800": 989.4,
    "GH200": 989.4,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
}


def peak_tflops_of(device_name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


class MetricsLogger:
    """Collects (step, lr, loss, grad norm) on the device; writes records at each flush (rank 0)."""

    def __init__(
        self,
        live_path: Path,
        *,
        rank0: bool,
        tokens_per_step: int,
        samples_per_step: int,
        flops_per_token: float,
        peak_tflops: float | None,
        world_size: int,
        dp_group: Any,
        dp_size: int,
        tensorboard_dir: Path | None = None,
        start_step: int = 0,
        router: Any = None,
        tracker: Any = None,
    ):
        self.live_path = live_path
        self.rank0 = rank0
        self.tokens_per_step = tokens_per_step
        self.samples_per_step = samples_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops
        self.world_size = world_size
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.pending: list[tuple[int, float, Any, Any, dict[str, Any] | None]] = []
        self.router = router  # a mixture of experts' RouterStats (snakellm.train.router_stats), or None
        self.pending_router: list[Any] = []
        self.last_losses: list[float] = []
        self.window_t0, self.window_steps = time.time(), 0
        self.tb: Any = None
        self.tracker = tracker if rank0 else None
        if rank0 and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=start_step + 1)

    def record(self, step: int, lr: float, loss: Any, grad_norm: Any, stats: dict[str, Any] | None = None) -> None:
        """A finished optimizer step (loss, norm and the recipe's ``stats`` are device tensors: no sync here)."""
        self.pending.append((step, lr, loss, grad_norm, stats))
        if self.router is not None:
            self.pending_router.append(self.router.take())
        self.window_steps += 1

    def restart_window(self) -> None:
        """Start a new throughput window (after evaluation or a checkpoint)."""
        self.window_t0 = time.time()

    def flush(self) -> None:
        """Average the pending losses over data-parallel ranks and write them; FloatingPointError on NaN/inf."""
        if not self.pending:
            return
        import torch

        losses_t = torch.stack([p[2] for p in self.pending])
        norms = torch.stack([p[3] for p in self.pending]).tolist()
        torch.distributed.all_reduce(losses_t, group=self.dp_group)
        losses = (losses_t / self.dp_size).tolist()
        # the recipe's per-step metrics (DPO: rewards/*, logps/*), averaged over the data-parallel ranks too
        keys = sorted(self.pending[0][4] or {})
        extra: list[dict[str, float]] = [{} for _ in self.pending]
        if keys:
            st = torch.stack([torch.stack([(p[4] or {})[k].float() for k in keys]) for p in self.pending])
            torch.distributed.all_reduce(st, group=self.dp_group)
            extra = [dict(zip(keys, row, strict=True)) for row in (st / self.dp_size).tolist()]
        elapsed = max(time.time() - self.window_t0, 1e-9)
        tps = self.window_steps * self.tokens_per_step / elapsed
        mfu = tps * self.flops_per_token / (self.peak * 1e12 * self.world_size) if self.peak else None
        bad = [s for (s, *_), loss in zip(self.pending, losses, strict=True) if not math.isfinite(loss)]
        recs = [
            {
                "step": s,
                "loss": loss,
                "lr": lr,
                "grad_norm": gn,
                "tokens_per_s": tps,
                "mfu": mfu,
                "consumed_samples": s * self.samples_per_step,
                "tokens": s * self.tokens_per_step,
                **more,
            }
            for (s, lr, *_), loss, gn, more in zip(self.pending, losses, norms, extra)
        ]
        routed = [p for p in self.pending_router if p is not None]
        if routed and len(routed) == len(recs):
            from snakellm.train.router_stats import reduce

            for r, moe in zip(recs, reduce(routed, self.dp_group, self.dp_size)):
                r.update(moe)
        self.pending_router = []
        self._write(recs)
        if self.tb is not None:
            for r in recs:
                for k in ("loss", "lr", "grad_norm", *keys):
                    self.tb.add_scalar(f"train/{k}", r[k], r["step"])
                for k in ("moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_dropped_tokens"):
                    if r.get(k) is not None:
                        self.tb.add_scalar(f"router/{k[4:]}", r[k], r["step"])
            self.tb.add_scalar("perf/tokens_per_s", tps, recs[-1]["step"])
            if mfu is not None:
                self.tb.add_scalar("perf/mfu", mfu, recs[-1]["step"])
            self.tb.flush()
        self.last_losses = losses
        self.pending = []
        self.window_t0, self.window_steps = time.time(), 0
        if bad:
            raise FloatingPointError(f"loss is not finite at step {bad[0]}")

    def validation(self, step: int, val_loss: float | None) -> None:
        if val_loss is None:
            return
        if self.tb is not None:
            self.tb.add_scalar("val/loss", val_loss, step)
        self._write([{"step": step, "val_loss": val_loss}])

    def _write(self, recs: list[dict[str, Any]]) -> None:
        if self.rank0:
            with open(self.live_path, "a") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in recs))
            if self.tracker is not None:  # scalars only: a MoE's tokens per expert stay in metrics.jsonl
                self.tracker.log([{k: v for k, v in r.items() if not isinstance(v, list)} for r in recs])

    def summary(self, values: dict[str, Any]) -> None:
        """The run's final summary (train_summary.json, finetune_summary.json) for the tracker."""
        if self.tracker is not None:
            self.tracker.summary(values)

    def finish(self, status: str) -> None:
        """Close the tracker's runs (completed | stopped), waiting at most its budget."""
        if self.tracker is not None:
            self.tracker.close(status)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def merge_metrics(live: Path) -> list[dict[str, Any]]:
    """The live file's records, one per step (validation records merged into their step)."""
    by_step: dict[int, dict[str, Any]] = {}
    if live.is_file():
        for line in live.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]
