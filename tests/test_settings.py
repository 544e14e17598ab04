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
from snakellm.config import checks, resolve, sections, settings, validate
from snakellm.config import flags as flagmod
from snakellm.config.settings import defaults
from snakellm.config.validate import ConfigError
from snakellm.steps.train import build_parser
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
        ({"parallel": {"pp": 3}}, "config key runs.r.parallel: num_layers 2 is not divisible by pp 3 x virtual_pp 1"),
        (
            {"parallel": {"pp": 1, "virtual_pp": 2}},
            "config key runs.r.parallel: virtual_pp 2: virtual pipeline stages need pp > 1",
        ),
        (
            {"parallel": {"pp": 2, "virtual_pp": 2}},
            "config key runs.r.parallel: num_layers 2 is not divisible by pp 2 x virtual_pp 2",
        ),
        (
            {
                "model": {"preset": "tiny", "num_layers": 4},
                "parallel": {"pp": 2, "virtual_pp": 2, "distributed_optimizer": True},
            },
            "config key runs.r.parallel.distributed_optimizer: the distributed optimizer shards one model chunk's",
        ),
        (
            {"parallel": {"overlap_param_gather": True}},
            "config key runs.r.parallel.overlap_param_gather: overlap_param_gather overlaps the distributed "
            "optimizer's all-gather of the updated weights: it needs distributed_optimizer",
        ),
        (
            {"parallel": {"fsdp": True, "distributed_optimizer": True}},
            r"config key runs.r.parallel.fsdp: FSDP already shards the optimizer states \(and the parameters and "
            r"gradients\): drop distributed_optimizer",
        ),
        (
            {"parallel": {"fsdp": True, "pp": 2}},
            r"config key runs.r.parallel.fsdp: FSDP shards over the data-parallel ranks of one pipeline stage: it "
            r"needs pp 1 \(got 2\)",
        ),
        (
            {"parallel": {"pp": 2, "recompute": "full", "recompute_num_layers": 2}},
            r"config key runs.r.parallel: recompute_num_layers 2 \(recompute full, uniform\) must be between 1 and "
            r"the layers of one pipeline stage or chunk \(2 / \(pp 2 x virtual_pp 1\) = 1\)",
        ),
    ],
)
def test_cross_field_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve.resolve_runs(_config(**change))


def test_interleaved_schedule_needs_micro_batches_in_groups_of_pp():
    from snakellm.config import jobs
    from snakellm.models import check_pipeline_batches

    assert check_pipeline_batches(2, 1, 3) is None  # 1F1B takes any number
    assert check_pipeline_batches(4, 2, 8) is None
    why = check_pipeline_batches(4, 2, 6)
    assert why and "virtual_pp 2 (interleaved schedule)" in why and "(6 = global_batch_size" in why
    a = jobs.Allocation("pretrain", "runs.r.resources", 1, 8, None, None, None, 0, None, None, None, None, None, None)
    with pytest.raises(ConfigError, match="config key runs.r.resources: global_batch_size 12: virtual_pp 2"):
        jobs.check_allocation(a, 1, 4, (12, 1), virtual_pp=2)  # dp 2: 6 micro-batches per rank
    jobs.check_allocation(a, 1, 4, (16, 1), virtual_pp=2)


def test_tokenizer_checks_name_the_key():
    cfg = _config()
    cfg["tokenize"] = {"tokenizers": ["gpt2", "spm"]}
    with pytest.raises(ConfigError, match="config key tokenize.tokenizers: unknown tokenizer 'spm'"):
        resolve.check_tokenizers(cfg)
    cfg = _config()
    cfg["tokenizers"]["gpt2"]["train"] = {}
    with pytest.raises(ConfigError, match="only a sentencepiece tokenizer without model_file is trained"):
        resolve.check_tokenizers(cfg)
    # no corpus: fine for a config that only imports and fine-tunes, an error naming the key when a run pretrains
    with pytest.raises(ConfigError, match="config key sources: runs r need a corpus"):
        resolve.check_tokenizers(_config())
    resolve.check_tokenizers({"sources": {}, "tokenizers": {}, "tokenize": {}, "runs": {}})


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


# ---------------------------------------------------------------- every section: schema == dataclass


def _schema_at(where: str) -> dict:
    """The schema of a section, ``*`` standing for any name (local $refs followed)."""

    def deref(node):
        while "$ref" in node:
            node = {**_lookup(node["$ref"]), **{k: v for k, v in node.items() if k != "$ref"}}
        return node

    def _lookup(ref):
        node = SCHEMA
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        return node

    node = SCHEMA
    for part in where.split("."):
        node = deref(node)
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    return deref(node)


