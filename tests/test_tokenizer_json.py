"""`tokenizer.json` byte-level BPE on tiktoken: ids identical to `tokenizers`, or a fallback that says why.

No hub access here, so each family's shape is trained with `tokenizers` itself on the
shipped text (WikiText-2, Botchan, the Wikipedia dump excerpt): GPT-2 (ByteLevel
regex), GPT-NeoX (NFC + ByteLevel regex), Qwen 2 (NFC + Split(regex) + ByteLevel) and
Llama 3 (Split(regex) + ByteLevel, ignore_merges, BOS template), 32k to 128k tokens.
They are trained once per session (about 20 s: the family tests are marked slow); the
small hand-made vocabularies below prove the edge cases in well under a second each.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_tokenize import megatron_reference, same_files
from tokenize_helpers import (
    BOTCHAN,
    HARD_TEXTS,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    WIKITEXT_SHARDS,
    corpus,
    enwiki_texts,
    read_shard,
    train_bytelevel_bpe,
    write_jsonl,
)
from tokenizers import Tokenizer as HFTokenizer

from snakellm.steps.tokenize import main
from snakellm.tokenize import encoders as T
from snakellm.tokenize.encode import tokenize_file

FAMILIES = {
    # name: (vocab size, train options, EOD)
    "gpt2": (32_000, {"specials": ("<|endoftext|>",)}, "<|endoftext|>"),
    "gpt-neox": (50_277, {"nfc": True, "specials": ("<|endoftext|>", "<|padding|>")}, "<|endoftext|>"),
    "qwen2": (
        96_000,
        {"pattern": QWEN2_PATTERN, "nfc": True, "specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>")},
        "<|endoftext|>",
    ),
    "llama3": (
        128_000,
        {
            "pattern": LLAMA3_PATTERN,
            "ignore_merges": True,
            "specials": ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
            "bos": "<|begin_of_text|>",
        },
        "<|end_of_text|>",
    ),
}


@pytest.fixture(scope="session")
def enwiki() -> list[str]:
    return enwiki_texts()


@pytest.fixture(scope="session")
def all_texts(enwiki) -> list[str]:
    return list(corpus()["wikitext"]) + list(corpus()["botchan"]) + enwiki + HARD_TEXTS


@pytest.fixture(scope="session")
def family_files(tmp_path_factory, enwiki) -> dict[str, Path]:
    """Each family's tokenizer.json, trained once per session on the shipped text."""
    d = tmp_path_factory.mktemp("tokenizer-json")
    docs = list(corpus()["wikitext"]) + list(corpus()["botchan"]) + enwiki
    return {
        name: train_bytelevel_bpe(d / name / "tokenizer.json", docs, size, **opts)
        for name, (size, opts, _) in FAMILIES.items()
    }


@pytest.fixture(scope="session")
def reference(family_files, all_texts):
    """tokenizers' ids of all_texts for a family, computed once per session."""
    cache: dict[str, list[list[int]]] = {}

    def ids(family: str) -> list[list[int]]:
        if family not in cache:
            cache[family] = hf_ids(family_files[family], all_texts)
        return cache[family]

    return ids


@pytest.fixture(scope="session")
def subset() -> list[str]:
    """The shipped corpus without the (large) Wikipedia excerpt, and the generated strings."""
    return list(corpus()["wikitext"]) + list(corpus()["botchan"]) + HARD_TEXTS


def hf_ids(path, texts, special: bool = False, split_special: bool = False) -> list[list[int]]:
    ref = HFTokenizer.from_file(str(path))
    ref.encode_special_tokens = split_special
    return [e.ids for e in ref.encode_batch(list(texts), add_special_tokens=special)]


def ids_of(tok: T.Tokenizer, texts) -> list[list[int]]:
    return [[int(i) for i in a] for a in tok.encode_batch(list(texts))]


