"""The pretrain rule in real `snakemake` runs: what reruns it and what does not.

A small config (the shipped corpus, GPT-2 BPE, a 2-layer model on 32-token
sequences, 3 steps) is built once; then one edit at a time, checked by the
mtimes of the run's outputs and by what `snakellm train` logged.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO, small_config

pytestmark = pytest.mark.slow

TARGET = "runs/t1/train_summary.json"


def config(root):
    cfg = small_config(root)
    shutil.copytree(REPO / "resources/tokenizers/gpt2", root / "resources/tokenizers/gpt2")
    cfg["tokenizers"] = {
        "gpt2": {
            "kind": "gpt2-bpe",
            "vocab_file": "resources/tokenizers/gpt2/vocab.json",
            "merges_file": "resources/tokenizers/gpt2/merges.txt",
            "vocab_size": 50257,
        },
    }
    cfg["tokenize"] = {"tokenizers": ["gpt2"]}
    cfg["runs"] = {
        "t1": {
            "tokenizer": "gpt2",
            "model": {"preset": "tiny", "seq_length": 32},
            "train": {
                "steps": 3,
                "micro_batch_size": 2,
                "global_batch_size": 2,
                "warmup_steps": 1,
                "save_interval": 3,
                "eval_interval": 3,
                "eval_iters": 1,
                "log_interval": 1,
                "split": "90,10,0",
            },
        }
    }
    return cfg


@pytest.fixture
def trained(workspace):
    workspace.write_config(config(workspace.root))
    workspace.run(TARGET)
    workspace.age()
    return workspace


def log(ws) -> str:
    return ws.path("logs/pretrain/t1.log").read_text()


def dry_run_has_nothing_to_do(ws) -> bool:
    out = ws.run("-n", TARGET)
    return "Nothing to be done" in out.stdout + out.stderr


def test_pretrain_reruns_on_its_own_settings_only(trained):
    ws = trained
    s = json.loads(ws.path(TARGET).read_text())
    assert s["iteration"] == 3 and s["model"]["seq_length"] == 32 and s["blend"] == "data/tokens/gpt2/blend.json"
    assert ws.path("runs/t1/checkpoints/iter_0000003/metadata.json").is_file()
    assert ws.path("runs/t1/checkpoints/latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert ws.path("runs/t1/metrics.jsonl").is_file()
    assert dry_run_has_nothing_to_do(ws)

    # unrelated edits: a download setting, another run: nothing to do for t1
    cfg = ws.read_config()
    cfg["download"] = {"retries": 3, "timeout_s": 5}
    cfg["runs"]["t2"] = json.loads(json.dumps(cfg["runs"]["t1"]))
    cfg["runs"]["t2"]["model"]["num_layers"] = 1
    ws.write_config(cfg)
    before = ws.snapshot("runs", "data")
    assert dry_run_has_nothing_to_do(ws)
    ws.run(TARGET)
    assert ws.changed(before, "runs", "data") == set()

    # an operational setting of t1 (checkpoint interval): the rule reruns, training resumes at the end
    cfg["runs"]["t1"]["train"]["save_interval"] = 2
    ws.write_config(cfg)
    ws.run(TARGET)
    assert "resumed from runs/t1/checkpoints/iter_0000003" in log(ws)
    assert json.loads(ws.path(TARGET).read_text())["iteration"] == 3
    ws.age()

    # t1's model changes: it retrains from scratch, its old checkpoints moved aside, no data rebuilt
    cfg["runs"]["t1"]["model"]["num_layers"] = 1
    ws.write_config(cfg)
    before = ws.snapshot("data")
    ws.run(TARGET)
    assert ws.changed(before, "data") == set()
    assert "checkpoints moved aside" in log(ws) and "model.num_layers: 2 -> 1" in log(ws)
    old = list(ws.path("runs/t1").glob("checkpoints.old-*"))
    assert len(old) == 1 and (old[0] / "iter_0000003").is_dir()
    s = json.loads(ws.path(TARGET).read_text())
    assert s["model"]["num_layers"] == 1 and s["iteration"] == 3
    assert dry_run_has_nothing_to_do(ws)