def _enum(values):
    return {str(v).lower() for v in values}


@pytest.mark.parametrize("where", list(sections.SECTIONS))
def test_every_schema_section_equals_its_settings_dataclass(where):
    cls, schema = sections.SECTIONS[where], _schema_at(where)
    props = schema["properties"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(props) == set(fields), where
    assert set(schema.get("required", [])) == settings.required(cls), where
    dc_defaults = settings.defaults(cls)
    for name, prop in props.items():
        if "default" in prop:
            assert prop["default"] == dc_defaults[name], f"{where}.{name}"
        else:
            assert dc_defaults.get(name) is None, f"{where}.{name}: the schema has no default"
        choices = fields[name].metadata.get("choices")
        if choices or "enum" in prop:
            assert _enum(prop["enum"]) == _enum(choices), f"{where}.{name}"
        if fields[name].metadata.get("section"):
            assert fields[name].metadata["section"] is sections.SECTIONS.get(f"{where}.{name}", models.ModelSettings)


def _parsers():
    """(step, parser, arguments that make the required ones, settings classes it takes)."""
    from snakellm.steps import (
        chunk,
        download,
        evaluate,
        export_hf,
        export_nemo,
        generate,
        import_hf,
        prepare_sft,
        train_tokenizer,
    )
    from snakellm.steps import finetune as ftcli
    from snakellm.steps import tokenize as encode

    S = sections
    return [
        ("download", download.build_parser(), ["--dest", "d", "--manifest", "m"], [S.DownloadSettings]),
        ("chunk", chunk.build_parser(), ["-o", "o", "--format", "jsonl"], [S.SourceSettings]),
        ("tokenize", encode.build_parser(), ["i", "p", "--kind", "gpt2-bpe"], [S.TokenizerSettings]),
        (
            "train-tokenizer",
            train_tokenizer.build_parser(),
            ["i", "--model", "m", "--vocab-size", "9"],
            [S.TokenizerTrainSettings, S.SampleSettings],
        ),
        ("prepare-sft", prepare_sft.build_parser(), ["s", "o"], [S.SftDataSettings]),
        (
            "finetune",
            ftcli.build_parser(),
            ["--base", "b", "--data-dir", "d", "--out-dir", "o", "--method", "lora", "--steps", "1"],
            [S.FinetuneSettings, S.LoraSettings, S.PtuningSettings, S.ExamplesSettings, S.FinetuneTrainSettings],
        ),
        ("evaluate", evaluate.build_parser(), ["--base", "b", "--test", "t", "--out-dir", "o"], [S.EvaluateSettings]),
        ("export-hf", export_hf.build_parser(), ["c", "o"], [S.ExportHfSettings]),
        ("import-hf", import_hf.build_parser(), ["h", "r"], [S.ImportHfSettings]),
        ("export-nemo", export_nemo.build_parser(), ["c", "o"], [S.ExportNemoSettings]),
        ("generate", generate.build_parser(), ["c"], [S.GenerateSettings]),
        (
            "train",
            build_parser(),
            ["--blend", "b", "--run-dir", "r", "--steps", "1", "--micro-batch-size", "1", "--global-batch-size", "1"],
            [TrainSettings, ParallelSettings],
        ),
    ]


@pytest.mark.parametrize("step, parser, argv, classes", _parsers(), ids=[p[0] for p in _parsers()])
def test_every_step_takes_its_settings_with_the_config_defaults(step, parser, argv, classes):
    args = parser.parse_args(argv)
    help_text = " ".join(parser.format_help().split())
    for cls in classes:
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True) or f.name in settings.required(cls):
                continue
            parsed = settings.from_namespace(
                cls, args, **{g.name: None for g in dataclasses.fields(cls) if not g.metadata.get("cli", True)}
            )
            assert getattr(parsed, f.name) == settings.defaults(cls).get(f.name), f"{step} {f.name}"
            assert settings.option(f) in help_text, f"{step} --help lists {settings.option(f)}"
            default = settings.defaults(cls).get(f.name)
            if default not in (None, [], {}, dataclasses.MISSING) and not isinstance(default, list):
                assert f"(default: {default})" in help_text, f"{step} --help: default of {f.name}"


