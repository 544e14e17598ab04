"""Every `snakellm <step>` keeps one exit-status contract (snakellm.errors).

2: a usage or configuration error, nothing done; 1: a failure while working
(bad data, named by file and line); 75: a clean stop to resume (tests/test_train.py).
Real subprocesses, as a rule or a person runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zstandard
from conftest import REPO, env_with_venv

from snakellm import errors
from snakellm.cli import STEPS


def _run(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakellm.cli", *argv],
        capture_output=True,
        text=True,
        env=env_with_venv(),
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.slow  # a CLI process a step (31): ~10 s; the fast tier's 90 s has no room
@pytest.mark.parametrize("step", list(STEPS))
def test_a_bad_flag_is_a_usage_error(step):
    p = _run(step, "--no-such-flag")
    assert p.returncode == 2, (step, p.stderr)
    assert "error:" in p.stderr and "Traceback" not in p.stderr


def test_an_unknown_step_is_a_usage_error():
    p = _run("no-such-step")
    assert p.returncode == 2 and "unknown step 'no-such-step'" in p.stderr


def _bad_json_chunk(tmp_path):
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    return ["tokenize", str(bad), str(tmp_path / "p_text_document"), "--kind", "gpt2-bpe"] + [
        "--vocab-file",
        str(REPO / "resources/tokenizers/gpt2/vocab.json"),
        "--merges-file",
        str(REPO / "resources/tokenizers/gpt2/merges.txt"),
        "--no-progress",
    ], f"{bad}:3"


def _truncated_shard(tmp_path):
    shard = tmp_path / "s.jsonl.zst"
    shard.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n' * 1000)[:-8])
    return ["chunk", str(shard), "-o", str(tmp_path / "o.jsonl"), "--format", "jsonl.zst", "--no-progress"], str(shard)


def _bad_stats(tmp_path):
    stats = tmp_path / "x.stats.json"
    stats.write_text(json.dumps({"chunk": "c"}))
    return ["blend", str(stats), "-o", str(tmp_path / "b.json")], str(stats)


@pytest.mark.slow  # 2.0 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
@pytest.mark.parametrize("make", [_bad_json_chunk, _truncated_shard, _bad_stats], ids=["tokenize", "chunk", "blend"])
def test_bad_data_is_a_failure_while_working_naming_the_file(make, tmp_path):
    argv, where = make(tmp_path)
    p = _run(*argv)
    assert p.returncode == 1, p.stderr
    assert where in p.stderr and "Traceback" not in p.stderr


def test_a_missing_input_is_a_usage_error(tmp_path):
    p = _run("prepare-sft", str(tmp_path / "none.json"), str(tmp_path / "out"))
    assert p.returncode == 2 and "none.json" in p.stderr and not (tmp_path / "out").exists()


def test_every_error_class_has_a_base_and_a_status():
    import importlib
    import inspect
    import pkgutil

    import snakellm

    classes = []
    for m in pkgutil.walk_packages(snakellm.__path__, "snakellm."):
        mod = importlib.import_module(m.name)
        classes += [
            c
            for c in vars(mod).values()
            if inspect.isclass(c) and issubclass(c, Exception) and c.__module__ == mod.__name__
        ]
    assert len(classes) > 30
    orphans = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, errors.SnakellmError)]
    assert not orphans, f"exception classes outside snakellm.errors.SnakellmError: {orphans}"
    assert {c.exit_code for c in classes} <= {1, 2, 75}
    from snakellm.launch import distributed, runtime

    assert runtime.LaunchError is distributed.LaunchError  # one LaunchError


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--stepz", "3"], "unknown flag --stepz; did you mean --steps?"),  # argparse names --steps missing
        (
            ["chunk", "x.jsonl", "-o", "y.jsonl", "--treads", "2"],
            "unrecognized arguments: --treads 2; did you mean --threads?",
        ),
        (["report", "tokens", "--blnd", "b.json"], "unknown flag --blnd; did you mean --blend?"),
        (["report", "tokns"], "invalid choice: 'tokns'"),
    ],
)
def test_a_mistyped_flag_gets_the_near_match(argv, hint, capsys):
    import argparse

    from snakellm import cli

    error = argparse.ArgumentParser.error
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and hint in err, err
    if argv[1] == "tokns":
        assert err.rstrip().endswith("did you mean tokens?"), err
    assert argparse.ArgumentParser.error is error  # the hook is the step's only, not the process's


def test_a_mistyped_step_gets_the_near_match(capsys):
    from snakellm import cli

    assert cli.main(["trian", "--steps", "3"]) == 2
    assert "unknown step 'trian'; did you mean train?" in capsys.readouterr().err
