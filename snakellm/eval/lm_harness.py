"""lm-evaluation-harness on a Hugging Face export or a ``snakellm serve`` endpoint, local data only.

The harness runs as its own CLI would (``lm_eval.simple_evaluate`` with a ``TaskManager`` whose
``include_path`` holds the task YAMLs), and its own result (``results``, ``configs``, ``n-shot``,
``n-samples``, per-document ``samples``) is what is written, plus a ``snakellm`` block naming the
model, the suite and the offline settings. Every data set is read from local files: the Hugging Face
offline switches are set before ``datasets`` is imported, so a task that would download fails at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from snakellm.errors import StepFailed, UsageError
from snakellm.io.atomic import write_text
from snakellm.io.log import log

# set in the process before lm-eval (and datasets, transformers, huggingface_hub) is imported
OFFLINE_ENV = {
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


NOT_METRICS = ("alias", "name", "sample_len")  # keys of lm-eval's per-task results that are no scores


class LmEvalError(StepFailed):
    """lm-eval could not load a task or the model, or failed while evaluating."""


@dataclass(frozen=True)
class HarnessRequest:
    """One suite on one model: what ``lm_eval.simple_evaluate`` is given."""

    model_dir: str  # the Hugging Face directory (weights for `hf`; the tokenizer for `local-completions`)
    tasks: list[str]
    include_path: list[str]
    num_fewshot: int | None
    limit: int | None
    batch_size: int
    bootstrap_iters: int
    seed: int
    device: str = "cpu"
    base_url: str | None = None  # a `snakellm serve` /v1/completions URL: lm-eval's local-completions model
    served_name: str | None = None  # the model name the server answers to
    max_length: int | None = None


def go_offline() -> dict[str, str]:
    """Set the offline switches in this process (and its children); what was set."""
    os.environ.update(OFFLINE_ENV)
    return dict(OFFLINE_ENV)


def _model(req: HarnessRequest) -> tuple[str, dict[str, Any]]:
    """lm-eval's model name and model_args: `hf` on the export, or `local-completions` on a server."""
    if req.base_url:
        args: dict[str, Any] = {
            "model": req.served_name or Path(req.model_dir).name,
            "base_url": req.base_url,
            "tokenizer_backend": "huggingface",
            "tokenizer": req.model_dir,
            "max_retries": 1,
            "num_concurrent": 1,
        }
        if req.max_length:
            args["max_length"] = req.max_length
        return "local-completions", args
    args = {"pretrained": req.model_dir, "dtype": "float32" if req.device == "cpu" else "auto", "device": req.device}
    if req.max_length:
        args["max_length"] = req.max_length
    return "hf", args


def _check_tasks(task_manager: Any, tasks: list[str]) -> None:
    """Every task name must be one lm-eval knows (its own or under include_path): named in the error if not."""
    known = set(task_manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise UsageError(
            f"lm-eval knows no task {', '.join(map(repr, missing))} (its own tasks and the include_path "
            f"directories {task_manager.include_path!r})"
        )


def _task_manager(cls: Any, req: HarnessRequest) -> Any:
    """lm-eval's TaskManager; its own ~thousands of task YAMLs are indexed only when a task is not found in
    include_path (indexing them takes seconds)."""
    if req.include_path:
        tm = cls(include_path=list(req.include_path), include_defaults=False)
        if set(req.tasks) <= set(tm.all_tasks):
            return tm
    tm = cls(include_path=list(req.include_path) or None)
    _check_tasks(tm, req.tasks)
    return tm


def _git_hash() -> str | None:
    """The working directory's commit, which lm-eval records: its own ``git describe`` prints
    "fatal: not a git repository" on stderr outside one; this one keeps git's stderr."""
    import subprocess

    try:
        proc = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return proc.stdout.strip() or None


def run_harness(req: HarnessRequest) -> dict[str, Any]:
    """Evaluate; lm-eval's own result dict (with samples) plus the ``snakellm`` block."""
    env = go_offline()
    if req.base_url:
        os.environ.setdefault("OPENAI_API_KEY", "unused")  # lm-eval's API models want one; the server takes none
    t0 = time.time()
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    lm_eval.evaluator.get_git_commit_hash = _git_hash
    for p in req.include_path:
        if not Path(p).is_dir():
            raise UsageError(f"{p}: include_path is not a directory of lm-eval task YAMLs")
    tm = _task_manager(TaskManager, req)
    model, model_args = _model(req)
    log(f"lm-eval {lm_eval.__version__}: {model} on {req.model_dir}, tasks {','.join(req.tasks)} (limit {req.limit})")
    try:
        # lm-eval prints progress notes ("bootstrapping for stddev: perplexity") to stdout: they go to the
        # step's stderr (the job's log) with the rest of lm-eval's logging, so the terminal shows our lines only
        with contextlib.redirect_stdout(sys.stderr):
            out = _simple_evaluate(lm_eval, req, model, model_args, tm)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise LmEvalError(f"lm-eval failed on {req.model_dir}: {type(e).__name__}: {e}") from e
    if out is None:
        raise LmEvalError("lm-eval returned no results (a non-zero rank?)")
    out["snakellm"] = {**asdict(req), "offline_env": env, "seconds": round(time.time() - t0, 2)}
    return out


def _simple_evaluate(lm_eval: Any, req: HarnessRequest, model: str, model_args: Any, tm: Any) -> Any:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(req.tasks),
        num_fewshot=req.num_fewshot,
        limit=req.limit,
        batch_size=req.batch_size,
        bootstrap_iters=req.bootstrap_iters,
        log_samples=True,
        task_manager=tm,
        random_seed=req.seed,
        numpy_random_seed=req.seed,
        torch_random_seed=req.seed,
        fewshot_random_seed=req.seed,
    )


def write_results(path: str, result: dict[str, Any]) -> None:
    """The result as JSON (numpy values as numbers, anything else lm-eval keeps as text), atomically."""
    from lm_eval.utils import handle_non_serializable

    write_text(path, json.dumps(result, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str, float, int]]:
    """(task, metric, value, samples) for every scored metric (stderr entries left out), in task order."""
    rows = []
    for task, metrics in result.get("results", {}).items():
        n = result.get("n-samples", {}).get(task, {}).get("effective", 0)
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric in NOT_METRICS or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            rows.append((task, metric, float(value), int(n)))
    return rows