def test_generate_defaults_are_the_config_ones():
    """They once disagreed: the schema said 48 / 0.8 / 40, `snakellm generate --help` 64 / 1.0 / 0."""
    from snakellm.steps import generate

    args = generate.build_parser().parse_args(["runs/x"])
    g = SCHEMA["properties"]["generate"]["properties"]
    assert (args.max_new_tokens, args.temperature, args.top_k) == (48, 0.8, 40)
    assert (g["max_new_tokens"]["default"], g["temperature"]["default"], g["top_k"]["default"]) == (48, 0.8, 40)


_ANY_FILE = str(REPO / "resources/tokenizers/gpt2/vocab.json")  # a file that exists (what check_paths asks)


def _full_config():
    cfg = _config()
    gpt2 = REPO / "resources/tokenizers/gpt2"
    cfg["tokenizers"]["gpt2"].update(vocab_file=str(gpt2 / "vocab.json"), merges_file=str(gpt2 / "merges.txt"))
    cfg.update(
        sources={
            "s": {
                "kind": "local",
                "path": str(REPO / "resources/corpus/botchan/*.jsonl"),
                "format": "jsonl",
                "shards_per_chunk": 1,
            }
        },
        sft_data={"squad": {"path": str(REPO / "resources/squad/squad-dev-subset.json")}},
        finetune={"ft": {"run": "r", "data": "squad", "method": "lora", "train": {"steps": 2}}},
        import_hf={},
        export_nemo={"enabled": True, "transformer_engine": "auto"},
        export_hf={"enabled": True, "max_shard_size": "5GB", "dtype": "auto"},
        generate={},
    )
    return validate.validate(cfg, SCHEMA)


def test_rule_flags_parse_back_into_the_step_settings():
    """What a rule passes (snakellm.config.flags / to_flags) is what the step reads: every setting round-trips."""
    from snakellm.steps import evaluate, generate
    from snakellm.steps import finetune as ftcli

    cfg = _full_config()
    ft = cfg["finetune"]["ft"]
    ft["lora"].update(targets=["linear_qkv", "linear_fc1"], layers=[1, 2], alpha=16.0)
    ft["examples"]["add_bos"] = True
    a = ftcli.build_parser().parse_args(
        ["--base", "b", "--data-dir", "d", "--out-dir", "o", *shlex.split(flagmod.finetune_flags(ft))]
    )
    assert settings.from_namespace(sections.LoraSettings, a) == sections.LoraSettings(**ft["lora"])
    assert settings.from_namespace(sections.ExamplesSettings, a) == sections.ExamplesSettings(**ft["examples"])
    assert settings.from_namespace(sections.FinetuneTrainSettings, a) == sections.FinetuneTrainSettings(**ft["train"])
    assert a.method == "lora" and a.tp == 1
    assert "--virtual-tokens" not in flagmod.finetune_flags(ft)  # only the chosen method's options
    e = evaluate.build_parser().parse_args(
        ["--base", "b", "--test", "t", "--out-dir", "o", *shlex.split(flagmod.evaluate_flags(ft))]
    )
    assert e.add_bos is True and e.tokens_to_generate == 32 and "packing" not in vars(e)
    g = dict(cfg["generate"], prompts=["a b", "it's"], end_strings=["\n\n"], greedy=True)
    args = generate.build_parser().parse_args(["c", *shlex.split(settings.to_flags(sections.GenerateSettings, g))])
    assert settings.from_namespace(sections.GenerateSettings, args, enabled=True, threads=1) == (
        sections.GenerateSettings(**g)
    )


def test_tokenizer_flags_fill_a_trained_model_file_and_options():
    from snakellm.steps import tokenize as encode
    from snakellm.steps import train_tokenizer

    spec = {
        "kind": "sentencepiece",
        "vocab_size": 2000,
        "train": {"options": {"split_digits": True, "pad_id": 3}, "user_defined_symbols": ["<a>", "<b>"]},
    }
    cfg = _full_config()
    cfg["tokenizers"]["spm"] = spec
    spec = validate.validate(cfg, SCHEMA)["tokenizers"]["spm"]
    a = encode.build_parser().parse_args(["i", "p", *shlex.split(flagmod.tokenizer_flags("spm", spec))])
    assert a.model_file == "tokenizers/spm/tokenizer.model" and a.vocab_size == 2000
    t = train_tokenizer.build_parser().parse_args(
        ["i", "--model", "m", *shlex.split(flagmod.train_tokenizer_flags(spec))]
    )
    train = settings.from_namespace(sections.TokenizerTrainSettings, t, sample={})
    assert train.options == {"pad_id": "3", "split_digits": "true"} and train.user_defined_symbols == ["<a>", "<b>"]
    assert t.vocab_size == 2000 and t.max_bytes == 100_000_000 and train.threads == 2


