"""``snakellm blend`` and Megatron reading the blend.

Real chunks are tokenized (two sources, three chunks), blended, and the
blend.txt line goes through megatron-core's own ``get_blend_from_list`` (what
Megatron-LM does with ``--data-path``) into ``BlendedMegatronDatasetBuilder``;
the GPTDataset samples decode back to the source text.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from tokenize_helpers import GPT2_MERGES, GPT2_VOCAB, corpus, write_jsonl

from snakellm.steps.blend import main
from snakellm.tokenize import encoders as T
from snakellm.tokenize.blend import BlendError, build_blend
from snakellm.tokenize.encode import tokenize_file
from snakellm.tokenize.sentencepiece_trainer import train_sentencepiece

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

WEIGHTS = {"wikitext": 1.0, "botchan": 0.5}


@pytest.fixture(scope="module")
def gpt2():
    return T.load("gpt2-bpe", name="gpt2", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES))


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, gpt2):
    """data/tokens/gpt2/{source}/{chunk}_text_document for wikitext (2 chunks) and botchan (1), relative paths."""
    root = tmp_path_factory.mktemp("work")
    wiki = corpus()["wikitext"]
    chunks = {
        ("wikitext", "chunk-00000"): wiki[:30],
        ("wikitext", "chunk-00001"): wiki[30:],
        ("botchan", "chunk-00000"): corpus()["botchan"],
    }
    stats = []
    for (source, chunk), docs in chunks.items():
        src = write_jsonl(root / "data" / "jsonl" / source / f"{chunk}.jsonl", docs)
        prefix = f"data/tokens/gpt2/{source}/{chunk}_text_document"
        tokenize_file(str(src), str(root / prefix), gpt2, source=source, chunk=chunk, show_progress=False)
        # as the workflow records it: the prefix relative to the working directory
        st = json.loads((root / f"{prefix}.stats.json").read_text())
        st["prefix"] = prefix
        (root / f"{prefix}.stats.json").write_text(json.dumps(st))
        stats.append(f"{prefix}.stats.json")
    return root, stats


def test_blend_weights_are_tokens_times_source_weight_normalised(tokenized, monkeypatch):
    root, stats = tokenized
    monkeypatch.chdir(root)
    assert (
        main([*stats, "-o", "data/tokens/gpt2/blend.json", "--weight", "wikitext=1.0", "--weight", "botchan=0.5"]) == 0
    )
    blend = json.loads((root / "data/tokens/gpt2/blend.json").read_text())
    tokens = [json.loads((root / s).read_text())["tokens"] for s in stats]
    raw = [tokens[0], tokens[1], tokens[2] * 0.5]
    expect = [r / sum(raw) for r in raw]
    weights, prefixes = blend["data_prefix"][0::2], blend["data_prefix"][1::2]
    assert prefixes == [s.removesuffix(".stats.json") for s in stats]
    assert weights == pytest.approx(expect, rel=1e-12) and sum(weights) == pytest.approx(1.0)
    assert [d["tokens"] for d in blend["datasets"]] == tokens and blend["tokens"] == sum(tokens)
    assert blend["sources"]["botchan"]["share"] == pytest.approx(expect[2])
    assert blend["sources"]["wikitext"]["chunks"] == 2 and blend["sources"]["botchan"]["weight"] == 0.5
    tok = blend["tokenizer"]
    assert (tok["name"], tok["kind"], tok["vocab_size"], tok["eod_id"], tok["dtype"]) == (
        "gpt2",
        "gpt2-bpe",
        50257,
        50256,
        "uint16",
    )
    assert tok["files"] == {"vocab_file": str(GPT2_VOCAB), "merges_file": str(GPT2_MERGES)}
    assert tok["megatron_args"][:2] == ["--tokenizer-type", "GPT2BPETokenizer"]
    assert tok["nemo"]["type"] == "GPT2BPETokenizer"
    # blend.txt is the same list, which Megatron-LM's --data-path parsing turns back into it
    line = (root / "data/tokens/gpt2/blend.txt").read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    assert get_blend_from_list(line.split()) == (prefixes, weights)


def test_blend_refuses_mixed_tokenizers_and_unweighted_sources(tokenized, tmp_path, monkeypatch, capsys):
    root, stats = tokenized
    monkeypatch.chdir(root)
    with pytest.raises(
        BlendError, match=r"botchan/chunk-00000_text_document.stats.json: source 'botchan' has no weight"
    ):
        build_blend(stats, {"wikitext": 1.0})
    # a chunk tokenized by another tokenizer cannot join this blend
    model = tmp_path / "sp.model"
    train_sentencepiece(
        [(str(root / "data/jsonl/botchan/chunk-00000.jsonl"), "text")],
        str(model),
        str(tmp_path / "v"),
        str(tmp_path / "s"),
        vocab_size=500,
    )
    sp = T.load("sentencepiece", model_file=str(model))
    tokenize_file(
        str(root / "data/jsonl/botchan/chunk-00000.jsonl"),
        str(tmp_path / "sp"),
        sp,
        source="botchan",
        show_progress=False,
    )
    other = str(tmp_path / "sp.stats.json")
    with pytest.raises(BlendError, match=rf"{other}: tokenized with a different tokenizer than {stats[0]}"):
        build_blend([stats[0], other], WEIGHTS)
    assert (
        main([stats[0], other, "-o", str(tmp_path / "b.json"), "--weight", "wikitext=1", "--weight", "botchan=1"]) == 1
    )
    assert "different tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "blend.txt").exists()


def test_megatron_gpt_dataset_over_the_blend_decodes_to_source_text(tokenized, monkeypatch, gpt2):
    root, stats = tokenized
    monkeypatch.chdir(root)
    blend = build_blend(stats, WEIGHTS)
    line = " ".join(str(x) for x in blend["data_prefix"])
    tok = blend["tokenizer"]
    assert tok["eod_id"] == tok["vocab_size"] - 1
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=1024,
        blend=get_blend_from_list(line.split()),
        split="100,0,0",
        path_to_cache=str(root / "cache"),
        # megatron's own NullTokenizer: ids vocab_size-1.. as EOD, which is GPT-2's layout
        tokenizer=NullTokenizer(tok["vocab_size"] - 1),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    import torch.distributed as dist

    from snakellm.launch import runtime

    # an earlier in-process test of this process may have left its one-rank group (and megatron-core's
    # parallel state) for reuse (runtime.ensure_single_process); this test makes its own
    runtime.shutdown()
    # as in a trainer: one gloo rank (the index caches are written by rank 0)
    dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_ds, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], lambda: True, config).build()
    finally:
        dist.destroy_process_group()
    assert len(train_ds) >= 100
    sources = {name: [d.encode() for d in docs] for name, docs in corpus().items()}
    joined = b"\x00".join(d for docs in sources.values() for d in docs)
    eod = tok["eod_id"]
    seen_sources = set()
    whole_docs = 0
    for i in range(len(train_ds)):
        s = train_ds[i]
        text = np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]])
        assert len(text) == 1025
        pieces = np.split(text, np.flatnonzero(text == eod))
        for k, piece in enumerate(pieces):
            piece = piece[piece != eod]
            if not len(piece):
                continue
            data = gpt2.decode_bytes(piece)
            # a token run cut at the sample edge may split a UTF-8 character: trim to whole characters
            if k == 0:
                data = data.lstrip(bytes(range(0x80, 0xC0)))
            assert data[: max(0, len(data) - 3)] in joined, (i, k)
            for name, docs in sources.items():
                if any(data[:-3] in d for d in docs):
                    seen_sources.add(name)
            if 0 < k < len(pieces) - 1:
                whole_docs += data in {d for docs in sources.values() for d in docs}
    assert seen_sources == {"wikitext", "botchan"}
    assert whole_docs > 0  # a document between two EODs decodes to exactly one source document
