"""One source for each setting: the schema, the CLI and the rule derive from the settings dataclasses.

Also the cross-field config checks (snakellm.config.resolve), called directly: milliseconds, no snakemake.
"""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import yaml
from conftest import REPO

from snakellm import cli, errors, models
from snakellm.config import resolve
from snakellm.config.settings import defaults
from snakellm.config.validate import ConfigError
from snakellm.train.cli import build_parser
from snakellm.train.settings import TRAJECTORY_KEYS, ParallelSettings, TrainSettings

SCHEMA = yaml.safe_load((REPO / "config/schema.yaml").read_text())
RUN = SCHEMA["properties"]["runs"]["additionalProperties"]["properties"]


@pytest.mark.parametrize("section, cls", [("train", TrainSettings), ("parallel", ParallelSettings)])
def test_schema_keys_and_defaults_equal_the_dataclass(section, cls):
    props = RUN[section]["properties"]
    assert set(props) == {f.name for f in dataclasses.fields(cls)}
    assert {k: v["default"] for k, v in props.items() if "default" in v} == defaults(cls)
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    assert set(RUN[section].get("required", [])) == required
    for f in dataclasses.fields(cls):
        if f.metadata.get("choices"):
            assert tuple(props[f.name]["enum"]) == f.metadata["choices"], f.name


def test_schema_model_keys_equal_model_settings_and_presets():
    props = RUN["model"]["properties"]
    assert set(props) - {"preset"} == set(models.MODEL_KEYS)
    assert props["preset"]["enum"] == list(models.PRESETS)
    for f in dataclasses.fields(models.ModelSettings):
        if f.metadata.get("choices"):
            assert tuple(props[f.name]["enum"]) == f.metadata["choices"], f.name


def test_cli_defaults_are_the_dataclass_defaults():
    parser = build_parser()
    args = parser.parse_args(
        ["--blend", "b.json", "--run-dir", "r", "--steps", "1", "--micro-batch-size", "1", "--global-batch-size", "1"]
    )
    for cls in (TrainSettings, ParallelSettings):
        for name, default in defaults(cls).items():
            if dataclasses.fields(cls)[[f.name for f in dataclasses.fields(cls)].index(name)].metadata["cli"]:
                assert getattr(args, name) == default, name
    assert args.on_config_change == "archive"  # schema and CLI agree (they once did not)


def test_trajectory_keys_are_the_settings_marked_so():
    assert "global_batch_size" in TRAJECTORY_KEYS and "lr" in TRAJECTORY_KEYS and "seed" in TRAJECTORY_KEYS
    assert not {"save_interval", "keep_last", "max_time", "log_interval", "eval_iters"} & set(TRAJECTORY_KEYS)


def _config(**run):
    base = {
        "tokenizer": "gpt2",
        "model": {"preset": "tiny"},
        "parallel": {"tp": 1, "pp": 1},
        "train": {"steps": 3, "micro_batch_size": 2, "global_batch_size": 4},
    }
    base.update(run)
    return {"sources": {}, "tokenizers": {"gpt2": {"kind": "gpt2-bpe"}}, "tokenize": {}, "runs": {"r": base}}


def test_resolve_runs_expands_presets_and_the_flags_parse_back():
    cfg = _config()
    arch = resolve.resolve_runs(cfg)["r"]
    assert arch["num_layers"] == 2 and arch["num_query_groups"] == 4
    flags = resolve.train_flags(cfg["runs"]["r"], arch)
    args = build_parser().parse_args(["--blend", "b", "--run-dir", "r", *shlex.split(flags)])
    assert args.steps == 3 and args.hidden_size == 64 and args.tie_embeddings is True and args.tp == 1
    assert args.sequence_parallel is False and args.distributed_optimizer is False
    cfg["runs"]["r"]["parallel"] = {"tp": 2, "sequence_parallel": True, "distributed_optimizer": True}
    flags = resolve.train_flags(cfg["runs"]["r"], resolve.resolve_runs(cfg)["r"])
    assert "--sequence-parallel" in flags and "--distributed-optimizer" in flags
    args = build_parser().parse_args(["--blend", "b", "--run-dir", "r", *shlex.split(flags)])
    assert args.sequence_parallel is True and args.distributed_optimizer is True and args.tp == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer": "nope"}, "config key runs.r.tokenizer: unknown tokenizer 'nope'"),
        ({"model": {"preset": "tiny", "hidden_size": 66}}, "config key runs.r.model: hidden_size 66 is not divisible"),
        (
            {"parallel": {"tp": 3, "pp": 1}},
            "config key runs.r.model: model num_attention_heads 4 is not divisible by tensor parallel size 3",
        ),
        (
            {"parallel": {"sequence_parallel": True}},
            "config key runs.r.parallel.sequence_parallel: sequence parallelism splits the sequence over the "
            "tensor-parallel ranks: it needs tp > 1",
        ),
    ],
)
def test_cross_field_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve.resolve_runs(_config(**change))


def test_tokenizer_checks_name_the_key():
    cfg = _config()
    cfg["tokenize"] = {"tokenizers": ["gpt2", "spm"]}
    with pytest.raises(ConfigError, match="config key tokenize.tokenizers: unknown tokenizer 'spm'"):
        resolve.check_tokenizers(cfg)
    cfg = _config()
    cfg["tokenizers"]["gpt2"]["train"] = {}
    with pytest.raises(ConfigError, match="only a sentencepiece tokenizer without model_file is trained"):
        resolve.check_tokenizers(cfg)


@pytest.mark.parametrize(
    "error, status",
    [
        (errors.UsageError("bad flag --x"), 2),
        (ConfigError("config key a.b: unknown key 'c'"), 2),
        (errors.StepFailed("shard 3 failed"), 1),
        (errors.DataError("data.jsonl line 4: not json"), 1),
        (errors.StopToResume("time limit: checkpoint at step 7"), 75),
    ],
)
def test_cli_maps_an_error_to_its_exit_status_and_one_line(error, status, capsys):
    def step(argv):
        raise error

    assert cli.run_step("snakellm x", step, []) == status
    err = capsys.readouterr().err
    assert err == f"snakellm x: error: {error}\n"
