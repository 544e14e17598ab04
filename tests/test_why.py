"""``snakellm why TARGET`` (issue 42): a changed setting's rerun reason, key by key, where Snakemake's is both
command lines whole on one line (2,280 characters for the tiny run's ``--steps 300`` -> ``--steps 400``)."""

from __future__ import annotations

import json
import subprocess
from base64 import urlsafe_b64encode

import pytest
from conftest import BIN, SNAKEFILE, env_with_venv, small_config

from snakellm.errors import UsageError
from snakellm.report.why import differences, explain, options, recorded


def test_options_and_differences_key_by_key():
    cmd = "snakellm train --blend b.json --steps 300 --tie-embeddings --weight a=1 --weight b=0.5 --lr -3e-3 2> log"
    assert options(cmd) == {
        "#1": ["snakellm"],
        "#2": ["train"],
        "--blend": ["b.json"],
        "--steps": ["300"],
        "--tie-embeddings": [""],
        "--weight": ["a=1", "b=0.5"],
        "--lr": ["-3e-3"],
    }
    now = "snakellm train --blend b.json --steps 400 --no-tie-embeddings --weight a=1 --lr -3e-3 2> log"
    assert differences(cmd, now) == [
        ("--steps", "300", "400"),
        ("--no-tie-embeddings", "-", "(on)"),
        ("--weight", "a=1 b=0.5", "a=1"),
        ("--tie-embeddings", "(on)", "-"),
    ]
    assert differences(cmd, cmd) == []


def test_a_target_without_a_record_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="x.json: Snakemake has no record of building it here"):
        explain("x.json", tmp_path)
    meta = tmp_path / ".snakemake/metadata"
    meta.mkdir(parents=True)
    (meta / urlsafe_b64encode(b"data/x.json").decode()).write_text(json.dumps({"rule": "r", "shellcmd": "a --b 1"}))
    assert recorded("data/x.json", tmp_path) == {"rule": "r", "shellcmd": "a --b 1"}


@pytest.mark.slow  # two Snakemake runs in a subprocess (a chunk job and a dry run)
def test_why_names_the_changed_setting_of_a_built_target(workspace):
    cfg = small_config(workspace.root)
    workspace.write_config(cfg)
    target = "data/jsonl/botchan/chunk-00000.jsonl"
    workspace.run(target)
    cfg["sources"]["botchan"]["max_rejected_fraction"] = 0.25
    workspace.write_config(cfg)
    args = ["--directory", str(workspace.root), "--", "-s", str(SNAKEFILE)]
    args += ["--configfile", str(workspace.config_path), "--replace-workflow-config"]
    proc = subprocess.run(
        [str(BIN / "snakellm"), "why", target, *args],
        cwd=workspace.root,
        env=env_with_venv(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        f"{target} (rule chunk): 1 setting differs from its last build:",
        "  --max-rejected-fraction  0.5  ->  0.25",
    ]
    # and the run that rebuilds it points there (the Snakefile's onstart)
    rerun = workspace.run(target)
    assert f"snakellm: chunk reruns for a changed setting; `snakellm why {target}` lists which" in rerun.stderr
