"""``snakellm tokenize`` on real chunks: byte identity with megatron-core, and bad input.

The .bin/.idx of a chunk equal what megatron-core's IndexedDatasetBuilder
writes when fed reference token ids the way tools/preprocess_data.py
--append-eod feeds them; megatron's IndexedDataset reads them back to the
source text. Every bad input fails with the file named and leaves no output
(and an earlier good output untouched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import sentencepiece as spm
from tokenize_helpers import GPT2_MERGES, GPT2_VOCAB, REPO, corpus, openai_gpt2, write_jsonl
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from snakellm.steps.tokenize import main
from snakellm.tokenize import encoders as T
from snakellm.tokenize.encode import MIN_BLOCK, TokenizeError, read_blocks, tokenize_file
from snakellm.tokenize.sentencepiece_trainer import train_sentencepiece

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

GPT2_ARGS = ["--kind", "gpt2-bpe", "--name", "gpt2", "--vocab-file", str(GPT2_VOCAB), "--merges-file", str(GPT2_MERGES)]


def megatron_reference(prefix: str, docs_ids: list[list[int]], eod: int, vocab_size: int) -> None:
    """tools/preprocess_data.py --append-eod: add_document(ids + [eod], [len]) per document."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for ids in docs_ids:
        doc = ids + [eod] if ids else []
        builder.add_document(doc, [len(doc)] if doc else [])
    builder.finalize(prefix + ".idx")


def same_files(a: str, b: str) -> bool:
    return all(open(a + e, "rb").read() == open(b + e, "rb").read() for e in (".bin", ".idx"))


@pytest.fixture(scope="module")
def wiki_jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("in") / "wikitext.jsonl", corpus()["wikitext"])


@pytest.fixture(scope="module")
def gpt2():
    return T.load(
        "gpt2-bpe", name="gpt2", vocab_file=str(GPT2_VOCAB), merges_file=str(GPT2_MERGES), expected_vocab_size=50257
    )


@pytest.mark.slow  # 2.1 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
def test_gpt2_chunk_is_byte_identical_to_megatron_and_reads_back(tmp_path, wiki_jsonl, gpt2):
    docs = corpus()["wikitext"]
    prefix = str(tmp_path / "out" / "chunk-00000_text_document")
    # small batches and 2 threads: many batches in flight, written in order
    st = tokenize_file(
        str(wiki_jsonl),
        prefix,
        gpt2,
        threads=2,
        batch_bytes=20_000,
        source="wikitext",
        chunk="chunk-00000",
        show_progress=False,
    )
    ref_ids = [openai_gpt2().encode(t) for t in docs]
    megatron_reference(str(tmp_path / "ref"), ref_ids, 50256, 50257)
    assert same_files(prefix, str(tmp_path / "ref"))

    ds = IndexedDataset(prefix)
    assert ds.index.dtype == np.uint16 and len(ds) == len(docs)
    for i, text in enumerate(docs):
        seq = ds[i]
        assert seq[-1] == 50256 and 50256 not in seq[:-1]
        assert gpt2.decode(seq[:-1]) == text  # byte-level BPE: lossless
    tokens = sum(map(len, ref_ids)) + len(docs)
    assert st["documents"] == len(docs) == st["eod_tokens"] and st["tokens"] == tokens
    assert st["dtype"] == "uint16" and st["bin_bytes"] == 2 * tokens == os.path.getsize(prefix + ".bin")
    on_disk = json.loads(open(prefix + ".stats.json").read())
    assert on_disk["tokenizer"]["vocab_size"] == 50257 and on_disk["tokenizer"]["eod_id"] == 50256
    assert on_disk["tokenizer"]["backend"] == "tiktoken" and on_disk["source"] == "wikitext"
    assert sorted(os.listdir(tmp_path / "out")) == [
        f"chunk-00000_text_document{e}" for e in (".bin", ".idx", ".stats.json")
    ]


@pytest.mark.slow  # 1.0 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_threads_and_batch_size_do_not_change_the_output(tmp_path, wiki_jsonl, gpt2):
    runs = [(1, 1 << 22), (2, 7_000), (3, 100_000)]
    for n, (threads, batch) in enumerate(runs):
        tokenize_file(
            str(wiki_jsonl), str(tmp_path / f"r{n}"), gpt2, threads=threads, batch_bytes=batch, show_progress=False
        )
    assert same_files(str(tmp_path / "r0"), str(tmp_path / "r1")) and same_files(
        str(tmp_path / "r0"), str(tmp_path / "r2")
    )