# ---------------------------------------------------------------- cross-field checks (snakellm.config.checks)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["finetune"]["ft"].update(run="nope"), "config key finetune.ft.run: unknown run 'nope'"),
        (lambda c: c["finetune"]["ft"].update(data="nope"), "config key finetune.ft.data: unknown sft_data 'nope'"),
        (
            lambda c: c["finetune"]["ft"]["train"].update(micro_batch_size=3),
            "config key finetune.ft.train: global_batch_size 8 is not a multiple of micro_batch_size 3",
        ),
        (
            lambda c: c["tokenizers"].update(gpt2={"kind": "huggingface", "tokenizer_file": _ANY_FILE, "eod": "x"}),
            "config key runs.r.tokenizer: a .nemo packs only gpt2-bpe or sentencepiece tokenizers",
        ),
        (
            lambda c: c["runs"]["r"].update(model={"preset": "tiny-qwen3"}),
            "config key runs.r.model: NeMo 1.x cannot represent this qwen3 model: QK-norm",
        ),
        (lambda c: c["import_hf"].update(r={"hf_dir": str(REPO)}), "config key import_hf.r: a run of that name exists"),
        (lambda c: c["import_hf"].update(h={"hf_dir": "/nonexistent"}), "config key import_hf.h.hf_dir: /nonex"),
        (lambda c: c["import_hf"].update(h={"hf_dir": str(REPO)}), "config key import_hf.h.hf_dir: .* no config.json"),
        (
            lambda c: c["runs"]["r"]["model"].update(position_embedding="rope"),
            "config key runs.r.model: Hugging Face export",
        ),
        # bad fine-tuning input, caught before any job
        (lambda c: c["sft_data"]["squad"].update(path="gone.json"), "config key sft_data.squad.path: gone.json: no"),
        (
            lambda c: c["sft_data"]["squad"].update(template="Q: {question} {answer}"),
            r"config key sft_data.squad.template: unknown field \{answer\}",
        ),
        (
            lambda c: c["finetune"]["ft"]["examples"].update(template="{input}"),
            r"config key finetune.ft.examples.template: '\{input\}' must end with \{output\}",
        ),
        (
            lambda c: c["finetune"]["ft"]["examples"].update(template="{input} {answer} {output}"),
            r"config key finetune.ft.examples.template: unknown field \{answer\}",
        ),
        (
            lambda c: c["finetune"]["ft"]["examples"].update(template="{input {output}"),
            "config key finetune.ft.examples.template: template '{input {output}': ",
        ),
        (
            lambda c: c["finetune"]["ft"]["examples"].update(template="{question} {output}"),
            "config key finetune.ft.examples.truncation_field: 'input' is not a prompt field",
        ),
        (lambda c: c["finetune"].update(base=c["finetune"]["ft"]), "config key finetune.base: the name 'base'"),
    ],
)
def test_cross_field_checks_name_the_key(change, message):
    cfg = _full_config()
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        checks.check_config(cfg)


def test_cross_field_checks_pass_a_good_config_and_resolve_its_runs():
    assert checks.check_config(_full_config())["r"]["hidden_size"] == 64
    cfg = _full_config()
    cfg["export_nemo"]["enabled"] = False
    cfg["tokenizers"]["gpt2"] = {"kind": "huggingface", "tokenizer_file": _ANY_FILE, "eod": "x"}
    checks.check_config(cfg)  # no .nemo asked for: any tokenizer kind


# ---------------------------------------------------------------- job resources (snakellm.config.jobs)


def _jobs_config(**resources):
    cfg = _config(resources={"nodes": 2, "gpus_per_node": 4})
    cfg["runs"]["r"]["train"] = {"steps": 3, "micro_batch_size": 2, "global_batch_size": 16}
    cfg["resources"] = resources
    return cfg


