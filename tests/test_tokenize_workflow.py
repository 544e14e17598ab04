"""The tokenize stage under real `snakemake`: train_tokenizer -> tokenize -> blend.

One build of a small config (the shipped corpus, GPT-2 BPE and a small trained
SentencePiece) is copied for each test (mtimes and .snakemake metadata kept);
each test changes one thing and checks, by output mtimes, exactly what was
rebuilt.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import zstandard
from conftest import REPO, Workspace, age, small_config

pytestmark = pytest.mark.slow

TOKENIZERS = ("gpt2", "spm")
BLENDS = [f"data/tokens/{t}/blend.json" for t in TOKENIZERS]
WIKI = [f"chunk-0000{i}" for i in range(3)]


def config(root) -> dict:
    cfg = small_config(root)
    shutil.copytree(REPO / "resources" / "tokenizers" / "gpt2", root / "resources" / "tokenizers" / "gpt2")
    cfg["tokenizers"] = {
        "gpt2": {
            "kind": "gpt2-bpe",
            "vocab_file": "resources/tokenizers/gpt2/vocab.json",
            "merges_file": "resources/tokenizers/gpt2/merges.txt",
            "vocab_size": 50257,
        },
        "spm": {"kind": "sentencepiece", "vocab_size": 500, "train": {"sample": {"chunks": 1}}},
    }
    cfg["tokenize"] = {"tokenizers": list(TOKENIZERS), "threads": 1}
    return cfg


def tokens(tok: str, source: str, chunk: str) -> set[str]:
    stem = f"data/tokens/{tok}/{source}/{chunk}_text_document"
    return {f"{stem}.bin", f"{stem}.idx", f"{stem}.stats.json"}


def jsonl(source: str, chunk: str) -> set[str]:
    stem = f"data/jsonl/{source}/{chunk}"
    return {f"{stem}.jsonl", f"{stem}.stats.json", f"{stem}.rejected.jsonl"}


def blends(*toks: str) -> set[str]:
    return {f"data/tokens/{t}/blend.{e}" for t in toks for e in ("json", "txt")}


SPM_MODEL = {"tokenizers/spm/tokenizer.model", "tokenizers/spm/tokenizer.vocab", "tokenizers/spm/tokenizer.stats.json"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    ws = Workspace(tmp_path_factory.mktemp("pristine"))
    ws.write_config(config(ws.root))
    ws.run(*BLENDS)
    age(ws.root, 60, "data", "tokenizers")
    return ws


@pytest.fixture
def built(pristine, tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(pristine.root, root, symlinks=True)  # copy2: mtimes kept
    return Workspace(root)


def snap(ws: Workspace) -> dict[str, int]:
    return ws.snapshot("data", "tokenizers")


def changed(ws: Workspace, before) -> set[str]:
    return ws.changed(before, "data", "tokenizers")


def test_build_writes_token_files_and_blends_megatron_reads(built):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    for tok, vocab, eod in (("gpt2", 50257, 50256), ("spm", 500, 2)):
        blend = json.loads(built.path(f"data/tokens/{tok}/blend.json").read_text())
        t = blend["tokenizer"]
        assert (t["name"], t["vocab_size"], t["eod_id"], t["dtype"]) == (tok, vocab, eod, "uint16")
        prefixes = blend["data_prefix"][1::2]
        assert prefixes == [f"data/tokens/{tok}/wikitext/{c}_text_document" for c in WIKI] + [
            f"data/tokens/{tok}/botchan/chunk-00000_text_document"
        ]
        assert sum(blend["data_prefix"][0::2]) == pytest.approx(1.0)
        assert blend["documents"] == 62 + 149
        for p in prefixes:
            ds = IndexedDataset(str(built.path(p)))
            assert int(ds[0][-1]) == eod
        line = built.path(f"data/tokens/{tok}/blend.txt").read_text().split()
        assert line[1::2] == prefixes
    assert json.loads(built.path("data/tokens/spm/blend.json").read_text())["tokenizer"]["files"] == {
        "model_file": "tokenizers/spm/tokenizer.model"
    }
    assert built.path("logs/tokenize/gpt2/wikitext/chunk-00000.log").exists()
    assert built.path("benchmarks/tokenize/gpt2/wikitext/chunk-00000.tsv").exists()
    before = snap(built)
    out = built.run(*BLENDS, "-n")
    assert "Nothing to be done" in out.stdout + out.stderr
    assert changed(built, before) == set()


def test_modifying_one_shard_retokenizes_only_its_chunk_and_rewrites_the_blends(built):
    stats = built.path("data/tokens/gpt2/wikitext/chunk-00001_text_document.stats.json")
    docs_before = json.loads(stats.read_text())["documents"]
    before = snap(built)
    # chunk-00001 holds chunk1/example_train_6,7 and chunk2/example_train_0..3; the spm sample is chunk-00000
    shard = built.path("resources/corpus/wikitext/chunk2/example_train_1.jsonl.zst")
    docs = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
    shard.write_bytes(
        zstandard.ZstdCompressor().compress(docs + json.dumps({"text": "an added document"}).encode() + b"\n")
    )
    built.run(*BLENDS)
    # the chunk's shard list carries the planner's note naming the changed shard (that is what reruns it)
    assert changed(built, before) == (
        {f"data/plan/wikitext/{WIKI[1]}.list"}
        | jsonl("wikitext", WIKI[1])
        | tokens("gpt2", "wikitext", WIKI[1])
        | tokens("spm", "wikitext", WIKI[1])
        | blends(*TOKENIZERS)
    )
    assert json.loads(stats.read_text())["documents"] == docs_before + 1


def test_changing_the_training_sample_retrains_and_retokenizes_only_that_tokenizer(built):
    cfg = built.read_config()
    cfg["tokenizers"]["spm"]["vocab_size"] = 600
    built.write_config(cfg)
    before = snap(built)
    built.run(*BLENDS)
    every_chunk = [("wikitext", c) for c in WIKI] + [("botchan", "chunk-00000")]
    assert changed(built, before) == SPM_MODEL | blends("spm") | set().union(
        *(tokens("spm", s, c) for s, c in every_chunk)
    )
    assert json.loads(built.path("data/tokens/spm/blend.json").read_text())["tokenizer"]["vocab_size"] == 600


def test_a_source_weight_rewrites_only_the_blends_and_unrelated_edits_nothing(built):
    cfg = built.read_config()
    cfg["download"] = {"retries": 3}
    cfg["tokenize"]["threads"] = 2  # how fast, not what: reruns nothing
    built.write_config(cfg)
    before = snap(built)
    built.run(*BLENDS)
    assert changed(built, before) == set()
    cfg["sources"]["botchan"]["weight"] = 2.0
    built.write_config(cfg)
    built.run(*BLENDS)
    assert changed(built, before) == blends(*TOKENIZERS)
    blend = json.loads(built.path("data/tokens/gpt2/blend.json").read_text())
    assert blend["sources"]["botchan"]["weight"] == 2.0


def test_missing_tokenizer_file_and_bad_config_fail_naming_them(built):
    built.path("resources/tokenizers/gpt2/merges.txt").unlink()
    for f in tokens("gpt2", "botchan", "chunk-00000"):
        built.path(f).unlink()
    out = built.run(*BLENDS, check=False)
    assert out.returncode != 0
    # a config error naming the key, before any job (issue 42: the jobs never leave the graph silently)
    assert "config key tokenizers.gpt2.merges_file: resources/tokenizers/gpt2/merges.txt: no such file" in (
        out.stdout + out.stderr
    )
    assert not built.path("data/tokens/gpt2/botchan/chunk-00000_text_document.bin").exists()
    shutil.copy(REPO / "resources/tokenizers/gpt2/merges.txt", built.path("resources/tokenizers/gpt2/merges.txt"))
    cfg = built.read_config()
    cfg["tokenize"]["tokenizers"] = ["gpt2", "llama"]
    built.write_config(cfg)
    out = built.run("-n", check=False)
    assert out.returncode != 0
    assert "config key tokenize.tokenizers: unknown tokenizer 'llama'" in out.stdout + out.stderr
