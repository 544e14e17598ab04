"""Real tracking back ends for the tests: an MLflow server on 127.0.0.1 (sqlite store) and W&B's run files.

:class:`MlflowServer` starts ``mlflow server`` in its own process group and reads
runs back through MLflow's REST API (``/api/2.0/mlflow/...``), as any client
would. :func:`wandb_records` reads an offline W&B run's ``run-<id>.wandb``: the
framing is the LevelDB log format W&B's transaction log uses (7-byte file header,
32 KiB blocks of CRC + length + type chunks); each record is parsed by wandb's
own protobuf ``wandb_internal_pb2.Record`` (wandb 0.31 dropped its Python
``DataStore``; the Go ``wandb-core`` reads these files for ``wandb sync``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from conftest import BIN, env_with_venv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` with a sqlite store under ``root``; :meth:`stop` ends its process group."""

    def __init__(self, root: Path, timeout: float = 180.0):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        env = env_with_venv()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job-runner process: the tests only log
        self.log = open(root / "mlflow-server.log", "w")
        self.proc = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--default-artifact-root",
                str(root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(root / 'mlflow-server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server not up after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        url = f"{self.uri}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.uri}/api/2.0/mlflow/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        exp = self.get("experiments/get-by-name", experiment_name=experiment)["experiment"]
        return self.post("runs/search", {"experiment_ids": [exp["experiment_id"]]}).get("runs", [])

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of a metric, every logged point, sorted by step."""
        out = self.get("metrics/get-history", run_id=run_id, metric_key=key, max_results=25000).get("metrics", [])
        return sorted((int(m.get("step", 0)), float(m["value"])) for m in out)

    def params(self, run_id: str) -> dict[str, str]:
        return {p["key"]: p["value"] for p in self.get("runs/get", run_id=run_id)["run"]["data"].get("params", [])}

    def tags(self, run_id: str) -> dict[str, str]:
        return {t["key"]: t["value"] for t in self.get("runs/get", run_id=run_id)["run"]["data"].get("tags", [])}


def wandb_records(path: Path) -> list[Any]:
    """Every record of a W&B transaction log (``run-<id>.wandb``), parsed by wandb's protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        buf += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def wandb_history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] of every history row of the offline run directories under ``run_dir``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(run_dir.glob("**/run-*.wandb")):
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") != "history":
                continue
            step = rec.history.step.num
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    out.setdefault(key, []).append((step, float(json.loads(item.value_json))))
    return {k: sorted(v) for k, v in out.items()}


def wandb_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(config, summary, tags) of the offline run(s) under ``run_dir``: the last value of each key."""
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    tags: list[str] = []
    for f in sorted(run_dir.glob("**/run-*.wandb")):
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                tags = list(rec.run.tags)
                for u in rec.run.config.update:
                    config[u.key or ".".join(u.nested_key)] = json.loads(u.value_json)
            elif kind == "config":
                for u in rec.config.update:
                    config[u.key or ".".join(u.nested_key)] = json.loads(u.value_json)
            elif kind == "summary":
                for u in rec.summary.update:
                    summary[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
    return config, summary, tags
