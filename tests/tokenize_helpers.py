"""Shared pieces of the tokenize-stage tests: the shipped corpus as documents,
jsonl writing, and an independent reference GPT-2 BPE.

``OpenAIGPT2`` is OpenAI's ``gpt-2/src/encoder.py`` algorithm, which Megatron-LM's
legacy ``GPT2BPETokenizer`` (megatron/training/tokenizer/gpt2_tokenization.py)
copies: the ground truth that tiktoken, tokenizers and transformers must agree with.
It shares no code with snakellm.
"""

from __future__ import annotations

import json
from functools import cache
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


@cache
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
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


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
            pairs = set(zip(word, word[1:], strict=False))
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


@cache
def openai_gpt2() -> OpenAIGPT2:
    return OpenAIGPT2(GPT2_VOCAB, GPT2_MERGES)


# ----------------------------------------------------------------------------- tokenizer.json families

ENWIKI = REPO / "resources" / "wikipedia" / "enwiki-pages-articles-excerpt.xml.bz2"
# the split regexes of the families' tokenizer.json files (Llama 3 = tiktoken's cl100k; Qwen 2: single digits)
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# generated strings for what the shipped corpora have little of
HARD_TEXTS = [
    "Deutsch: Größenmaßstäbe, Straße; français: œuvre, garçon, élève; Tiếng Việt: Xin chào thế giới",
    "Русский текст с ёлкой; Ελληνικά: καλημέρα κόσμε; עברית: שלום עולם; العربية: مرحبا بالعالم ١٢٣٤٥",
    "हिन्दी: नमस्ते दुनिया; ไทย: สวัสดีชาวโลก; 中文：你好，世界！日本語：こんにちは、世界。한국어: 안녕하세요 세계",
    "decomposed: e\u0301te\u0301, \u1100\u1161\u11a8 (Hangul jamo), A\u030a, compatibility: ﬁ ① ｶ",
    "emoji: 🦙🦙🦙 👩‍👩‍👧‍👦 🇯🇵🇫🇷 👍🏽 1️⃣ ❤️‍🔥 🏳️‍🌈 and a lone variation selector \ufe0f",
    "def f(x):\n    if x > 0:\n\treturn {'a': [1, 2, 3]}  # tab and spaces\n    return None\r\n\r\n",
    'int main(void) { printf("%d\\n", 42); return 0; }\n\n\n{"key": [true, null, 1.5e-3]}',
    " " * 64 + "x" + "\t" * 17 + "y" + "\n" * 12 + "z" + " \n \n \n" + "\u00a0\u2003\u3000\u2009 " * 5 + "   ",
    "1234567890" * 12 + " 3.14159265358979 1,000,000 007 ١٢٣ ١٢٣٤ ۱۲۳ １２３４ ²³ ½ Ⅻ",
    "DON'T I'M WE'LL THEY'VE YOU'RE HE'D it's 'tis ''quoted'' Don'T",
    "\u200b zero width, \x00 NUL, \ufeff BOM, \u2028 line separator, \x85 NEL, \r lone CR",
    "",
    "   ",
]


def enwiki_texts() -> list[str]:
    """The raw wikitext of every page of the shipped Wikipedia dump excerpt (templates, tables, interwiki links)."""
    import bz2
    import xml.etree.ElementTree as ET

    texts = []
    with bz2.open(ENWIKI) as fh:
        for _, el in ET.iterparse(fh):
            if el.tag.endswith("}text") and el.text:
                texts.append(el.text)
            el.clear()
    return texts


def train_bytelevel_bpe(
    path: Path,
    docs,
    vocab_size: int,
    *,
    pattern: str | None = None,
    nfc: bool = False,
    ignore_merges: bool = False,
    specials: tuple[str, ...] = (),
    bos: str | None = None,
) -> Path:
    """Train a byte-level BPE with `tokenizers` in a family's shape and save it as tokenizer.json.

    pattern None: GPT-2's (ByteLevel use_regex=true, GPT-2 and GPT-NeoX); else Split(pattern) + ByteLevel
    (Llama 3, Qwen 2). Special tokens get the ids after the vocabulary, as in the released files;
    ``bos``: a TemplateProcessing post-processor that puts it before every text (Llama 3).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(docs, trainer)
    tok.add_special_tokens(list(specials))
    if bos:
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tok.token_to_id(bos))],
                ),
            ]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