def test_job_allocation_takes_each_key_from_the_first_place_that_sets_it():
    from snakellm.config import jobs

    cfg = _jobs_config(pretrain={"gpus_per_node": 2, "time_limit": "1-02:30", "partition": "big"})
    env = {"SNAKELLM_TRAIN_CPUS_PER_GPU": "6", "SNAKELLM_TRAIN_GPUS_PER_NODE": "8", "SNAKELLM_SLURM_ACCOUNT": "proj"}
    a = jobs.allocation(cfg, "pretrain", "r", env)
    # the run's own (nodes, gpus_per_node) > resources.pretrain (time_limit, partition) > site > built-in
    assert (a.nodes, a.gpus_per_node, a.ranks, a.time_limit, a.partition) == (2, 4, 8, 1590, "big")
    assert (a.cpus_per_gpu, a.account, a.signal_s, a.mem_mb) == (6, "proj", 300, 0)
    assert jobs.allocation(cfg, "pretrain", "r", None).cpus_per_gpu is None  # no site defaults off Slurm
    res = jobs.snakemake_resources(a, threads=3)
    assert res == {
        "nodes": 2,
        "cpus_per_task": 6,
        "gpu": 8,
        "tasks": 8,
        "tasks_per_gpu": 1,
        "mpi": "srun",
        "mem_mb": 0,
        "runtime": 1590,
        "slurm_partition": "big",
        "slurm_account": "proj",
        "slurm_extra": "--signal=USR1@300",
    }
    # a one-GPU stage: a plain job (no mpi, no early signal); its CPUs are the job's threads
    ev = jobs.snakemake_resources(jobs.allocation(cfg, "evaluate", None, {}), threads=3)
    assert ev == {"nodes": 1, "cpus_per_task": 3, "gpu": 1, "tasks": 1, "tasks_per_gpu": 1}
    conv = jobs.snakemake_resources(jobs.allocation(cfg, "convert", None, {}), threads=2)
    assert conv == {"nodes": 1, "cpus_per_task": 2}  # exports: a CPU job
    # a fine-tune's own block, its container replacing the workflow's
    cfg["container"] = {"runtime": "pyxis", "image": "a.sqsh", "mounts": []}
    cfg["finetune"] = {"f": {"resources": {"gpus_per_node": 2, "qos": "high", "sbatch_extra": "--exclusive"}}}
    ft = jobs.allocation(cfg, "finetune", "f", {})
    assert ft.container == cfg["container"] and ft.qos == "high"
    assert jobs.snakemake_resources(ft, 1)["slurm_extra"] == "--signal=USR1@300 --exclusive"
    cfg["finetune"]["f"]["resources"]["container"] = {"runtime": "none"}
    assert jobs.allocation(cfg, "finetune", "f", {}).container == {"runtime": "none"}
    assert [jobs.minutes(t) for t in (90, "45", "2:00", "1:00:30", "2-00:00:00")] == [90, 45, 120, 61, 2880]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"parallel": {"tp": 3}},
            r"config key runs.r.resources: 2 nodes x 4 GPUs = 8 ranks are not divisible by tensor-parallel size 3",
        ),
        (
            {"train": {"steps": 1, "micro_batch_size": 4, "global_batch_size": 16}},
            r"config key runs.r.resources: global_batch_size 16 is not divisible by micro_batch_size 4 x "
            r"data-parallel size 8 \(2 nodes x 4 GPUs = 8 ranks / \(tp 1 x pp 1\)\): choose a multiple of 32",
        ),
        (
            {"resources": {"gpus_per_node": 1, "time_limit": 5, "signal_s": 300, "nodes": 2}},
            r"config key runs.r.resources.signal_s: 300 s is not before the time limit \(5 min\)",
        ),
        (
            {"resources": {"time_limit": "90 minutes"}},
            r"config key runs.r.resources: '90 minutes' is not minutes or \[D-\]HH:MM\[:SS\]",
        ),
    ],
)
def test_job_resource_errors_name_the_key(change, message):
    cfg = _jobs_config()
    cfg["runs"]["r"].update(change)
    with pytest.raises(ConfigError, match=message):
        checks.check_resources(cfg)


