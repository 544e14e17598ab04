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


@pytest.mark.slow
def test_wikipedia_example_plans_one_chunk_per_dump_file(workspace):
    cfg = yaml.safe_load((REPO / "config" / "examples" / "wikipedia-gpt2-124m.yaml").read_text())
    src = cfg["sources"]["wikipedia"]
    assert src["format"] == "mediawiki"
    dumps = workspace.root / "dumps"
    dumps.mkdir()
    for name in ("enwiki-latest-pages-articles1.xml-p1p41242.bz2", "enwiki-latest-pages-articles10.xml-p4045403p5399366.bz2",
                 "enwiki-latest-pages-articles2.xml-p41243p151573.bz2", "enwiki-latest-pages-articles-multistream-index.txt.bz2"):
        (dumps / name).write_bytes(b"")
    src["path"] = str(dumps / src["path"].rsplit("/", 1)[1].split("   #")[0])
    shutil.copytree(REPO / "resources" / "tokenizers", workspace.root / "resources" / "tokenizers")
    workspace.write_config(cfg)
    lists = workspace.run("-n", "data")
    assert lists.stdout.count("rule chunk:") == 3  # the multistream index is not a dump
    order = [(workspace.root / f"data/plan/wikipedia/chunk-0000{i}.list").read_text().strip().rsplit("/", 1)[1] for i in range(3)]
    assert order == ["enwiki-latest-pages-articles1.xml-p1p41242.bz2", "enwiki-latest-pages-articles2.xml-p41243p151573.bz2",
                     "enwiki-latest-pages-articles10.xml-p4045403p5399366.bz2"]