# ----------------------------------------------------------------------------- the four families


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_on_tiktoken_with_ids_identical_to_tokenizers(family, family_files, all_texts, reference):
    size, opts, eod = FAMILIES[family]
    path = family_files[family]
    tok = T.load("huggingface", tokenizer_file=str(path), eod=eod, expected_vocab_size=size)
    assert tok.backend == "tiktoken", tok.encoder_reason
    assert "expressed exactly as tiktoken ranks" in tok.encoder_reason
    assert ("NFC" in tok.encoder_reason) == bool(opts.get("nfc"))
    assert (
        tok.eod_id
        == HFTokenizer.from_file(str(path)).token_to_id(eod)
        == size - len(opts["specials"]) + opts["specials"].index(eod)
    )
    ours = ids_of(tok, all_texts)
    assert ours == reference(family)  # every shipped document and the generated strings
    assert sum(map(len, ours)) > 1_500_000
    for text, ids in zip(HARD_TEXTS, ours[-len(HARD_TEXTS) :], strict=True):
        want = text if not opts.get("nfc") else __import__("unicodedata").normalize("NFC", text)
        assert tok.decode(ids) == want  # byte-level: lossless
    if opts.get("nfc"):  # NFC really is applied: decomposed é and Hangul jamo encode as the composed forms
        assert tok.encode("e\u0301") == tok.encode("\u00e9") and tok.encode("\u1100\u1161") == tok.encode("가")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_ignore_merges_true_and_false_both_match_on_trained_vocabularies(family, family_files, subset, tmp_path):
    """tiktoken returns a piece found whole in the vocabulary: that is ignore_merges true; with false it is the same
    when every token's own merges rebuild it, which holds for trained vocabularies (and is checked at load).
    The family test proves each file as trained (Llama 3 true, Qwen 2 false); this one flips the flag."""
    spec = json.loads(family_files[family].read_text())
    eod = FAMILIES[family][2]
    flag = not spec["model"]["ignore_merges"]
    spec["model"]["ignore_merges"] = flag
    path = tmp_path / f"{flag}.json"
    path.write_text(json.dumps(spec))
    tok = T.load("huggingface", tokenizer_file=str(path), eod=eod)
    assert tok.backend == "tiktoken" and f"ignore_merges={flag}" in tok.encoder_reason
    assert ids_of(tok, subset) == hf_ids(path, subset)


@pytest.mark.slow
def test_llama3_bos_from_the_template_with_add_special_tokens(family_files, subset):
    path = family_files["llama3"]
    tok = T.load("huggingface", tokenizer_file=str(path), eod="<|end_of_text|>", add_special_tokens=True)
    assert tok.backend == "tiktoken"
    bos = HFTokenizer.from_file(str(path)).token_to_id("<|begin_of_text|>")
    ours = ids_of(tok, subset)
    assert ours == hf_ids(path, subset, special=True)
    assert all(ids[0] == bos and bos not in ids[1:] for ids in ours)
    assert ours[-2] == [bos]  # an empty document: the template alone, as tokenizers gives it


@pytest.mark.slow
def test_special_token_text_inside_documents_is_ordinary_text(family_files, tmp_path):
    """Both encoders split "<|end_of_text|>" in a document into ordinary tokens: no EOD inside a document.

    (Megatron's HuggingFaceTokenizer calls transformers, which would give the special id here; see README.)
    """
    path = family_files["llama3"]
    docs = ["before <|end_of_text|> after", "<|begin_of_text|><|eot_id|>x", "plain"]
    special = {HFTokenizer.from_file(str(path)).token_to_id(s) for s in FAMILIES["llama3"][1]["specials"]}
    for backend in ("tiktoken", "tokenizers"):
        tok = T.load("huggingface", tokenizer_file=str(path), eod="<|end_of_text|>", backend=backend)
        assert tok.backend == backend
        ours = ids_of(tok, docs)
        assert ours == hf_ids(path, docs, split_special=True)
        assert not special & {i for ids in ours for i in ids}
        assert tok.decode(ours[0]) == docs[0]
    assert tok.eod_id in hf_ids(path, docs[:1])[0]  # what tokenizers does by default (not used here)

    src = write_jsonl(tmp_path / "c.jsonl", docs)
    prefix = str(tmp_path / "c_text_document")
    assert (
        main(
            [
                str(src),
                prefix,
                "--no-progress",
                "--kind",
                "huggingface",
                "--tokenizer-file",
                str(path),
                "--eod",
                "<|end_of_text|>",
            ]
        )
        == 0
    )
    tokens = np.fromfile(prefix + ".bin", dtype=np.int32)
    assert [int(i) for i in np.flatnonzero(tokens == tok.eod_id)] == list(np.cumsum([len(i) + 1 for i in ours]) - 1)


