"""Experiment tracking: Weights & Biases and MLflow runs fed by the one metrics writer.

:class:`snakellm.train.metrics.MetricsLogger` (pretraining and every fine-tune),
the evaluation steps and the data report hand their records to a
:class:`Tracker`; nothing else calls a tracker. The tracker never stands in the
way of the job it records:

* every client call (``wandb.init``, MLflow's REST requests) runs on one
  background thread; the job only puts records on a queue;
* the job waits for that thread only when it closes the tracker, for what is
  left of :data:`BUDGET_S` (30 s over the whole job), then goes on without it;
* a backend that fails (unreachable server, bad key, full disk) is dropped
  after one warning on stderr; ``metrics.jsonl`` stays the record.

Resume: the run ids live in ``tracking.json`` beside the checkpoints, so a
requeued or resumed job continues the same W&B run (``resume="allow"``) and
the same MLflow run; the last step logged of each key is kept there too, so the
steps a resumed job repeats (those after its checkpoint) are not logged twice.

Credentials come only from the environment (``WANDB_API_KEY``,
``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` ...), read
by the clients themselves; they are never parameters, tags or log text, and a
URI is shown without its user-info part. The clients (``pip install -e
.[tracking]``) are imported only when a backend is configured.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import string
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snakellm.config.flags import tracked
from snakellm.config.sections import MlflowSettings, TrackingSettings, WandbSettings
from snakellm.config.settings import from_namespace

BUDGET_S = 30.0  # the most a job waits for its trackers, over the whole job
STATE = "tracking.json"  # run ids and the last logged step of each key, beside the checkpoints
# MLflow's client retries a failed request 7 times with exponential backoff (minutes); a tracker gives up sooner
_MLFLOW_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
# config keys whose values are never sent anywhere (a secret passed as a flag by mistake)
_SECRET = re.compile(r"(api_?key|token|password|secret)", re.I)


def show_uri(uri: str | None) -> str:
    """A tracking URI as it may be printed: ``https://user:pw@host`` -> ``https://host``."""
    return re.sub(r"(//)[^/@\s]*@", r"\1", uri or "")


def settings_from_args(args: Any) -> TrackingSettings:
    """The tracking settings a step was given (its ``--wandb-*`` and ``--mlflow-*`` flags)."""
    return TrackingSettings(
        wandb=vars(from_namespace(WandbSettings, args)), mlflow=vars(from_namespace(MlflowSettings, args))
    )


def add_arguments(parser: Any) -> None:
    """A step's tracking flags (:class:`WandbSettings`, :class:`MlflowSettings`), in their own group."""
    from snakellm.config.settings import add_arguments as add

    group = parser.add_argument_group(
        "tracking (docs/tracking.md; credentials only from WANDB_API_KEY, MLFLOW_TRACKING_TOKEN ...)"
    )
    add(group, WandbSettings)
    add(group, MlflowSettings)


def wandb_on(t: TrackingSettings) -> bool:
    return tracked({"wandb": t.wandb})


def mlflow_on(t: TrackingSettings) -> bool:
    return tracked({"mlflow": t.mlflow})


def configured(t: TrackingSettings | None) -> bool:
    return t is not None and (wandb_on(t) or mlflow_on(t))


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a.b.c`` keys (lists kept as values); secret-looking keys left out."""
    out: dict[str, Any] = {}
    for k, v in (obj or {}).items():
        key = f"{prefix}{k}"
        if _SECRET.search(str(k)):
            continue
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def code_version() -> dict[str, str]:
    """snakellm's version and, in a git checkout, its commit (what the run was trained with)."""
    from snakellm import __version__

    out = {"snakellm_version": __version__}
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            sha = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            if sha:
                out["git_commit"] = sha + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def slurm_tags(env: dict[str, str] | None = None) -> dict[str, str]:
    """The Slurm job id and node list, as tags (empty outside Slurm)."""
    e: Any = os.environ if env is None else env
    tags = {"slurm_job_id": e.get("SLURM_JOB_ID"), "slurm_nodelist": e.get("SLURM_JOB_NODELIST")}
    if e.get("SLURM_ARRAY_TASK_ID"):
        tags["slurm_array_task_id"] = e["SLURM_ARRAY_TASK_ID"]
    return {k: v for k, v in tags.items() if v}


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a flat dict (booleans and non-finite values left out)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if v == v and v not in (float("inf"), float("-inf")):
            out[k] = float(v)
    return out


# ---------------------------------------------------------------- backends (called on the worker thread only)