def test_one_gpu_stages_and_site_defaults_are_checked_before_submitting():
    cfg = _jobs_config(evaluate={"gpus_per_node": 2})
    with pytest.raises(
        ConfigError, match="config key resources.evaluate: 1 node x 2 GPUs = 2 ranks: evaluate runs one"
    ):
        checks.check_resources(cfg)
    cfg = _config()  # batch 4 of micro batch 2: 2 ranks at most; the site's 8 GPUs do not divide it
    with pytest.raises(ConfigError, match="data-parallel size 8"):
        checks.check_resources(cfg, {"SNAKELLM_TRAIN_GPUS_PER_NODE": "8"})
    checks.check_resources(cfg, {"SNAKELLM_TRAIN_GPUS_PER_NODE": "2"})
    cfg["resources"] = {"evaluate": {"container": {"runtime": "pyxis", "image": "x.sqsh"}}}
    checks.check_resources(cfg)  # locally: pyxis is an srun plugin, the job runs on the host
    with pytest.raises(ConfigError, match="config key resources.evaluate: a pyxis container needs the job's own srun"):
        checks.check_resources(cfg, {})
    # the schema: unknown keys and bad values name the key
    schema = validate.load_schema(REPO / "config/schema.yaml")
    default = yaml.safe_load((REPO / "config/config.yaml").read_text())
    default["runs"]["tiny"]["resources"] = {"gpus": 8}
    with pytest.raises(ConfigError, match=r"config key runs.tiny.resources: unknown key 'gpus'"):
        validate.validate(default, schema)
    del default["runs"]["tiny"]["resources"]
    default["resources"] = {"finetune": {"nodes": 0}}
    with pytest.raises(ConfigError, match=r"config key resources.finetune.nodes: 0 is less than the minimum of 1"):
        validate.validate(default, schema)


# ---------------------------------------------------------------- every input path a config names exists


def _paths_config(tmp_path):
    """_full_config with one instance of every section that has a path-valued key (settings ``path=``)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cfg = _full_config()
    cfg["tokenizers"].update(
        spm={"kind": "sentencepiece", "model_file": _ANY_FILE},
        hf={"kind": "huggingface", "tokenizer_file": _ANY_FILE, "eod": "</s>"},
    )
    cfg["import_hf"] = {
        "imp": {"hf_dir": str(hf)},
        "rnd": {"hf_dir": "models/random/rnd", "random": {"preset": "tiny-llama"}},
    }
    cfg["lm_eval"] = {"suites": {"mine": {"include_path": [str(tmp_path)]}}}
    cfg["finetune"]["ft"]["examples"] = {"chat_template": _ANY_FILE}
    return validate.validate(cfg, SCHEMA)


def _path_keys(cfg):
    """(dotted key, section dict, field) of every path-valued key present in ``cfg``."""
    out = []
    for where, cls in sections.SECTIONS.items():
        for name, (_, unless, _names) in settings.path_fields(cls).items():
            for key, section in checks._instances(cfg, where.split(".")):
                if section.get(name) is not None and not (unless and section.get(unless)):
                    out.append((where, f"{key}.{name}", section, name))
    return out


def test_every_path_valued_key_pointed_at_a_missing_file_is_a_config_error_naming_it(tmp_path):
    """Issue 42: a missing vocab_file once dropped 5 jobs of 33 from the graph without a word."""
    cfg = _paths_config(tmp_path)
    checks.check_config(cfg)  # every path exists: fine
    found = _path_keys(cfg)
    declared = {where for where, cls in sections.SECTIONS.items() if settings.path_fields(cls)}
    assert {w for w, *_ in found} == declared, "add an instance of the section to _paths_config"
    assert len(found) >= 9
    for _, key, section, name in found:
        saved = section[name]
        missing = str(tmp_path / "missing" / ("*.jsonl" if name == "path" and "sources" in key else "x"))
        section[name] = [missing] if isinstance(saved, list) else missing
        with pytest.raises(ConfigError) as e:
            checks.check_config(cfg)
        named = key + ("[0]" if isinstance(saved, list) else "")
        assert str(e.value).startswith(f"config key {named}: "), (key, str(e.value))
        assert "missing" in str(e.value)
        section[name] = saved
    # a chat template may name a built-in instead of a file (the names are chat_template.BUILTIN's)
    from snakellm.finetune.chat_template import BUILTIN

    assert sections.CHAT_TEMPLATE_NAMES == tuple(BUILTIN)
    cfg["finetune"]["ft"]["examples"]["chat_template"] = "chatml"
    checks.check_config(cfg)
    # a path that names the wrong kind of thing says so
    cfg["tokenizers"]["gpt2"]["vocab_file"] = str(tmp_path)
    with pytest.raises(ConfigError, match=r"tokenizers.gpt2.vocab_file: .*: not a file"):
        checks.check_config(cfg)


@pytest.mark.parametrize("where", list(sections.SECTIONS))
def test_the_schema_marks_exactly_the_path_valued_keys(where):
    cls, props = sections.SECTIONS[where], _schema_at(where)["properties"]
    marked = {name for name, prop in props.items() if prop.get("format") == "path"}
    assert marked == set(settings.path_fields(cls)), where