@pytest.mark.slow
def test_snakellm_tokenize_every_shipped_corpus_byte_identical_to_tokenizers_ids(
    family_files, all_texts, reference, tmp_path
):
    """What the tokenize rule runs, on every shipped chunk: Megatron's .bin/.idx of the tokenizers ids."""
    family = "llama3"
    path = family_files[family]
    size, _, eod = FAMILIES[family]
    eod_id = HFTokenizer.from_file(str(path)).token_to_id(eod)
    want = dict(zip(all_texts, reference(family), strict=True))
    chunks = [(s.parent.name + "-" + s.stem, read_shard(s)) for s in WIKITEXT_SHARDS]
    chunks += [("botchan", read_shard(BOTCHAN)), ("enwiki", enwiki_texts()), ("hard", [t for t in HARD_TEXTS if t])]
    tok = T.load("huggingface", tokenizer_file=str(path), eod=eod, expected_vocab_size=size)
    for name, docs in chunks:
        src = write_jsonl(tmp_path / f"{name}.jsonl", docs)
        prefix = str(tmp_path / f"{name}_text_document")
        if name == "enwiki":  # the command line once (the workflow test runs it on every chunk)
            args = ["--kind", "huggingface", "--tokenizer-file", str(path), "--eod", eod, "--vocab-size", str(size)]
            assert main([str(src), prefix, "--no-progress", "--threads", "2", "--batch-mb", "0.2", *args]) == 0
        else:
            tokenize_file(str(src), prefix, tok, threads=2, batch_bytes=200_000, show_progress=False)
        megatron_reference(str(tmp_path / "ref"), [want[d] for d in docs], eod_id, size)
        assert same_files(prefix, str(tmp_path / "ref")), name
        st = json.loads(Path(prefix + ".stats.json").read_text())
        assert st["encoder"] == "tiktoken" and "expressed exactly" in st["encoder_reason"]
        assert st["documents"] == len(docs)
        if src.stat().st_size <= 2_000_000:
            assert st["verified_documents"] == len(docs)  # a small chunk: every document checked
        else:  # 0.5% of the documents, from the first one on
            assert st["verified_documents"] == len(range(0, len(docs), 200)) >= 1


# ----------------------------------------------------------------------------- small hand-made vocabularies


