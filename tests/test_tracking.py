"""W&B and MLflow tracking (snakellm.tracking): real clients, a real MLflow server, W&B offline files.

Fast: the settings (config -> flags -> the step's settings), what is never sent
(secrets, user-info in URIs), the resume bookkeeping, and the budget against a
server that accepts connections and never answers. Slow: one ``mlflow server``
(sqlite store) on 127.0.0.1 per module; a tracker's records read back through
MLflow's REST API and W&B's offline run files, a resumed tracker continuing
the same runs without logging a step twice, and the default run under
Snakemake with both trackers, then with the server stopped.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Workspace
from tracking_helpers import MlflowServer, wandb_history, wandb_run

from snakellm import tracking
from snakellm.config import flags as flagmod
from snakellm.config.sections import TrackingSettings
from snakellm.steps import train as train_step


def _tracker(tmp_path: Path, settings: TrackingSettings, *, fresh: bool = True, budget: float = 30.0, **kw):
    warnings: list[str] = []
    run = tracking.RunInfo(name="t1", kind="pretrain", dir=tmp_path / "checkpoints", files_dir=tmp_path, **kw)
    run.params = {**run.params, **tracking.code_version()}
    t = tracking.Tracker(settings, run, fresh=fresh, budget_s=budget, warn=warnings.append)
    return t, warnings


@pytest.mark.slow  # ~8 s: one process importing megatron-core
def test_megatron_core_is_imported_without_wandb_and_wandb_still_imports():
    """snakellm._imports: megatron-core's own module-level ``import wandb`` (logging snakellm never asks for) is
    refused, so it runs as without wandb; wandb itself, for snakellm's tracking, imports as usual afterwards."""
    import subprocess
    import sys

    code = (
        "import sys, snakellm, megatron.core.timers as t, megatron.core.inference.contexts.dynamic_context as d\n"
        "assert 'wandb' not in sys.modules and t.wandb is None and d.HAVE_WANDB is False\n"
        "import wandb\n"
        "assert callable(wandb.init) and sys.modules['wandb'] is wandb\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ---------------------------------------------------------------- fast

REQUIRED = [
    "--blend",
    "b.json",
    "--run-dir",
    "runs/t",
    "--steps",
    "3",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
]


def test_config_layers_become_flags_that_parse_back_into_the_settings():
    glob = {"wandb": {"project": "p", "mode": "offline", "tags": ["a"]}, "mlflow": {"tracking_uri": "http://x:1"}}
    run = {"wandb": {"project": "q", "group": "g"}, "mlflow": {"experiment": "e", "tags": {"k": "v"}}}
    words = flagmod.tracking_flags(glob, run).split()
    args = train_step.build_parser().parse_args([*REQUIRED, *words])
    got = tracking.settings_from_args(args)
    assert {k: v for k, v in got.wandb.items() if v is not None} == {
        "project": "q",
        "mode": "offline",
        "group": "g",
        "tags": ["a"],
    }
    assert {k: v for k, v in got.mlflow.items() if v is not None} == {
        "tracking_uri": "http://x:1",
        "experiment": "e",
        "tags": {"k": "v"},
    }
    assert tracking.wandb_on(got) and tracking.mlflow_on(got)
    assert (
        flagmod.tracking_flags(None, {}) == ""
    )  # nothing configured: no flag, and the rule's command line is unchanged
    none = tracking.settings_from_args(train_step.build_parser().parse_args(REQUIRED))
    assert not tracking.configured(none)
    assert tracking.open_tracker(none, tracking.RunInfo(name="x", kind="pretrain", dir=Path("unused"))) is None
    off = TrackingSettings(wandb={"project": "p", "mode": "disabled"}, mlflow={})
    assert not tracking.configured(off)


def test_the_config_has_no_place_for_credentials():
    from snakellm.config import validate as cfgmod

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    schema = cfgmod.load_schema(REPO / "config" / "schema.yaml")
    cfg["runs"]["tiny"]["tracking"] = {"wandb": {"project": "p", "mode": "offline"}, "mlflow": {"experiment": "e"}}
    cfgmod.validate(cfg, schema)
    for backend, key in (("wandb", "api_key"), ("mlflow", "token")):
        bad = {**cfg, "tracking": {backend: {key: "s3cret"}}}
        with pytest.raises(cfgmod.ConfigError, match=f"tracking.{backend}: unknown key '{key}'"):
            cfgmod.validate(bad, schema)


def test_secrets_are_never_parameters_and_uris_are_shown_without_user_info():
    params = tracking.flatten({"lr": 0.1, "wandb_api_key": "k", "x": {"token": "t", "password": "p", "n": 2}})
    assert params == {"lr": 0.1, "x.n": 2}
    assert tracking.show_uri("https://alice:s3cret@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert tracking.show_uri("request to https://a:b@h/x failed: e@mail") == "request to https://h/x failed: e@mail"
    tags = tracking.slurm_tags({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-04]"})
    assert tags == {"slurm_job_id": "42", "slurm_nodelist": "gpu[01-04]"}
    assert tracking.slurm_tags({}) == {}


def test_resumed_steps_are_not_logged_twice(tmp_path):
    """A resumed job repeats the steps after its checkpoint: the tracker skips what it logged before."""
    settings = TrackingSettings(wandb={}, mlflow={})  # no back end: only the bookkeeping runs
    t, _ = _tracker(tmp_path, settings)
    assert t._new([{"step": 1, "loss": 2.0, "mfu": None}, {"step": 2, "loss": 1.5}]) == [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": 1.5},
    ]
    assert t._new([{"step": 2, "val_loss": 1.4}]) == [{"step": 2, "val_loss": 1.4}]  # a new key at the same step
    assert t._new([{"step": 2, "loss": 9.0}, {"step": 3, "loss": 1.2}]) == [{"step": 3, "loss": 1.2}]
    t.close()
    again, _ = _tracker(tmp_path, settings, fresh=False)  # the state file carried the steps over
    assert again._new([{"step": 3, "loss": 1.0}, {"step": 4, "loss": 0.9}]) == [{"step": 4, "loss": 0.9}]
    again.close()
    fresh, _ = _tracker(tmp_path, settings, fresh=True)  # a fresh start (no checkpoint) starts over
    assert fresh._new([{"step": 1, "loss": 2.0}]) == [{"step": 1, "loss": 2.0}]
    fresh.close()


@pytest.mark.slow  # ~2 s waiting for the budget: the slow tier (fast-tier budget)
def test_a_server_that_never_answers_costs_the_budget_and_one_warning(tmp_path):
    """The job puts records on a queue and waits at most the budget when it closes; one warning says so."""
    with socket.socket() as hole:  # accepts connections (the backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        uri = f"http://127.0.0.1:{hole.getsockname()[1]}"
        t, warnings = _tracker(tmp_path, TrackingSettings(wandb={}, mlflow={"tracking_uri": uri}), budget=2.0)
        t0 = time.time()
        for step in range(1, 1001):
            t.log([{"step": step, "loss": 1.0 / step}])
        t.summary({"final_loss": 0.5})
        # the job never waits for a tracker while it trains: 1,000 records cost far less than the 2 s budget
        # (a bound with room for CI's other worker and the tracker thread's imports, which share the GIL)
        assert time.time() - t0 < 1.0
        t.close()
        assert time.time() - t0 < 6.0  # the budget, then the job goes on
    assert len(warnings) == 1 and "gave up" in warnings[0] and "metrics.jsonl is the record" in warnings[0]


def test_track_data_sums_each_stage_per_source_and_names_a_bad_file(tmp_path):
    from snakellm.errors import UsageError
    from snakellm.steps import track_data

    files = {
        "a0.stats.json": {
            "source": "a",
            "lines_read": 10,
            "documents": 8,
            "rejected": 2,
            "skipped": 0,
            "rejected_by_reason": {"invalid_json": 2},
        },
        "a1.stats.json": {
            "source": "a",
            "lines_read": 5,
            "documents": 5,
            "rejected": 0,
            "skipped": 0,
            "rejected_by_reason": {},
        },
        "b0.stats.json": {
            "source": "b",
            "lines_read": 3,
            "documents": 2,
            "rejected": 1,
            "skipped": 0,
            "rejected_by_reason": {"empty_text": 1},
        },
        "a0.curated.stats.json": {
            "source": "a",
            "documents_in": 8,
            "documents": 6,
            "removed": 2,
            "removed_by_reason": {"exact_duplicate": 1, "near_duplicate": 1},
        },
    }
    for name, obj in files.items():
        (tmp_path / name).write_text(json.dumps(obj))
    paths = [str(tmp_path / n) for n in files]
    out = tmp_path / "out" / "data.json"
    assert track_data.main([*paths, "--state-dir", str(tmp_path / "state"), "--output", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["backends"] == []  # nothing configured: the counts are written, no client is imported
    c = got["counts"]
    assert c["chunk/a/documents"] == 13 and c["chunk/b/documents"] == 2 and c["chunk/documents"] == 15
    assert c["chunk/rejected/invalid_json"] == 2 and c["chunk/b/rejected/empty_text"] == 1 and c["chunk/chunks"] == 3
    assert c["curate/a/documents_in"] == 8 and c["curate/documents"] == 6 and c["curate/removed/near_duplicate"] == 1
    (tmp_path / "bad.stats.json").write_text('{"source": "a"}')
    with pytest.raises(UsageError, match="bad.stats.json: neither"):
        track_data.counts([str(tmp_path / "bad.stats.json")])


# ---------------------------------------------------------------- slow: a real MLflow server, W&B offline


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


@pytest.mark.slow
def test_records_reach_mlflow_and_wandb_and_a_resumed_job_continues_the_same_runs(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    (tmp_path / "wandb-dir").mkdir()
    secrets = {"WANDB_API_KEY": "a" * 32 + "SECRETW", "MLFLOW_TRACKING_TOKEN": "tok-SECRET-M"}
    for k, v in secrets.items():  # credentials come from the environment only, and go nowhere else
        monkeypatch.setenv(k, v)
    settings = TrackingSettings(
        wandb={"project": "snakellm-test", "mode": "offline", "tags": ["unit"]},
        mlflow={"tracking_uri": mlflow_server.uri, "experiment": "unit", "tags": {"team": "llm"}},
    )
    params = {"lr": 0.003, "model": {"num_layers": 2}, "api_key": "never-sent"}
    first, warnings = _tracker(tmp_path, settings, params=dict(params), tags={"slurm_job_id": "42"})
    first.log([{"step": s, "loss": 3.0 - 0.1 * s, "lr": 0.003} for s in range(1, 6)])
    first.log([{"step": 5, "val_loss": 2.6}])
    first.log([{"step": s, "loss": 3.0 - 0.1 * s, "lr": 0.003} for s in range(6, 8)])  # killed after step 7
    first.close("stopped")
    assert warnings == []
    state = json.loads((tmp_path / "checkpoints" / tracking.STATE).read_text())

    # requeued: resumes from the checkpoint at step 5, repeats 6 and 7, goes on to 10
    second, warnings = _tracker(tmp_path, settings, fresh=False, params=dict(params), tags={"slurm_job_id": "42"})
    second.log([{"step": s, "loss": 3.0 - 0.1 * s, "lr": 0.003} for s in range(6, 11)])
    second.log([{"step": 10, "val_loss": 2.1}])
    second.summary({"final_loss": 2.0, "run": "t1", "best": {"val_loss": 2.1}})
    second.close("completed")
    assert warnings == []
    again = json.loads((tmp_path / "checkpoints" / tracking.STATE).read_text())
    assert again["mlflow"]["run_id"] == state["mlflow"]["run_id"] and again["wandb"]["id"] == state["wandb"]["id"]

    (run,) = mlflow_server.runs("unit")
    run_id = run["info"]["run_id"]
    assert run_id == state["mlflow"]["run_id"] and run["info"]["status"] == "FINISHED"
    expected = [(s, pytest.approx(3.0 - 0.1 * s, abs=0, rel=1e-15)) for s in range(1, 11)]
    assert mlflow_server.history(run_id, "loss") == expected  # every step once
    assert mlflow_server.history(run_id, "val_loss") == [(5, 2.6), (10, 2.1)]
    assert mlflow_server.history(run_id, "final_loss") == [(0, 2.0)]
    assert mlflow_server.history(run_id, "best.val_loss") == [(0, 2.1)]
    p = mlflow_server.params(run_id)
    assert p["lr"] == "0.003" and p["model.num_layers"] == "2" and "snakellm_version" in p
    assert not any("api_key" in k for k in p)
    tags = mlflow_server.tags(run_id)
    assert tags["team"] == "llm" and tags["slurm_job_id"] == "42" and tags["snakellm.kind"] == "pretrain"

    wdir = tmp_path / "wandb-dir"
    assert len(list(wdir.glob("wandb/offline-run-*-" + state["wandb"]["id"]))) == 2  # one directory per job
    hist = wandb_history(wdir)
    assert hist["loss"] == [(s, pytest.approx(3.0 - 0.1 * s, rel=1e-15)) for s in range(1, 11)]
    assert hist["val_loss"] == [(5, 2.6), (10, 2.1)]
    config, summary, wtags = wandb_run(wdir)
    assert config["lr"] == 0.003 and config["model.num_layers"] == 2 and "api_key" not in config
    assert summary["final_loss"] == 2.0
    assert "unit" in wtags and "slurm_job_id=42" in wtags
    assert not (tmp_path / "wandb").exists()  # WANDB_DIR is honoured

    # an evaluation of the run (any metrics dict an evaluation step writes) lands in the same runs' summaries
    assert tracking.log_results(tmp_path, "tuned", {"model": "t1", "squad_f1": 0.625, "by_task": {"a": {"em": 0.5}}})
    assert mlflow_server.history(run_id, "eval/tuned/squad_f1") == [(0, 0.625)]
    assert mlflow_server.history(run_id, "eval/tuned/by_task.a.em") == [(0, 0.5)]
    assert len(mlflow_server.runs("unit")) == 1
    _, summary, _ = wandb_run(wdir)
    assert summary["eval/tuned/squad_f1"] == 0.625 and summary["final_loss"] == 2.0
    assert not tracking.log_results(tmp_path / "untracked", "tuned", {"squad_f1": 1.0})  # nothing to attach to

    for f in tmp_path.rglob("*"):  # no credential in any file the trackers wrote, nor in MLflow's run
        if f.is_file():
            data = f.read_bytes()
            assert not any(v.encode() in data for v in secrets.values()), f
    assert not any(v in json.dumps(mlflow_server.get("runs/get", run_id=run_id)) for v in secrets.values())


def _default_run_config(ws: Workspace, tracking_cfg: dict, **train: int) -> None:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["tracking"] = tracking_cfg
    cfg["runs"]["tiny"]["train"].update(train)
    ws.write_config(cfg)


# the run without its server: the default run's settings but 40 steps (what it checks holds at any length;
# its 300 steps cost ~150 s of CPU more)
SHORT = {"steps": 40, "warmup_steps": 5, "save_interval": 20, "eval_interval": 20}


@pytest.fixture(scope="module")
def default_run_data(tmp_path_factory):
    """The embedded default config's data for its `tiny` run (chunks, curation, spm2k, blend), built once."""
    root = tmp_path_factory.mktemp("tracked-default")
    shutil.copytree(REPO / "resources", root / "resources")
    ws = Workspace(root)
    _default_run_config(ws, {})
    ws.run("data/tokens/spm2k/blend.json", timeout=900)
    return ws


@pytest.fixture(scope="module")
def tracked_default_run(default_run_data, mlflow_server):
    """The default `tiny` run (300 steps) and the data run, tracked in MLflow and W&B offline: a shared
    fixture (a training run of its own, which CI's other worker slows past one test's budget)."""
    ws = default_run_data
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(ws.root / "wandb-files"))
        (ws.root / "wandb-files").mkdir(exist_ok=True)
        _default_run_config(ws, _tracked(mlflow_server.uri))
        ws.run("runs/tiny/train_summary.json", "results/tracking/data.json")
    return ws


@pytest.fixture(scope="module")
def run_without_its_server(tracked_default_run, mlflow_server):
    """The same run again from scratch (40 steps: ``SHORT``) with the MLflow server stopped (after the tests that
    read it)."""
    ws = tracked_default_run
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(ws.root / "wandb-files"))
        _default_run_config(ws, _tracked(mlflow_server.uri), **SHORT)
        mlflow_server.stop()
        shutil.rmtree(ws.path("runs/tiny"), ignore_errors=True)
        ws.run("runs/tiny/train_summary.json")
    return ws


@pytest.mark.slow
def test_the_default_run_is_tracked_in_mlflow_and_wandb(tracked_default_run, mlflow_server):
    """The bar: the default `tiny` run's per-step loss in MLflow exactly as in metrics.jsonl, its config as
    parameters, a W&B offline run directory under WANDB_DIR; and the data stages' counts as one data run."""
    ws = tracked_default_run
    recs = [json.loads(line) for line in ws.path("runs/tiny/metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in recs if "loss" in r]
    assert len(losses) == 300
    runs = {r["info"]["run_name"]: r["info"]["run_id"] for r in mlflow_server.runs("default-run")}
    assert set(runs) == {"tiny", "data"}
    run_id = runs["tiny"]
    assert mlflow_server.history(run_id, "loss") == losses  # exactly metrics.jsonl's
    assert mlflow_server.history(run_id, "val_loss") == [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    assert mlflow_server.history(run_id, "tokens") == [(r["step"], r["tokens"]) for r in recs if "tokens" in r]
    params = mlflow_server.params(run_id)
    assert params["lr"] == "0.003" and params["steps"] == "300" and params["global_batch_size"] == "16"
    summary = json.loads(ws.path("runs/tiny/train_summary.json").read_text())
    assert params["fingerprint"] == summary["fingerprint"]
    assert mlflow_server.history(run_id, "final_loss") == [(0, summary["final_loss"])]
    offline = list((ws.root / "wandb-files" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2  # the run's and the data run's
    by_id = {d.name.rsplit("-", 1)[1]: d for d in offline}
    state = json.loads(ws.path("runs/tiny/checkpoints/tracking.json").read_text())
    assert wandb_history(by_id[state["wandb"]["id"]])["loss"] == losses
    assert "warning" not in ws.path("logs/pretrain/tiny.log").read_text()

    # the data run: every stage's counts, equal to the stats files'
    chunks = [json.loads(p.read_text()) for p in ws.root.glob("data/jsonl/*/*.stats.json")]
    curated = [json.loads(p.read_text()) for p in ws.root.glob("data/curated/*/*.stats.json")]
    data_id = runs["data"]
    assert mlflow_server.history(data_id, "chunk/documents") == [(0, sum(c["documents"] for c in chunks))]
    assert mlflow_server.history(data_id, "curate/documents") == [(0, sum(c["documents"] for c in curated))]
    removed = sum(c["removed"] for c in curated)
    assert removed > 0 and mlflow_server.history(data_id, "curate/removed") == [(0, removed)]
    reasons: dict[str, int] = {}
    for c in curated:
        for k, v in c["removed_by_reason"].items():
            reasons[k] = reasons.get(k, 0) + v
    for k, v in reasons.items():
        assert mlflow_server.history(data_id, f"curate/removed/{k}") == [(0, v)]


@pytest.mark.slow
def test_the_default_run_completes_when_the_tracking_server_is_gone(run_without_its_server):
    ws = run_without_its_server
    log = ws.path("logs/pretrain/tiny.log").read_text()
    warnings = [line for line in log.splitlines() if "warning: tracking" in line]
    assert len(warnings) == 1 and "mlflow" in warnings[0] and "metrics.jsonl is the record" in warnings[0], log
    recs = [json.loads(line) for line in ws.path("runs/tiny/metrics.jsonl").read_text().splitlines()]
    assert len([r for r in recs if "loss" in r]) == SHORT["steps"]
    assert json.loads(ws.path("runs/tiny/train_summary.json").read_text())["status"] == "completed"


def _tracked(uri: str) -> dict:
    return {
        "mlflow": {"tracking_uri": uri, "experiment": "default-run"},
        "wandb": {"mode": "offline", "project": "snakellm-default"},
    }
