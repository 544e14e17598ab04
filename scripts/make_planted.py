#!/usr/bin/env python3
"""Write the planted duplicates of the embedded default's curation (resources/corpus/wikitext/planted/).

Usage: python scripts/make_planted.py (reads the shipped WikiText-2 shards; output is committed).

Four documents, each a copy of a shipped WikiText-2 article the curation must remove again:
an exact copy, a copy with a few words edited, one with its paragraphs in reverse order, and
one with boilerplate appended. config/config.yaml adds the shard to the wikitext source; it sorts
after the 16 shipped shards, so it lands in the last chunk and no other chunk changes.
Deterministic: the same shipped shards give the same bytes (zstd level 10).
"""

from __future__ import annotations

import json
from pathlib import Path

import zstandard

ROOT = Path(__file__).resolve().parent.parent
WIKI = ROOT / "resources" / "corpus" / "wikitext"
OUT = WIKI / "planted" / "example_train_0.jsonl.zst"
BOILERPLATE = (
    "Share this article on Facebook , Twitter or by e @-@ mail . Copyright 2016 Example Media . All rights "
    "reserved . Subscribe to our newsletter for more stories like this one ."
)


def read(shard: str) -> list[dict]:
    raw = zstandard.ZstdDecompressor().decompressobj().decompress((WIKI / shard).read_bytes())
    return [json.loads(line) for line in raw.splitlines()]


def edit_words(text: str, every: int = 400) -> str:
    """Replace one word in every ``every`` with another (a few words in a long article)."""
    words = text.split(" ")
    for i in range(every // 2, len(words), every):
        words[i] = "edited"
    return " ".join(words)


def planted() -> list[dict]:
    a = read("chunk1/example_train_0.jsonl.zst")[0]  # chunk-00000
    b = read("chunk1/example_train_3.jsonl.zst")[1]  # chunk-00000
    c = read("chunk2/example_train_1.jsonl.zst")[2]  # chunk-00001
    d = read("chunk2/example_train_5.jsonl.zst")[0]  # chunk-00002, the planted shard's own chunk
    return [
        {"text": a["text"], "meta": {"title": a["meta"]["title"], "planted": "exact copy"}},
        {"text": edit_words(b["text"]), "meta": {"title": b["meta"]["title"], "planted": "a few words edited"}},
        {
            "text": "\n".join(reversed(c["text"].split("\n"))),
            "meta": {"title": c["meta"]["title"], "planted": "paragraphs reversed"},
        },
        {"text": d["text"] + "\n" + BOILERPLATE, "meta": {"title": d["meta"]["title"], "planted": "boilerplate"}},
    ]


def main() -> None:
    body = b"".join(json.dumps(doc, ensure_ascii=False).encode() + b"\n" for doc in planted())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(zstandard.ZstdCompressor(level=10).compress(body))
    print(f"{OUT.relative_to(ROOT)}: {len(planted())} planted duplicates")


if __name__ == "__main__":
    main()
