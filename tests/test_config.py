"""Config validation: defaults filled in, and errors that name the key before any job runs."""

from __future__ import annotations

import copy

import pytest
from conftest import REPO, small_config

from snakellm.config import validate as cfgmod

SCHEMA = cfgmod.load_schema(REPO / "config" / "schema.yaml")
BASE = {"sources": {"web": {"kind": "local", "path": "x/*.jsonl", "format": "jsonl", "shards_per_chunk": 2}}}


def _validate(cfg):
    return cfgmod.validate(copy.deepcopy(cfg), SCHEMA)


def test_defaults_are_filled():
    cfg = _validate(BASE)
    src = cfg["sources"]["web"]
    assert src["key"] == "text" and src["weight"] == 1.0
    assert cfg["download"]["retries"] >= 1 and cfg["download"]["concurrency"] >= 1


def test_embedded_default_config_is_valid():
    cfgmod.load(REPO / "config" / "config.yaml", REPO / "config" / "schema.yaml")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c["sources"]["web"].update(shard_per_chunk=3), "sources.web: unknown key 'shard_per_chunk'"),
        (lambda c: c.update(sourcs={}), "<top level>: unknown key 'sourcs'"),
        (
            lambda c: c["sources"]["web"].update(shards_per_chunk="many"),
            "sources.web.shards_per_chunk: 'many' is not of type ['integer', 'null']",
        ),
        (lambda c: c["sources"]["web"].update(shards_per_chunk=0), "sources.web.shards_per_chunk"),
        (lambda c: c["sources"]["web"].update(format="csv"), "sources.web.format: 'csv' is not one of"),
        (lambda c: c["sources"]["web"].update(kind="s3"), "sources.web.kind"),
        (lambda c: c["sources"]["web"].pop("path"), "'path' is a required property"),
        (lambda c: c["sources"]["web"].update(weight=-1), "sources.web.weight"),
        (lambda c: c["sources"].update({"bad name!": c["sources"]["web"]}), "bad name 'bad name!'"),
        (lambda c: c.update(download={"retries": "3"}), "download.retries: '3' is not of type integer"),
    ],
)
def test_errors_name_the_key(mutate, message):
    cfg = copy.deepcopy(BASE)
    mutate(cfg)
    with pytest.raises(cfgmod.ConfigError) as e:
        _validate(cfg)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(sourcs={}), "unknown key 'sourcs'; did you mean 'sources'?"),
        (lambda c: c["sources"]["web"].update(shard_per_chunk=3), "did you mean 'shards_per_chunk'?"),
        (
            lambda c: c.update(runs={"tiny": {"tokenizer": "gpt2", "train": {"stepz": 3}}}),
            "config key runs.tiny.train: unknown key 'stepz'; did you mean 'steps'? (allowed: ",
        ),
    ],
)
def test_unknown_keys_suggest_the_near_match(mutate, message):
    cfg = copy.deepcopy(BASE)
    mutate(cfg)
    with pytest.raises(cfgmod.ConfigError) as e:
        _validate(cfg)
    assert message in str(e.value)


def test_an_unknown_key_far_from_every_known_one_gets_no_guess():
    cfg = copy.deepcopy(BASE)
    cfg["sources"]["web"]["zqxj"] = "red"
    with pytest.raises(cfgmod.ConfigError) as e:
        _validate(cfg)
    assert "unknown key 'zqxj' (allowed: " in str(e.value) and "did you mean" not in str(e.value)


def test_http_source_needs_url_or_urls():
    cfg = {"sources": {"sp": {"kind": "http", "format": "jsonl.zst", "shards_per_chunk": 800}}}
    with pytest.raises(cfgmod.ConfigError, match="sources.sp"):
        _validate(cfg)
    cfg["sources"]["sp"]["url"] = "https://h/chunk{1..10}/example_train_{0..5999}.jsonl.zst"
    _validate(cfg)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c["sources"]["wikitext"].update(shards_per_chunk="six"), "sources.wikitext.shards_per_chunk"),
        (lambda c: c["sources"]["botchan"].update(colour="red"), "unknown key 'colour'"),
        (
            lambda c: c["sources"]["botchan"].update(path="resources/corpus/missing/*.jsonl"),
            "sources.botchan.path: no file matches",
        ),
        (  # issue 42: this once dropped the gpt2 tokenize and blend jobs from the graph without a word
            lambda c: c.update(
                tokenizers={
                    "gpt2": {
                        "kind": "gpt2-bpe",
                        "vocab_file": "resources/tokenizers/gpt2/vocab-missing.json",
                        "merges_file": "resources/tokenizers/gpt2/merges.txt",
                    }
                }
            ),
            "invalid config: config key tokenizers.gpt2.vocab_file: resources/tokenizers/gpt2/vocab-missing.json: "
            "no such file",
        ),
    ],
)
@pytest.mark.slow  # a Snakemake run in a subprocess: the slow tier (fast-tier budget)
def test_snakemake_refuses_a_bad_config_before_any_job(workspace, mutate, message):
    cfg = small_config(workspace.root)
    mutate(cfg)
    workspace.write_config(cfg)
    proc = workspace.run("data", check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert not (workspace.root / "data").exists()  # nothing ran


@pytest.mark.slow
def test_60000_shards_5000_per_chunk_plan_and_dry_run_through_list_files(workspace):
    # 5,000 SlimPajama URLs are ~560 KB: far over Linux's 128 KiB per argument. The jobs
    # read their shard lists from data/plan/{source}/{chunk}.list, never from the command line.
    url = "https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/train/chunk{1..10}/example_train_{0..5999}.jsonl.zst"
    workspace.write_config(
        {"sources": {"sp": {"kind": "http", "url": url, "format": "jsonl.zst", "shards_per_chunk": 5000}}}
    )
    proc = workspace.run("-n", "-p", "data")
    out = proc.stdout + proc.stderr
    assert out.count("rule download:") == 12 and out.count("rule chunk:") == 12
    assert (
        "--url-file data/plan/sp/chunk-00011.list" in out
        and "huggingface.co" not in out.split("rule download:")[1][:2000]
    )
    lists = sorted((workspace.root / "data/plan/sp").glob("*.list"))
    assert len(lists) == 12
    from snakellm.data.planning import read_shard_list

    first = read_shard_list(lists[0])  # one JSON string per line, after a header note
    assert len(first) == 5000 and first[0].endswith("chunk1/example_train_0.jsonl.zst")
    assert len(lists[0].read_bytes()) > 4 * 128 * 1024
