"""The resume policy every training job shares: fingerprint the trajectory, then resume, start fresh or refuse.

Torch-free, so ``snakellm train --dry-run`` prints the decision without
starting anything. Pretraining and fine-tuning both fingerprint the settings
that define their trajectory (:func:`fingerprint`); :func:`decide_resume`
compares it with the one stored in ``checkpoints/run_config.json`` and, as the
job's ``resume`` (auto | require | never) and ``on_config_change`` (archive |
error) settings say, resumes from the latest checkpoint, starts fresh, moves
the old checkpoints aside, or refuses with the settings that differ.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from snakellm.errors import UsageError
from snakellm.io import checkpoint as ckpt


class ResumeError(UsageError, ValueError):
    """Checkpoints that this job may not use (``resume: require`` without one, ``on_config_change: error``)."""


class ResumePolicy(Protocol):
    """The three settings the decision reads (``TrainSettings`` and the fine-tune settings both have them)."""

    @property
    def steps(self) -> int: ...

    @property
    def resume(self) -> str: ...

    @property
    def on_config_change(self) -> str: ...


def fingerprint(cfg: dict[str, Any]) -> str:
    """16 hex digits of sha256 over the trajectory settings (sorted JSON)."""
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def diff_settings(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every setting that differs, nested keys dotted."""
    out = []
    for k in sorted(set(old) | set(new)):
        o, n = old.get(k, "<unset>"), new.get(k, "<unset>")
        if isinstance(o, dict) and isinstance(n, dict):
            out += diff_settings(o, n, f"{prefix}{k}.")
        elif o != n:
            out.append(f"{prefix}{k}: {o!r} -> {n!r}")
    return out


def check_required(ckpt_dir: Path, policy: ResumePolicy) -> None:
    """``resume: require`` with nothing to resume from: an error before anything heavy starts."""
    latest = ckpt.latest_iteration(ckpt_dir)  # inconsistent checkpoint directories are errors in every mode
    if policy.resume == "require" and latest is None:
        raise ResumeError(
            f"--resume require: no checkpoint to resume from in {ckpt_dir} "
            f"({'directory missing' if not ckpt_dir.exists() else 'no ' + ckpt.TRACKER})"
        )


def decide_resume(ckpt_dir: Path, policy: ResumePolicy, cfg: dict[str, Any], fp: str) -> tuple[str, int | None, str]:
    """("resume", iteration, why) | ("fresh", None, why) | ("archive", None, why); ResumeError to refuse."""
    latest = ckpt.latest_iteration(ckpt_dir)
    if policy.resume == "never":
        return ("archive" if ckpt.list_iterations(ckpt_dir) else "fresh"), None, "--resume never"
    if latest is None:
        if policy.resume == "require":
            raise ResumeError(f"--resume require: no checkpoint to resume from in {ckpt_dir}")
        # nothing saved yet (a run stopped before its first checkpoint): its run_config.json and
        # live metrics are simply rewritten
        return "fresh", None, "no checkpoint yet"
    stored = ckpt.read_run_config(ckpt_dir)
    problems = []
    if stored is None:
        problems.append(f"{ckpt_dir / ckpt.RUN_CONFIG} is missing, so the checkpoints' settings are unknown")
    elif stored.get("fingerprint") != fp:
        problems += diff_settings(stored.get("config", {}), cfg) or ["settings fingerprint differs"]
    if latest > policy.steps:
        problems.append(f"the latest checkpoint is at iteration {latest}, past --steps {policy.steps}")
    if not problems:
        return "resume", latest, f"latest checkpoint {ckpt.iter_name(latest)}"
    what = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
    if policy.resume == "require" or policy.on_config_change == "error":
        raise ResumeError(
            f"the checkpoints in {ckpt_dir} (latest iteration {latest}) were made with other settings: {what}. "
            "Restore the settings to resume, or start fresh with --on-config-change archive "
            "(config: train.on_config_change: archive), which moves the old checkpoints aside"
        )
    return "archive", None, f"settings changed: {what}"
