"""Token-id identity with the reference libraries, on the whole shipped corpus.

gpt2-bpe (tiktoken built from vocab.json + merges.txt) against OpenAI's
reference BPE (what Megatron's legacy GPT2BPETokenizer runs), the Rust
`tokenizers` BPE and transformers' GPT2Tokenizer; sentencepiece against
`sentencepiece`; huggingface against `tokenizers`. Plus SentencePiece training
(deterministic, SentencePiece's own .vocab format) and the load-time errors.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import sentencepiece as spm
from tokenize_helpers import GPT2_MERGES, GPT2_VOCAB, OpenAIGPT2, all_documents, corpus, openai_gpt2, write_jsonl
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from snakellm.tokenize import encoders as T
from snakellm.tokenize.sentencepiece_trainer import TrainError, sample_sentences, train_sentencepiece, vocab_text

EXTRA = [
    "Hello world",
    "a<|endoftext|>b: special tokens in text are ordinary text, as in Megatron's legacy tokenizer",
    "  leading spaces,\ttabs\r\nand  trailing   ",
    "Ünïcödé — “quotes”, emoji 🦙🦙, CJK 日本語のテキスト, Arabic مرحبا, combining é",
    "numbers 1234567890 3.14159 and 's 't 're 've 'm 'll 'd contractions",
    "\u200b zero width, \x00 NUL, \ufeff BOM",
]


def ids_of(tok: T.Tokenizer, texts) -> list[list[int]]:
    return [[int(i) for i in a] for a in tok.encode_batch(list(texts))]


@pytest.fixture(scope="module")
def gpt2() -> T.Tokenizer:
    return T.load(
        "gpt2-bpe", name="gpt2", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES), expected_vocab_size=50257
    )


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return all_documents() + EXTRA


# ----------------------------------------------------------------------------- gpt2-bpe


def test_gpt2_known_ids(gpt2):
    assert gpt2.backend == "tiktoken"
    assert (gpt2.vocab_size, gpt2.eod_id, gpt2.eod_token) == (50257, 50256, "<|endoftext|>")
    assert gpt2.encode("Hello") == [15496]
    assert gpt2.encode(" world") == [995]
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


@pytest.mark.slow  # 2.5 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_gpt2_ids_identical_to_openai_reference_bpe_on_corpus(gpt2, texts):
    ref = openai_gpt2()
    ours = ids_of(gpt2, texts)
    assert ours == [ref.encode(t) for t in texts]
    assert sum(map(len, ours)) > 350_000
    assert 50256 not in ours[len(all_documents()) + 1]  # "<|endoftext|>" in text is not the EOD id


@pytest.mark.slow  # three tokenizers over the corpus: ~3 s; the fast tier's 90 s has no room
def test_gpt2_ids_identical_to_tokenizers_and_transformers(gpt2, texts):
    hf = HFTokenizer(models.BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ours = ids_of(gpt2, texts)
    assert ours == [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import GPT2Tokenizer

        tr = GPT2Tokenizer(str(GPT2_VOCAB), str(GPT2_MERGES))
    docs = all_documents()  # transformers treats "<|endoftext|>" in text as the special token: corpus only
    assert ours[: len(docs)] == [tr.encode(t, add_special_tokens=False) for t in docs]


@pytest.mark.slow  # 2.1 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_gpt2_tokenizers_backend_gives_the_same_ids(gpt2, texts):
    fallback = T.load("gpt2-bpe", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES), backend="tokenizers")
    assert fallback.backend == "tokenizers"
    assert ids_of(fallback, texts) == ids_of(gpt2, texts)
    assert fallback.decode(fallback.encode(EXTRA[3])) == EXTRA[3]


def test_merges_out_of_id_order_fall_back_to_exact_bpe(tmp_path):
    """tiktoken merges by token id; when ids do not follow merge order it would differ, so it is not used."""
    vocab = json.loads(GPT2_VOCAB.read_text())
    lines = GPT2_MERGES.read_text().split("\n")[1:-1][:400]
    byte_tokens = {t: i for t, i in vocab.items() if i < 256}
    small = dict(byte_tokens)
    for n, m in enumerate(lines):
        small[m.replace(" ", "")] = 256 + n
    # swap the ids of two early merges: id order != merge order
    a, b = lines[0].replace(" ", ""), lines[5].replace(" ", "")
    small[a], small[b] = small[b], small[a]
    small["<|endoftext|>"] = len(small)
    vf, mf = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vf.write_text(json.dumps(small))
    mf.write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    tok = T.load("gpt2-bpe", vocab_file=str(vf), merges_file=str(mf))
    assert tok.backend == "tokenizers"
    ref = OpenAIGPT2(vf, mf)
    docs = list(corpus()["botchan"][:20]) + EXTRA
    assert ids_of(tok, docs) == [ref.encode(t) for t in docs]
    with pytest.raises(T.TokenizerError, match="merge order"):
        T.load("gpt2-bpe", vocab_file=str(vf), merges_file=str(mf), backend="tiktoken")


# ----------------------------------------------------------------------------- sentencepiece


@pytest.fixture(scope="module")
def chunk_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chunks")
    return [
        (str(write_jsonl(d / "wikitext.jsonl", corpus()["wikitext"])), "text"),
        (str(write_jsonl(d / "botchan.jsonl", corpus()["botchan"], key="content")), "content"),
    ]


@pytest.mark.slow  # trains and runs sentencepiece models: ~2 s each; the fast tier's 90 s has no room
@pytest.mark.parametrize(
    "settings",
    [dict(model_type="bpe", vocab_size=2000), dict(model_type="unigram", vocab_size=1000, byte_fallback=True)],
    ids=["bpe2000", "unigram-bytefallback"],
)
def test_sentencepiece_ids_identical_to_sentencepiece(tmp_path, chunk_files, texts, settings):
    model = tmp_path / "tokenizer.model"
    st = train_sentencepiece(
        chunk_files, str(model), str(tmp_path / "tokenizer.vocab"), str(tmp_path / "s.json"), threads=2, **settings
    )
    assert st["vocab_size"] == settings["vocab_size"] and st["sample"]["keep_probability"] == 1.0
    tok = T.load("sentencepiece", model_file=str(model), expected_vocab_size=settings["vocab_size"])
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert (tok.vocab_size, tok.eod_id, tok.eod_token) == (sp.vocab_size(), sp.eos_id(), "</s>")
    assert tok.eod_id == 2
    # Megatron's GPTSentencePieceTokenizer.tokenize is encode_as_ids, one text at a time
    assert ids_of(tok, texts) == [sp.encode_as_ids(t) for t in texts]


def test_sentencepiece_training_is_deterministic_and_writes_sentencepiece_vocab(tmp_path, chunk_files):
    outs = []
    for run in ("a", "b"):
        d = tmp_path / run
        train_sentencepiece(
            chunk_files, str(d / "m.model"), str(d / "m.vocab"), str(d / "m.json"), vocab_size=800, threads=2
        )
        outs.append(((d / "m.model").read_bytes(), (d / "m.vocab").read_text()))
    assert outs[0] == outs[1]
    # the .vocab is byte-for-byte what SentencePiece writes itself with a model_prefix
    sentences, _ = sample_sentences(chunk_files, 0, 0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_prefix=str(tmp_path / "ref"),
        vocab_size=800,
        model_type="bpe",
        character_coverage=1.0,
        max_sentence_length=16384,
        num_threads=2,
        input_sentence_size=0,
        minloglevel=2,
        # normalization: preserve (the default), as snakellm.tokenize.sentencepiece_trainer.NORMALIZATIONS says
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        byte_fallback=True,
    )
    assert outs[0][1] == (tmp_path / "ref.vocab").read_text()
    assert vocab_text(spm.SentencePieceProcessor(model_file=str(tmp_path / "ref.model"))) == outs[0][1]


def test_sentencepiece_sample_is_seeded_and_capped(chunk_files):
    total = sum(len(t.encode()) for docs in corpus().values() for t in docs)
    a, sa = sample_sentences(chunk_files, total // 4, seed=1)
    b, _ = sample_sentences(chunk_files, total // 4, seed=1)
    c, _ = sample_sentences(chunk_files, total // 4, seed=2)
    assert a == b and a != c
    assert 0 < sa["bytes"] < total // 2
    assert [i["key"] for i in sa["inputs"]] == ["text", "content"]


def test_sentencepiece_user_symbols_and_training_errors(tmp_path, chunk_files):
    train_sentencepiece(
        chunk_files,
        str(tmp_path / "m.model"),
        str(tmp_path / "m.vocab"),
        str(tmp_path / "m.json"),
        vocab_size=600,
        user_defined_symbols=["<ctx>"],
        options={"split_digits": "true"},
        threads=1,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    assert sp.piece_to_id("<ctx>") != sp.unk_id() and "<ctx>" in sp.encode("a <ctx> b", out_type=str)
    with pytest.raises(TrainError, match="input not found"):
        train_sentencepiece(
            [("missing.jsonl", "text")],
            str(tmp_path / "x.model"),
            str(tmp_path / "x.vocab"),
            str(tmp_path / "x.json"),
            vocab_size=600,
        )
    with pytest.raises(TrainError, match="x.model: SentencePiece training failed"):
        train_sentencepiece(
            chunk_files[1:],
            str(tmp_path / "x.model"),
            str(tmp_path / "x.vocab"),
            str(tmp_path / "x.json"),
            vocab_size=200_000,
        )
    assert not list(tmp_path.glob("x.*"))


# ----------------------------------------------------------------------------- huggingface


@pytest.mark.slow  # ~5 s (a tokenizer.json trained and compared): the slow tier (fast-tier budget)
def test_huggingface_tokenizer_json_ids_identical(tmp_path, gpt2, texts):
    # GPT-2 as a tokenizer.json (what AutoTokenizer saves): same ids as the gpt2-bpe path
    hf = HFTokenizer(models.BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = T.load(
        "huggingface", tokenizer_file=str(tmp_path / "tokenizer.json"), eod="<|endoftext|>", expected_vocab_size=50257
    )
    assert (tok.vocab_size, tok.eod_id, tok.backend) == (50257, 50256, "tiktoken")  # the fast path
    ref = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    docs = all_documents()
    assert ids_of(tok, docs) == [ref.encode(t, add_special_tokens=False).ids for t in docs] == ids_of(gpt2, docs)

    # a BPE trained by tokenizers itself, with a post-processor that adds </s>
    from tokenizers import processors

    bpe = HFTokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(corpus()["botchan"], trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", "</s>"]))
    bpe.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    bpe.save(str(tmp_path / "bpe.json"))
    ref = HFTokenizer.from_file(str(tmp_path / "bpe.json"))
    ref.encode_special_tokens = True  # WikiText's "<unk>" in the text is text, not the special token
    for special in (False, True):
        tok = T.load("huggingface", tokenizer_file=str(tmp_path / "bpe.json"), eod="</s>", add_special_tokens=special)
        assert tok.eod_id == 1 and tok.backend == "tokenizers" and "pre-tokenizer Whitespace" in tok.encoder_reason
        assert ids_of(tok, texts) == [ref.encode(t, add_special_tokens=special).ids for t in texts]
    assert "<unk>" in texts[0]
    default = HFTokenizer.from_file(str(tmp_path / "bpe.json")).encode("a <unk> b", add_special_tokens=False).ids
    assert len(ids_of(tok, ["a <unk> b"])[0]) > len(default) == 3


# ----------------------------------------------------------------------------- load errors


def test_missing_or_broken_tokenizer_files_name_the_file(tmp_path):
    missing = str(tmp_path / "nope" / "vocab.json")
    with pytest.raises(T.TokenizerError, match=f"{missing}: GPT-2 vocab file"):
        T.load("gpt2-bpe", vocab_file=missing, merges_file=str(GPT2_MERGES))
    with pytest.raises(T.TokenizerError, match="merges.txt.*not found"):
        T.load("gpt2-bpe", vocab_file=str(GPT2_VOCAB), merges_file=str(tmp_path / "merges.txt"))
    with pytest.raises(T.TokenizerError, match=r"m\.model: SentencePiece model not found"):
        T.load("sentencepiece", model_file=str(tmp_path / "m.model"))
    with pytest.raises(T.TokenizerError, match=r"tokenizer\.json: tokenizer\.json not found"):
        T.load("huggingface", tokenizer_file=str(tmp_path / "tokenizer.json"), eod="</s>")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(T.TokenizerError, match="bad.model: not a SentencePiece model"):
        T.load("sentencepiece", model_file=str(bad))
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text("{not json")
    with pytest.raises(T.TokenizerError, match="vocab.json: not a JSON vocab"):
        T.load("gpt2-bpe", vocab_file=str(bad_json), merges_file=str(GPT2_MERGES))


def test_vocab_size_or_eod_disagreeing_with_config_is_an_error():
    with pytest.raises(
        T.TokenizerError, match=r"vocab\.json: the tokenizer has 50257 tokens but the config says vocab_size 50304"
    ):
        T.load("gpt2-bpe", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES), expected_vocab_size=50304)
    with pytest.raises(T.TokenizerError, match=r"vocab\.json: the EOD token '</s>' is not in the vocabulary"):
        T.load("gpt2-bpe", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES), eod="</s>")
    assert np.iinfo(np.uint16).max > 50257


CODE_LIKE = "def f(x):\n\tif x  >  1:\n\t\treturn 12345\n\n- a   b\n  indented\r\nend"


@pytest.mark.slow  # ~5 s (a tokenizer trained): the slow tier (fast-tier budget)
@pytest.mark.parametrize("model_type", ["bpe"])
def test_a_trained_tokenizer_keeps_newlines_tabs_runs_of_spaces_and_splits_digits(tmp_path, chunk_files, model_type):
    """Issue 42: SentencePiece's defaults (nmt_nfkc, extra whitespace removed) turned "a\\n\\nb" into "a b";
    the default normalization (preserve) gives the text back, as Llama's and Gemma's models do."""
    kw = dict(vocab_size=1000, model_type=model_type, threads=1, max_bytes=300_000)
    paths = [str(tmp_path / f) for f in ("p.model", "p.vocab", "p.json")]
    st = train_sentencepiece(chunk_files, *paths, **kw)
    assert st["settings"]["normalization_rule_name"] == "identity" and st["settings"]["byte_fallback"] is True
    tok = T.load("sentencepiece", model_file=paths[0])
    for text in (CODE_LIKE, "a\n\nb", "Ünïcödé 🦙 日本語"):
        assert tok.decode(tok.encode(text)) == text
    sp = spm.SentencePieceProcessor(model_file=paths[0])
    assert [p for p in sp.encode("12345", out_type=str) if p != "▁"] == ["1", "2", "3", "4", "5"]
    # SentencePiece's own defaults stay a named setting: newlines and runs of spaces are lost
    plain = [str(tmp_path / f) for f in ("s.model", "s.vocab", "s.json")]
    train_sentencepiece(chunk_files, *plain, normalization="sentencepiece", **kw)
    tok = T.load("sentencepiece", model_file=plain[0])
    assert tok.decode(tok.encode("a\n\nb   c")) == "a b c"
