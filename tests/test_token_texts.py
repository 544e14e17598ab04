"""OpenAI's log-prob token strings (issue 42): for every tokenizer kind they concatenate to the text.

``snakellm.serve.sampling.token_texts`` spells each token as the text it adds (``' upon'``, a leading space
kept, where SentencePiece's one-piece decode says ``'upon'``), as OpenAI's and vLLM's ``tokens`` do; the
``top_logprobs`` keys are spelt the same way at the same place; a token inside a character is ``bytes:\\xNN``.
The slow test asks a real server, one per kind, with ``echo`` and ``logprobs``, streamed and not.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from tokenize_helpers import GPT2_MERGES, GPT2_VOCAB, corpus, train_bytelevel_bpe, write_jsonl

from snakellm.serve.sampling import alternative_texts, text_offsets, token_texts
from snakellm.tokenize import encoders as T

TEXTS = [
    "Once upon a time",
    "  two leading spaces, a\ttab and   three spaces",
    "line one\nline two\n\nafter a blank line",
    "digits 1234 and 3.14, Ünïcödé",
]


def _metaspace_json(path, docs):
    """A tokenizer.json in SentencePiece's spelling (Metaspace ``▁``, byte fallback), as Llama 2's is."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # training only: words
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>", *alphabet], show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from snakellm.tokenize.sentencepiece_trainer import train_sentencepiece

    d = tmp_path_factory.mktemp("toks")
    docs = list(corpus()["botchan"])
    jsonl = write_jsonl(d / "b.jsonl", docs)
    train_sentencepiece(
        [(str(jsonl), "text")],
        str(d / "sp.model"),
        str(d / "sp.vocab"),
        str(d / "sp.json"),
        vocab_size=600,
        byte_fallback=True,
        options={"normalization_rule_name": "identity", "remove_extra_whitespaces": "false"},  # the text kept
    )
    return {
        "gpt2-bpe": T.load("gpt2-bpe", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES)),
        "sentencepiece": T.load("sentencepiece", model_file=str(d / "sp.model")),
        "huggingface-bytelevel": T.load(
            "huggingface", tokenizer_file=str(train_bytelevel_bpe(d / "bl.json", docs, 600)), eod="a"
        ),
        "huggingface-metaspace": T.load(
            "huggingface", tokenizer_file=str(_metaspace_json(d / "ms.json", docs)), eod="</s>"
        ),
    }


def _raw(token: str) -> bytes:
    """A token string's bytes: ``bytes:\\xNN...`` spelt out, else its UTF-8."""
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


KINDS = ["gpt2-bpe", "sentencepiece", "huggingface-bytelevel", "huggingface-metaspace"]


@pytest.mark.parametrize("kind", KINDS)
def test_token_strings_join_into_the_text_and_match_the_offsets(tokenizers, kind):
    tok = tokenizers[kind]
    for text in TEXTS:
        ids = [int(i) for i in tok.encode_batch([text])[0]]
        tokens = token_texts(tok, ids)
        assert b"".join(map(_raw, tokens)) == tok.decode(ids).encode(), (kind, text, tokens)
        if text.isascii():
            assert "".join(tokens) == tok.decode(ids) == text, (kind, text, tokens)
            assert text_offsets(tok, ids) == [len("".join(tokens[:i])) for i in range(len(ids))]
        # a window of tokens (a stream chunk) is spelt as in the whole
        assert [token_texts(tok, ids, i, i + 1)[0] for i in range(len(ids))] == tokens
        # top_logprobs' key of the chosen token is its tokens entry
        for i in range(len(ids)):
            assert alternative_texts(tok, ids, i, [ids[i]]) == [tokens[i]]
    ids = [int(i) for i in tok.encode_batch(["Once upon a time"])[0]]
    assert "".join(token_texts(tok, ids)) == "Once upon a time"
    assert " upon" in token_texts(tok, ids) or " up" in token_texts(tok, ids)


def test_a_token_inside_a_character_is_shown_as_openai_shows_it(tokenizers):
    tok = tokenizers["gpt2-bpe"]
    ids = tok.encode("🦙")  # four bytes, split over tokens
    assert len(ids) > 1
    tokens = token_texts(tok, ids)
    assert all(t.startswith("bytes:\\x") for t in tokens)
    assert b"".join(map(_raw, tokens)) == "🦙".encode()


# ---------------------------------------------------------------- through a real server, one per kind


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2-bpe", "sentencepiece", "huggingface"])
def test_served_echo_logprobs_join_into_the_prompt(tokenizers, tmp_path, kind):
    pytest.importorskip("torch")
    from hf_helpers import random_checkpoint
    from serve_helpers import ServerProcess, call

    tok = tokenizers[{"huggingface": "huggingface-metaspace"}.get(kind, kind)]
    run = tmp_path / "run"
    random_checkpoint(run, {}, tok.info(), seed=3)
    server = ServerProcess(run, "--quiet", "--model-name", "m", cwd=tmp_path)
    try:
        for prompt in ("Once upon a time", "a\n\nb  c"):
            if tok.decode(tok.encode_batch([prompt])[0]) != prompt:
                continue  # a normalizing tokenizer does not give this prompt back
            body = {"model": "m", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
            status, r = call(server.url, "/v1/completions", body, method="POST")
            assert status == 200, r
            lp = r["choices"][0]["logprobs"]
            assert "".join(lp["tokens"]) == r["choices"][0]["text"] == prompt, lp["tokens"]
            assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
            for t, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
                assert t in top and "" not in top
            # streamed, with three generated tokens: the chunks' tokens join into prompt + completion
            body.update(max_tokens=3, temperature=0, stream=True)
            req = urllib.request.Request(
                server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw = resp.read().decode()
            events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            toks = [
                t
                for e in events
                if e["choices"] and e["choices"][0]["logprobs"]
                for t in e["choices"][0]["logprobs"]["tokens"]
            ]
            n = len(lp["tokens"])
            assert text.startswith(prompt) and toks[:n] == lp["tokens"] and len(toks) == n + 3, (toks, text)
            # a random model's completion may hold bytes of characters: compare bytes
            assert b"".join(map(_raw, toks[n:])).decode(errors="replace") == text[len(prompt) :]
    finally:
        server.stop()
