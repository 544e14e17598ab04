"""Shared pieces of the tokenize-stage tests: the shipped corpus as documents,
jsonl writing, and an independent reference GPT-2 BPE.

``OpenAIGPT2`` is OpenAI's ``gpt-2/src/encoder.py`` algorithm, which Megatron-LM's
legacy ``GPT2BPETokenizer`` (megatron/training/tokenizer/gpt2_tokenization.py)
copies: the ground truth that tiktoken, tokenizers and transformers must agree with.
It shares no code with snakellm.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import orjson
import regex

from snakellm.io.readers import open_shard

REPO = Path(__file__).resolve().parent.parent
GPT2_VOCAB = REPO / "resources" / "tokenizers" / "gpt2" / "vocab.json"
GPT2_MERGES = REPO / "resources" / "tokenizers" / "gpt2" / "merges.txt"
WIKITEXT_SHARDS = sorted((REPO / "resources" / "corpus" / "wikitext").glob("chunk*/example_train_*.jsonl.zst"))
BOTCHAN = REPO / "resources" / "corpus" / "botchan" / "botchan.jsonl"


def read_shard(path: Path, key: str = "text") -> list[str]:
    with open_shard(str(path)) as fh:
        return [orjson.loads(line)[key] for line in fh if line.strip()]


@lru_cache(maxsize=None)
def corpus() -> dict[str, tuple[str, ...]]:
    """{source: documents} of the whole shipped corpus (62 WikiText-2 articles, 149 Botchan sections)."""
    wiki = [d for s in WIKITEXT_SHARDS for d in read_shard(s)]
    return {"wikitext": tuple(wiki), "botchan": tuple(read_shard(BOTCHAN))}


def all_documents() -> list[str]:
    return [d for docs in corpus().values() for d in docs]


def write_jsonl(path: Path, texts, key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for t in texts:
            fh.write(orjson.dumps({key: t}) + b"\n")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


class OpenAIGPT2:
    """OpenAI's reference byte-level BPE encoder (gpt-2/src/encoder.py), special tokens not special."""

    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_file: Path, merges_file: Path) -> None:
        self.encoder = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        merges = Path(merges_file).read_text(encoding="utf-8").split("\n")[1:-1]
        self.bpe_ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.cache: dict[str, list[int]] = {}

    def _bpe(self, token: str) -> list[int]:
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            bigram = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new: list[str] = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new.extend(word[i:])
                    break
                new.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
        ids = [self.encoder[t] for t in word]
        self.cache[token] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for tok in regex.findall(self.pat, text):
            ids.extend(self._bpe("".join(self.byte_encoder[b] for b in tok.encode("utf-8"))))
        return ids


@lru_cache(maxsize=None)
def openai_gpt2() -> OpenAIGPT2:
    return OpenAIGPT2(GPT2_VOCAB, GPT2_MERGES)
