"""The training assembly's shared policies, as fine-tuning sees them (pretraining's: tests/test_train.py).

Fine-tuning takes the resume settings of pretraining (``--resume``, ``--on-config-change``) and the
same torch-free decision (snakellm.train.resume), so a required resume without checkpoints is a usage
error before the base model or the data are read.
"""

from __future__ import annotations

import json

from snakellm.io import checkpoint as ckpt
from snakellm.steps.finetune import build_parser, main
from snakellm.train.resume import ResumeError, decide_resume, fingerprint
from snakellm.train.settings import ResumeSettings, TrainSettings


def test_finetune_takes_the_resume_settings_of_pretraining():
    a = build_parser().parse_args(
        ["--base", "b", "--data-dir", "d", "--out-dir", "o", "--method", "lora", "--steps", "1"]
    )
    assert (a.resume, a.on_config_change) == (ResumeSettings().resume, ResumeSettings().on_config_change)
    assert TrainSettings(steps=1, micro_batch_size=1, global_batch_size=1).resume == a.resume == "auto"


def test_finetune_resume_require_without_checkpoints_is_a_usage_error(tmp_path, capsys):
    argv = ["--base", str(tmp_path / "nothing"), "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "ft")]
    assert main([*argv, "--method", "lora", "--steps", "2", "--resume", "require"]) == 2
    err = capsys.readouterr().err
    assert "--resume require: no checkpoint to resume from" in err and str(tmp_path / "ft" / "checkpoints") in err


class _Policy:
    def __init__(self, resume: str, on_config_change: str, steps: int = 10):
        self.resume, self.on_config_change, self.steps = resume, on_config_change, steps


def test_one_resume_decision_for_every_recipe(tmp_path):
    d = tmp_path / "checkpoints"
    (d / "iter_0000004").mkdir(parents=True)
    for f in ("metadata.json", "common.pt"):
        (d / "iter_0000004" / f).write_text("{}")
    (d / ckpt.TRACKER).write_text("4\n")
    cfg = {"method": "lora", "train": {"lr": 1e-4}}
    ckpt.write_run_config(d, fingerprint(cfg), cfg)
    assert decide_resume(d, _Policy("auto", "archive"), cfg, fingerprint(cfg)) == (
        "resume",
        4,
        "latest checkpoint iter_0000004",
    )
    changed = {"method": "lora", "train": {"lr": 2e-4}}
    action, it, why = decide_resume(d, _Policy("auto", "archive"), changed, fingerprint(changed))
    assert (action, it) == ("archive", None) and "train.lr: 0.0001 -> 0.0002" in why
    try:
        decide_resume(d, _Policy("auto", "error"), changed, fingerprint(changed))
    except ResumeError as e:
        assert "train.lr: 0.0001 -> 0.0002" in str(e) and "--on-config-change archive" in str(e)
    else:
        raise AssertionError("on_config_change error must refuse other settings")
    assert decide_resume(d, _Policy("never", "archive"), cfg, fingerprint(cfg))[0] == "archive"
    assert json.loads((d / ckpt.RUN_CONFIG).read_text())["config"] == cfg