def test_blocks_are_whole_lines_and_shrink_towards_the_end(tmp_path):
    """The reader's blocks cover the file exactly, end at a newline, and get smaller near the end of the file
    (so the encoder threads finish together), never below MIN_BLOCK (less a line) but for the last."""
    rows = [b'{"text": "%s"}' % (b"x" * (i * 7919 % 3000)) for i in range(2000)]
    data = b"\n".join(rows) + b"\n"
    src = tmp_path / "c.jsonl"
    src.write_bytes(data)
    blocks = list(read_blocks(str(src), 400_000, threads=2))
    assert b"".join(blocks) == data and all(b.endswith(b"\n") for b in blocks)
    sizes = [len(b) for b in blocks]
    assert max(sizes) < 400_000 + 3100 and sizes[-3] < 200_000 and min(sizes[:-1]) >= MIN_BLOCK - 3100, sizes
    src.write_bytes(data + b'{"text": "no newline"}')  # a last line without a newline; a line longer than a block
    assert b"".join(read_blocks(str(src), 1000, threads=2)) == data + b'{"text": "no newline"}'


def test_each_encoder_thread_gets_an_encoding_of_its_own(gpt2):
    """tiktoken's regex caches have a fast path only for the first thread using them: each worker thread gets its
    own Encoding (built by prepare_threads, at load), with the same ids."""
    import threading

    gpt2.prepare_threads(2)
    text = "Tokenize me, twice: 12345 \u00e9\u00e8 \U0001f600  end"
    seen: dict[str, tuple[int, list[int]]] = {}

    def work(name: str) -> None:
        seen[name] = (id(gpt2._threads.get()), gpt2.encode(text))

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"][0] != seen["b"][0]  # two Encoding objects
    assert seen["a"][1] == seen["b"][1] == openai_gpt2().encode(text)


def test_sentencepiece_chunk_is_byte_identical_to_megatron(tmp_path, wiki_jsonl):
    botchan = write_jsonl(tmp_path / "botchan.jsonl", corpus()["botchan"], key="content")
    model = tmp_path / "sp.model"
    train_sentencepiece(
        [(str(botchan), "content")], str(model), str(tmp_path / "sp.vocab"), str(tmp_path / "sp.json"), vocab_size=2000
    )
    prefix = str(tmp_path / "sp_text_document")
    rc = main(
        [
            str(botchan),
            prefix,
            "--key",
            "content",
            "--threads",
            "2",
            "--batch-mb",
            "0.02",
            "--no-progress",
            "--kind",
            "sentencepiece",
            "--model-file",
            str(model),
            "--vocab-size",
            "2000",
        ]
    )
    assert rc == 0
    sp = spm.SentencePieceProcessor(model_file=str(model))
    megatron_reference(str(tmp_path / "ref"), [sp.encode_as_ids(t) for t in corpus()["botchan"]], sp.eos_id(), 2000)
    assert same_files(prefix, str(tmp_path / "ref"))
    assert len(IndexedDataset(prefix)) == len(corpus()["botchan"])


def test_documents_without_tokens_follow_preprocess_data(tmp_path):
    """A document that encodes to nothing gets no EOD and no sequence; its document index repeats."""
    model = tmp_path / "sp.model"
    src = write_jsonl(tmp_path / "b.jsonl", corpus()["botchan"])
    train_sentencepiece(
        [(str(src), "text")],
        str(model),
        str(tmp_path / "sp.vocab"),
        str(tmp_path / "sp.json"),
        vocab_size=500,
        normalization="sentencepiece",  # SentencePiece's own NFKC
    )
    texts = ["first document", "\u200b", "third document"]  # NFKC drops the zero-width space: no ids
    write_jsonl(tmp_path / "c.jsonl", texts)
    tok = T.load("sentencepiece", model_file=str(model))
    st = tokenize_file(str(tmp_path / "c.jsonl"), str(tmp_path / "c"), tok, show_progress=False)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert sp.encode_as_ids(texts[1]) == []
    megatron_reference(str(tmp_path / "ref"), [sp.encode_as_ids(t) for t in texts], sp.eos_id(), 500)
    assert same_files(str(tmp_path / "c"), str(tmp_path / "ref"))
    assert (st["documents"], st["empty_documents"], st["sequences"]) == (3, 1, 2)


# ----------------------------------------------------------------------------- bad input


def outputs_in(d) -> list[str]:
    return sorted(p for p in os.listdir(d) if not p.endswith(".jsonl"))


