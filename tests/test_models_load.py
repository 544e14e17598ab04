"""`snakellm.models.load`: a trained run comes back with its architecture, tokenizer and weights.

The proof is behavioural: the reloaded model, run over the same validation
micro-batches the trainer used, gives the validation loss the trainer
recorded at that checkpoint (CPU, fp32: equal to float precision).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_venv, run_probe
from test_train import make_blend, train

pytestmark = pytest.mark.slow  # each test trains or reloads a model (megatron-core import ~4 s)

PROBE = r"""
import json, sys
from snakellm import models
from snakellm.train import dataset as datamod
from snakellm.train.pretrain import lm_loss

run_dir, gbs, mbs, eval_iters, split, seed = sys.argv[1], 8, 4, 2, "90,10,0", 1234
m = models.load(run_dir)
blend = datamod.read_blend("data/tokens/synth/blend.json")
_, valid = datamod.build_datasets(blend, seq_length=m.arch["seq_length"], seed=seed, split=split,
                                  train_samples=m.iteration * gbs, valid_samples=eval_iters * gbs,
                                  cache_dir=f"{run_dir}/data_cache")
import torch
with torch.no_grad():
    losses = [lm_loss(m.model, b).item()
              for b in datamod.micro_batches(valid, 0, eval_iters, gbs=gbs, mbs=mbs, dp_rank=0, dp_size=1, num_workers=0)]
again = models.load(f"{run_dir}/checkpoints/iter_{m.iteration:07d}")
same = all(torch.equal(a, b) for a, b in zip(m.model.state_dict().values(), again.model.state_dict().values())
           if isinstance(a, torch.Tensor))
print(json.dumps({"iteration": m.iteration, "arch": m.arch, "vocab": m.padded_vocab_size, "tokenizer": m.tokenizer,
                  "val_loss": sum(losses) / len(losses), "same_weights": same, "training": m.model.training}))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("load")
    make_blend(root)
    train(root, "r", "--steps", "6", "--save-interval", "6", "--eval-interval", "3")
    return root


def test_a_trained_run_reloads_with_the_recorded_validation_loss(trained):
    got = run_probe([sys.executable, "-c", PROBE, "runs/r"], trained)
    summary = json.loads((trained / "runs/r/train_summary.json").read_text())
    assert got["iteration"] == 6 and got["arch"] == summary["model"] and got["vocab"] == summary["padded_vocab_size"]
    assert got["tokenizer"] == {"name": "synth", "kind": "synthetic", "vocab_size": 256, "eod_id": 0}
    assert got["val_loss"] == pytest.approx(summary["final_val_loss"], abs=1e-6)
    assert got["same_weights"] and got["training"] is False


def test_load_errors_name_what_is_missing(trained, tmp_path):
    from snakellm.models.loading import LoadError, describe_run

    with pytest.raises(LoadError, match="no such run or checkpoint directory"):
        describe_run(tmp_path / "nope")
    with pytest.raises(LoadError, match="no complete checkpoint for iteration 5"):
        describe_run(trained / "runs/r", iteration=5)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(LoadError, match="no checkpoint saved yet"):
        describe_run(tmp_path)
    info = describe_run(trained / "runs/r/checkpoints")  # torch-free
    assert info["iteration"] == 6 and info["arch"]["num_layers"] == 2


def test_describe_run_does_not_import_torch(trained):
    probe = (
        "import sys; from snakellm.models.loading import describe_run; describe_run(sys.argv[1]); "
        "print('torch' in sys.modules, 'megatron' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(trained / "runs/r")],
        capture_output=True,
        text=True,
        env=env_with_venv(),
        check=True,
    ).stdout.split()
    assert out == ["False", "False"]