class _Wandb:
    name = "wandb"

    def __init__(self, s: dict[str, Any], state: dict[str, Any], run: RunInfo, budget: float):
        import wandb

        self.wandb = wandb
        run_id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        state["id"] = run_id
        kw: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            kw["dir"] = str(run.files_dir or run.dir)  # else wandb's own: WANDB_DIR
        self.run = wandb.init(
            project=s["project"],
            entity=s.get("entity"),
            group=s.get("group"),
            tags=[*(s.get("tags") or []), *(f"{k}={v}" for k, v in run.tags.items())] or None,
            mode=s.get("mode"),
            name=run.name,
            job_type=run.kind,
            id=run_id,
            resume="allow",
            config=run.params if not state.get("params_logged") else None,
            settings=wandb.Settings(init_timeout=max(5.0, budget), console="off", silent=True),
            **kw,
        )
        state["params_logged"] = True
        state["dir"] = str(Path(self.run.dir).parent)

    def log(self, recs: list[dict[str, Any]]) -> None:
        for r in recs:
            self.run.log({k: v for k, v in r.items() if k != "step"}, step=r["step"])

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self, status: str) -> None:
        if status == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status in ("completed", "stopped") else 1)


def _mlflow_key(key: str) -> str:
    """A metric or parameter name MLflow accepts (letters, digits, ``_ - . /`` and spaces): lm-eval's ``acc,none``
    becomes ``acc_none``."""
    return re.sub(r"[^\w\-. /]", "_", key)


class _Mlflow:
    name = "mlflow"

    def __init__(self, s: dict[str, Any], state: dict[str, Any], run: RunInfo, budget: float):
        for k, v in _MLFLOW_ENV.items():
            os.environ.setdefault(k, v)
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param, self.RunTag = Metric, Param, RunTag
        self.client = MlflowClient(tracking_uri=s.get("tracking_uri"))
        self.run_id: str = state.get("run_id") or ""
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = s.get("experiment") or "Default"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        tags = {**{k: str(v) for k, v in (s.get("tags") or {}).items()}, **run.tags, "snakellm.kind": run.kind}
        made = self.client.create_run(exp_id, run_name=run.name, tags=tags)
        self.run_id = state["run_id"] = made.info.run_id
        state["experiment_id"] = exp_id
        params = [
            self.Param(_mlflow_key(k)[:250], json.dumps(v, default=str) if not isinstance(v, str) else v)
            for k, v in run.params.items()
        ]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=[p for p in params[i : i + 100]])
        state["params_logged"] = True

    def _metrics(self, items: Iterable[tuple[str, float, int]]) -> None:
        now = int(time.time() * 1000)
        ms = [self.Metric(_mlflow_key(k), v, now, step) for k, v, step in items]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def log(self, recs: list[dict[str, Any]]) -> None:
        self._metrics((k, v, r["step"]) for r in recs for k, v in r.items() if k != "step")

    def summary(self, values: dict[str, float]) -> None:
        self._metrics((k, v, 0) for k, v in values.items())

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"completed": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED"))


BACKENDS: dict[str, tuple[Callable[[TrackingSettings], bool], Any]] = {
    "wandb": (wandb_on, _Wandb),
    "mlflow": (mlflow_on, _Mlflow),
}


# ---------------------------------------------------------------- the tracker