def test_token_id_that_does_not_fit_the_dtype(tmp_path, capsys):
    """A broken tokenizer.json: 3 tokens (so uint16) but an id of 70000, which uint16 would silently wrap."""
    tj = tmp_path / "tokenizer.json"
    wl = HFTokenizer(models.WordLevel({"[UNK]": 0, "<eod>": 1, "hello": 70000}, unk_token="[UNK]"))
    from tokenizers import pre_tokenizers

    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.save(str(tj))
    src = write_jsonl(tmp_path / "c.jsonl", ["oh", "oh hello"])
    rc = main(
        [
            str(src),
            str(tmp_path / "c_text_document"),
            "--no-progress",
            "--kind",
            "huggingface",
            "--tokenizer-file",
            str(tj),
            "--eod",
            "<eod>",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{src}:2: token id 70000 is outside the vocabulary of 3 tokens of {tj}" in err
    assert "does not fit the dataset dtype uint16" in err
    assert outputs_in(tmp_path) == ["tokenizer.json"]


def test_vocab_disagreeing_with_config(tmp_path, wiki_jsonl, capsys):
    rc = main([str(wiki_jsonl), str(tmp_path / "x"), *GPT2_ARGS, "--vocab-size", "32000"])
    assert rc == 1
    assert (
        f"{GPT2_VOCAB}: the tokenizer has 50257 tokens but the config says vocab_size 32000" in capsys.readouterr().err
    )
    assert outputs_in(tmp_path) == []


def test_empty_chunk(tmp_path, capsys):
    for name, content in [("empty.jsonl", b""), ("blank.jsonl", b"\n\n  \n")]:
        (tmp_path / name).write_bytes(content)
        rc = main([str(tmp_path / name), str(tmp_path / "x"), "--no-progress", *GPT2_ARGS])
        assert rc == 1
        assert f"{tmp_path / name}: no documents to tokenize (empty chunk)" in capsys.readouterr().err
    assert outputs_in(tmp_path) == []


def test_missing_tokenizer_file(tmp_path, wiki_jsonl, capsys):
    missing = tmp_path / "tokenizers" / "spm" / "tokenizer.model"
    rc = main([str(wiki_jsonl), str(tmp_path / "x"), "--kind", "sentencepiece", "--model-file", str(missing)])
    assert rc == 1
    assert f"{missing}: SentencePiece model not found" in capsys.readouterr().err
    assert outputs_in(tmp_path) == []


def test_bad_json_names_file_and_line_and_keeps_the_previous_output(tmp_path, gpt2, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", ["one", "two"])
    prefix = str(tmp_path / "c_text_document")
    tokenize_file(str(src), prefix, gpt2, show_progress=False)
    before = {e: open(prefix + e, "rb").read() for e in (".bin", ".idx", ".stats.json")}
    with open(src, "ab") as fh:
        fh.write(b'{"text": "three"}\n{"text": 4}\n')
    with pytest.raises(TokenizeError, match=rf"{src}:4: no string under key 'text'"):
        tokenize_file(str(src), prefix, gpt2, show_progress=False)
    with open(src, "ab") as fh:
        fh.write(b"{broken\n")
    rc = main([str(src), prefix, "--no-progress", *GPT2_ARGS])
    assert rc == 1 and f"{src}:4:" in capsys.readouterr().err
    assert {e: open(prefix + e, "rb").read() for e in before} == before  # the old complete output, untouched
    assert outputs_in(tmp_path) == sorted(os.path.basename(prefix) + e for e in before)


# ----------------------------------------------------------------------------- memory


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_chunk(tmp_path):
    """Tokenize a 3 MB and a 30 MB chunk in fresh processes: peak RSS stays within a few MB.

    (Holding the chunk would cost 30 MB of text plus 7M token ids.)
    """
    docs = list(corpus()["wikitext"]) + list(corpus()["botchan"])
    one = sum(len(d) for d in docs)
    rss = {}
    for mb in (3, 30):
        src = write_jsonl(tmp_path / f"{mb}.jsonl", docs * max(1, round(mb * 1e6 / one)))
        code = (
            "import sys; from snakellm.steps.tokenize import main; "
            f"rc = main({[str(src), str(tmp_path / f'o{mb}'), '--no-progress', '--threads', '2', *GPT2_ARGS]!r}); "
            # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent (pytest)
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]); sys.exit(rc)"
        )
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        rss[mb] = int(out.stdout.split()[-1]) / 1024  # MiB
    assert rss[30] - rss[3] < 16, rss