def tiny_tokenizer(path: Path, ignore_merges: bool, **spec_changes) -> Path:
    """Bytes + bc, ab, abc with merges (b c), (a b), (ab c): "abc" is not rebuilt by its own merges
    (b c merge first, and there is no merge a + bc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from snakellm.tokenize.encoders import bytes_to_unicode

    vocab = {c: b for b, c in bytes_to_unicode().items()}
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<eod>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eod>"])
    spec = json.loads(tok.to_str())
    for k, v in spec_changes.items():
        spec[k] = v
    path.write_text(json.dumps(spec))
    return path


def test_ignore_merges_decides_whether_a_token_its_merges_cannot_rebuild_may_go_to_tiktoken(tmp_path):
    a, bc, abc = ord("a"), 256, 258  # byte ids are the byte values; then bc 256, ab 257, abc 258, <eod> 259
    on_path = tiny_tokenizer(tmp_path / "on.json", True)
    on = T.load("huggingface", tokenizer_file=str(on_path), eod="<eod>")
    assert on.backend == "tiktoken" and "ignore_merges=True" in on.encoder_reason
    assert on.encode("abc") == [abc] == hf_ids(on_path, ["abc"])[0]  # found whole: both give abc
    assert ids_of(on, ["abc;abc", "ab", "bc"]) == hf_ids(on_path, ["abc;abc", "ab", "bc"])

    off_path = tiny_tokenizer(tmp_path / "off.json", False)
    assert hf_ids(off_path, ["abc"])[0] == [a, bc]  # by the merges: b c first, and no merge a + bc
    off = T.load("huggingface", tokenizer_file=str(off_path), eod="<eod>")
    assert off.backend == "tokenizers"
    assert (
        "ignore_merges is false and 1 token(s) are not rebuilt by their own merges (e.g. 'abc')" in off.encoder_reason
    )
    assert ids_of(off, ["abc", "xabc"]) == hf_ids(off_path, ["abc", "xabc"])
    with pytest.raises(T.TokenizerError, match="off.json: tiktoken cannot encode it exactly: ignore_merges is false"):
        T.load("huggingface", tokenizer_file=str(off_path), eod="<eod>", backend="tiktoken")


def test_a_difference_found_by_the_verification_falls_back_naming_the_document(tmp_path, capsys):
    """tiktoken merges any adjacent pair whose concatenation is a token; tokenizers only listed merges.

    In "abcx" the pieces a + bc are adjacent: tiktoken makes abc, tokenizers has no merge (a bc). The load-time
    checks cannot see this (it depends on the text), the verification pass does.
    """
    path = tiny_tokenizer(tmp_path / "t.json", True)
    tok = T.load("huggingface", tokenizer_file=str(path), eod="<eod>")
    assert tok.backend == "tiktoken"
    assert tok.encode("abcx") != hf_ids(path, ["abcx"])[0]
    docs = ["hello", "abc;abc", "zabcx", "abcx again"]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    prefix = str(tmp_path / "c_text_document")
    assert (
        main(
            [
                str(src),
                prefix,
                "--no-progress",
                "--kind",
                "huggingface",
                "--tokenizer-file",
                str(path),
                "--eod",
                "<eod>",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "encoder tiktoken: byte-level BPE" in err
    assert f"warning: {src}:3: document 2: tiktoken gives 3 ids, the reference 4" in err
    assert f"encoding {src} again with tokenizers" in err
    st = json.loads(Path(prefix + ".stats.json").read_text())
    assert st["encoder"] == "tokenizers" and st["encoder_reason"].startswith(
        f"fell back: tiktoken ids differ from tokenizers at {src}:3"
    )
    megatron_reference(str(tmp_path / "ref"), hf_ids(path, docs), 259, 260)
    assert same_files(prefix, str(tmp_path / "ref"))


def test_a_difference_in_a_later_block_names_its_line_and_document(tmp_path, capsys):
    """The verification runs beside the encoding of later blocks; its report still counts lines and documents
    across blocks (a blank line makes them differ) and the chunk falls back to tokenizers."""
    path = tiny_tokenizer(tmp_path / "t.json", True)
    tok = T.load("huggingface", tokenizer_file=str(path), eod="<eod>")
    docs = [f"document {i} hello" for i in range(300)] + ["zabcx"] + [f"tail {i}" for i in range(50)]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    lines = src.read_bytes().split(b"\n")
    src.write_bytes(b"\n".join(lines[:10] + [b""] + lines[10:]))  # a blank line 11: document 300 is on line 302
    st = tokenize_file(str(src), str(tmp_path / "c"), tok, threads=2, batch_bytes=500, show_progress=False)
    err = capsys.readouterr().err
    assert f"warning: {src}:302: document 300: tiktoken gives 3 ids, the reference 4" in err
    assert st["encoder"] == "tokenizers" and st["encoder_reason"].startswith(
        f"fell back: tiktoken ids differ from tokenizers at {src}:302"
    )
    megatron_reference(str(tmp_path / "ref"), hf_ids(path, docs), 259, 260)
    assert same_files(str(tmp_path / "c"), str(tmp_path / "ref"))


def test_verification_samples_large_chunks(tmp_path):
    path = tiny_tokenizer(tmp_path / "t.json", True)
    docs = [f"document {i} hello" for i in range(1000)]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    tok = T.load("huggingface", tokenizer_file=str(path), eod="<eod>")
    st = tokenize_file(str(src), str(tmp_path / "a"), tok, show_progress=False, batch_bytes=3000, verify_all_bytes=0)
    assert st["verified_documents"] == 5 and st["encoder"] == "tiktoken"  # every 200th document, across batches
    st = tokenize_file(str(src), str(tmp_path / "b"), tok, show_progress=False, verify=0.0)
    assert st["verified_documents"] == 0
    st = tokenize_file(str(src), str(tmp_path / "c"), tok, show_progress=False)
    assert st["verified_documents"] == 1000  # a small chunk: all


@pytest.fixture(scope="module")
def small_bytelevel(tmp_path_factory) -> dict:
    path = train_bytelevel_bpe(
        tmp_path_factory.mktemp("small") / "tokenizer.json",
        corpus()["botchan"],
        1000,
        pattern=LLAMA3_PATTERN,
        specials=("<eod>",),
    )
    return json.loads(path.read_text())


def _variant(spec: dict, change) -> dict:
    spec = json.loads(json.dumps(spec))
    change(spec)
    return spec


NOT_EXPRESSIBLE = {
    "lowercase": (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer Lowercase"),
    "nfkc": (lambda s: s.update(normalizer={"type": "NFKC"}), "normalizer NFKC"),
    "whitespace": (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer Whitespace"),
    "prefix-space": (
        lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        "add_prefix_space",
    ),
    "split-removed": (lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"), "behavior Removed"),
    "byte-fallback": (lambda s: s["model"].update(byte_fallback=True), "byte_fallback"),
    "decoder": (lambda s: s.update(decoder={"type": "Fuse"}), "decoder Fuse"),
    "added-token": (
        lambda s: s["added_tokens"].append(
            {
                "id": 1000,
                "content": "Botchan",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": True,
                "special": False,
            }
        ),
        "1 non-special added token(s) (e.g. 'Botchan')",
    ),
    "merge-order": (
        lambda s: s["model"]["merges"].insert(0, s["model"]["merges"].pop(300)),
        "merge ranks disagree with ids",
    ),
}


@pytest.mark.parametrize("case", list(NOT_EXPRESSIBLE))
def test_what_tiktoken_cannot_express_stays_on_tokenizers_with_the_reason(case, small_bytelevel, tmp_path):
    change, reason = NOT_EXPRESSIBLE[case]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_variant(small_bytelevel, change)))
    texts = list(corpus()["botchan"][:10]) + HARD_TEXTS
    tok = T.load("huggingface", tokenizer_file=str(path), eod="<eod>")
    assert tok.backend == "tokenizers" and reason in tok.encoder_reason, tok.encoder_reason
    assert tok.encoder_reason.startswith("not expressible in tiktoken: ")
    assert ids_of(tok, texts) == hf_ids(path, texts, split_special=True)
    with pytest.raises(T.TokenizerError, match="tiktoken cannot encode it exactly"):
        T.load("huggingface", tokenizer_file=str(path), eod="<eod>", backend="tiktoken")


def test_the_unchanged_small_vocabulary_is_expressible(small_bytelevel, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(small_bytelevel))
    tok = T.load("huggingface", tokenizer_file=str(path), eod="<eod>")
    assert tok.backend == "tiktoken"
    texts = list(corpus()["botchan"]) + HARD_TEXTS
    assert ids_of(tok, texts) == hf_ids(path, texts)


@pytest.mark.slow
def test_llama3_tokenizer_json_through_the_workflow(family_files, all_texts, reference, tmp_path):
    """`snakemake` with a Llama-3-shaped tokenizer.json: every chunk on tiktoken, ids equal to tokenizers'."""
    from conftest import Workspace, small_config

    ws = Workspace(tmp_path)
    cfg = small_config(tmp_path)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(family_files["llama3"].read_bytes())
    size, _, eod = FAMILIES["llama3"]
    cfg["tokenizers"] = {
        "llama3": {"kind": "huggingface", "tokenizer_file": "tok/tokenizer.json", "eod": eod, "vocab_size": size}
    }
    cfg["tokenize"] = {"tokenizers": ["llama3"], "threads": 2}
    ws.write_config(cfg)
    ws.run("data/tokens/llama3/blend.json")
    want = dict(zip(all_texts, reference("llama3"), strict=True))
    eod_id = HFTokenizer.from_file(str(family_files["llama3"])).token_to_id(eod)
    blend = json.loads(ws.path("data/tokens/llama3/blend.json").read_text())
    assert blend["tokenizer"]["vocab_size"] == size and blend["tokenizer"]["dtype"] == "int32"
    for prefix in blend["data_prefix"][1::2]:
        st = json.loads(ws.path(prefix + ".stats.json").read_text())
        assert st["encoder"] == "tiktoken" and st["verified_documents"] == st["documents"]
        lines = ws.path(st["input"]).read_text(encoding="utf-8").split("\n")
        docs = [json.loads(line)[st["key"]] for line in lines if line.strip()]
        megatron_reference(str(tmp_path / "ref"), [want[d] for d in docs], eod_id, size)
        assert same_files(str(ws.path(prefix)), str(tmp_path / "ref")), prefix
    log = ws.path("logs/tokenize/llama3/botchan/chunk-00000.log").read_text()
    assert "encoder tiktoken: byte-level BPE (Split(regex)+ByteLevel, ignore_merges=True" in log