@dataclass
class RunInfo:
    """What a tracker run is: its name, kind (pretrain | finetune | evaluate | data), parameters and tags."""

    name: str
    kind: str
    dir: Path  # where tracking.json goes
    files_dir: Path | None = None  # W&B's files without WANDB_DIR (default: dir)
    params: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class Tracker:
    """Records to W&B and MLflow from one background thread; :meth:`close` waits at most :data:`BUDGET_S`."""

    def __init__(
        self,
        settings: TrackingSettings,
        run: RunInfo,
        *,
        fresh: bool = False,
        budget_s: float = BUDGET_S,
        warn: Callable[[str], None] | None = None,
    ):
        self.settings, self.run, self.budget = settings, run, budget_s
        self.warn = warn or (
            lambda m: print(f"[{time.strftime('%H:%M:%S')}] warning: {m}", file=sys.stderr, flush=True)
        )
        self.state_path = run.dir / STATE
        self.state: dict[str, Any] = {} if fresh else _read_state(self.state_path)
        self.state.setdefault("logged", {})
        self.q: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.backends: list[Any] = []
        self.closed = self.save_warned = False
        run.params = {k: v for k, v in flatten(run.params).items() if v is not None}
        self.thread = threading.Thread(target=self._work, name="snakellm-tracking", daemon=True)
        self.thread.start()

    # the job's side: never blocks (close waits, within the budget)

    def log(self, recs: list[dict[str, Any]]) -> None:
        """Per-step records (``step`` and numeric keys, as in metrics.jsonl)."""
        if recs:
            self.q.put(("log", [dict(r) for r in recs]))

    def summary(self, values: dict[str, Any]) -> None:
        """Summary values of the run (nested dicts flattened, non-numbers left out)."""
        self.q.put(("summary", _numbers(flatten(values))))

    def close(self, status: str = "completed") -> None:
        """Finish the runs (``completed``, ``stopped`` for a clean stop to resume, ``failed``), within the budget."""
        if self.closed:
            return
        self.closed = True
        self.q.put(("close", status))
        self.thread.join(self.budget)
        if self.thread.is_alive():
            self.warn(
                f"tracking: gave up on {', '.join(b.name for b in self.backends) or 'the trackers'} after "
                f"{self.budget:.0f} s; metrics.jsonl is the record"
            )

    # the worker thread

    def _work(self) -> None:
        t0 = time.time()
        for name, (on, cls) in BACKENDS.items():
            if not on(self.settings):
                continue
            sub = self.state.setdefault(name, {})
            sub["settings"] = _storable(name, getattr(self.settings, name))
            try:
                self.backends.append(cls(getattr(self.settings, name), sub, self.run, self.budget - (time.time() - t0)))
            except Exception as e:  # a tracker never stops the job
                self._failed(name, e)
        self._save()
        while True:
            what, payload = self.q.get()
            if what == "log":
                payload = self._new(payload)
                if not payload:
                    continue
            for b in list(self.backends):
                try:
                    if what == "close":
                        b.close(payload)
                    else:
                        getattr(b, what)(payload)
                except Exception as e:
                    self.backends.remove(b)
                    self._failed(b.name, e)
            if what == "log":
                self._save()
            if what == "close":
                self._save()
                return

    def _new(self, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records' numeric values not logged before (a resumed job repeats the steps after its checkpoint)."""
        logged, out = self.state["logged"], []
        for r in recs:
            step = int(r["step"])
            vals = {k: v for k, v in _numbers(r).items() if k != "step" and step > logged.get(k, -1)}
            if vals:
                out.append({"step": step, **vals})
                for k in vals:
                    logged[k] = step
        return out

    def _failed(self, name: str, e: BaseException) -> None:
        where = show_uri(self.settings.mlflow.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI"))
        what = (
            f"mlflow ({where or 'default store'})"
            if name == "mlflow"
            else f"wandb ({self.settings.wandb.get('project')})"
        )
        msg = show_uri(str(e).splitlines()[0][:300]) if str(e) else type(e).__name__
        self.warn(
            f"tracking: {what} failed, left off for the rest of the job ({type(e).__name__}: {msg}); "
            "training goes on, metrics.jsonl is the record"
        )

    def _save(self) -> None:
        try:
            from snakellm.io.atomic import write_json

            self.run.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.state_path, self.state)
        except OSError as e:
            if not self.save_warned:
                self.save_warned = True
                self.warn(f"tracking: {self.state_path} not written ({e}); a resumed job starts new tracker runs")


def _storable(name: str, s: dict[str, Any]) -> dict[str, Any]:
    """A back end's settings as kept in tracking.json (a URI without user-info: no secret lands in a file)."""
    out = {k: v for k, v in s.items() if v is not None}
    if name == "mlflow" and out.get("tracking_uri"):
        out["tracking_uri"] = show_uri(out["tracking_uri"])
    return out


def _read_state(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def open_tracker(settings: TrackingSettings | None, run: RunInfo, *, fresh: bool = False) -> Tracker | None:
    """A :class:`Tracker` when a backend is configured, else None (and no client is imported)."""
    if not configured(settings):
        return None
    assert settings is not None
    run.tags = {**slurm_tags(), **run.tags}
    run.params = {**run.params, **code_version()}
    return Tracker(settings, run, fresh=fresh)


# ---------------------------------------------------------------- evaluation results


def add_results_argument(parser: Any) -> None:
    """``--track-run DIR``: an evaluation step's results go to that training run's tracker runs."""
    parser.add_argument(
        "--track-run",
        default=None,
        metavar="DIR",
        help="the evaluated training run (runs/RUN or runs/RUN/finetune/FT): when its job was tracked "
        "(DIR/checkpoints/tracking.json), these results become summary values of the same W&B and MLflow runs",
    )


def log_results(track_run: str | os.PathLike | None, name: str, results: dict[str, Any]) -> bool:
    """An evaluation's numbers (any metrics dict, nested keys flattened) as ``eval/<name>/<key>`` summary values
    of the runs the training job logged to; the back ends and run ids come from its ``tracking.json``.

    Returns whether a tracker was opened (False: the run was not tracked, nothing to attach to).
    """
    if not track_run:
        return False
    run_dir = Path(track_run)
    state = _read_state(run_dir / "checkpoints" / STATE)
    settings = TrackingSettings(
        wandb=(state.get("wandb") or {}).get("settings", {}), mlflow=(state.get("mlflow") or {}).get("settings", {})
    )
    if not configured(settings):
        return False
    t = open_tracker(
        settings, RunInfo(name=run_dir.name, kind="evaluate", dir=run_dir / "checkpoints", files_dir=run_dir)
    )
    assert t is not None
    t.summary({f"eval/{name}/{k}": v for k, v in flatten(results).items()})
    t.close("completed")
    return True
