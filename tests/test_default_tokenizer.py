"""The embedded default's SentencePiece tokenizer keeps every character: no ``⁇`` in what a new user sees.

Trained without byte fallback, the 2k model turned WikiText's literal ``<unk>``
markers and every ``<``/``>`` into the unknown token, and the default run's
``samples.md`` read ``⁇ unk ⁇`` over and over. With ``byte_fallback: true``
(config/config.yaml) a character outside the vocabulary becomes its UTF-8
bytes, so no text maps to the unknown id.
"""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
import yaml
from conftest import REPO, Workspace

pytestmark = pytest.mark.slow

UNK_MARK = "\u2047"  # ⁇, what SentencePiece decodes the unknown id to


def test_default_config_trains_a_tokenizer_with_byte_fallback(default_workflow: Workspace):
    """The default workflow's own tokenizer (the session's build: the same `snakemake` run of the
    shipped config that built it in a workspace of its own here before)."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert cfg["tokenizers"]["spm2k"]["train"]["byte_fallback"] is True
    workspace = default_workflow
    assert workspace.read_config() == cfg  # the build is of the shipped config, unchanged
    sp = spm.SentencePieceProcessor(model_file=str(workspace.path("tokenizers/spm2k/tokenizer.model")))
    texts = []
    for chunk in sorted(workspace.root.glob("data/jsonl/*/chunk-*.jsonl")):
        if chunk.name.endswith(".rejected.jsonl"):
            continue
        texts += [json.loads(line)["text"] for line in chunk.read_text().splitlines()]
    assert len(texts) > 100
    assert sum("<unk>" in t for t in texts) > 10  # WikiText's literal markers are in the corpus
    unk = sp.unk_id()
    for t in texts:
        ids = sp.encode(t)
        assert unk not in ids, t[:200]
        assert UNK_MARK not in sp.decode(ids)
    assert sp.decode(sp.encode("a <unk> marker, 5 < 6 > 3")) == "a <unk> marker, 5 < 6 > 3"


def test_default_run_samples_hold_words_not_unknown_marks(default_workflow: Workspace):
    samples = default_workflow.path("runs/tiny/samples.md").read_text()
    assert "## 1" in samples
    assert UNK_MARK not in samples


def test_the_default_tokenizer_keeps_newlines_tabs_runs_of_spaces_and_digits(default_workflow: Workspace):
    """Issue 42: trained with SentencePiece's defaults (nmt_nfkc, extra whitespace removed) the 2k model turned
    "a\\n\\nb" into "a b", and code and lists lost their layout; the default normalization (preserve) keeps it."""
    sp = spm.SentencePieceProcessor(model_file=str(default_workflow.path("tokenizers/spm2k/tokenizer.model")))
    text = "def f(x):\n\tif x  >  1:\n\t\treturn 12345\n\n- a   b\n  indented, trailing  \n"
    assert sp.decode(sp.encode(text)) == text
    assert [p for p in sp.encode("2026", out_type=str) if p != "▁"] == ["2", "0", "2", "6"]  # digits split
