"""The example configs are valid and plan as documented (real `snakemake -n`, nothing fetched)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from conftest import REPO
from snakellm.config import validate as cfgmod

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))
SCHEMA = cfgmod.load_schema(REPO / "config" / "schema.yaml")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfgmod.validate(yaml.safe_load(path.read_text()), SCHEMA)


def test_slimpajama_example_plans_75_jobs_per_stage(workspace):
    shutil.copytree(REPO / "resources" / "tokenizers", workspace.root / "resources" / "tokenizers")
    shutil.copy(REPO / "config" / "examples" / "slimpajama-gpt2-124m.yaml", workspace.config_path)
    out = workspace.run("-n").stdout
    stats = out.split("Job stats:", 1)[1]
    counts = {l.split()[0]: int(l.split()[1]) for l in stats.splitlines()[3:] if len(l.split()) == 2 and l.split()[1].isdigit()}
    assert counts["download"] == counts["chunk"] == counts["tokenize"] == 75  # 60,000 shards / 800 a chunk
    assert counts["blend"] == 1 and counts["pretrain"] == 1
