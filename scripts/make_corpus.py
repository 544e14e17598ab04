#!/usr/bin/env python3
"""Build the shipped corpus under resources/corpus from the original files (run once; output is committed).

Usage: python scripts/make_corpus.py SOURCE_DIR, where SOURCE_DIR holds the originals named in
resources/README.md (WikiText-2's test split as
wikitext-2-test.txt, botchan.txt).

- wikitext: WikiText-2 (raw, test split), one document per article, 62 articles in 16
  zstd shards laid out like SlimPajama: chunk{1,2}/example_train_{0..7}.jsonl.zst
- botchan: Botchan (Project Gutenberg #8868), one plain .jsonl, one document per
  ~30-line section of each chapter.

Deterministic: the same inputs give the same bytes (zstd level 10, no timestamps).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import zstandard

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "resources" / "corpus"


def wikitext_articles(path: Path) -> list[dict]:
    arts: list[dict] = []
    title, lines = None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^ = ([^=].*[^=]) = $", line)
        if m:
            if title is not None:
                arts.append({"text": "\n".join(ln.strip() for ln in lines if ln.strip()), "meta": {"title": title}})
            title, lines = m.group(1), []
        else:
            lines.append(line)
    if title is not None:
        arts.append({"text": "\n".join(ln.strip() for ln in lines if ln.strip()), "meta": {"title": title}})
    return arts


def botchan_docs(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    docs, cur = [], []
    for line in lines:
        if line.startswith("CHAPTER") and cur:
            docs.append(cur)
            cur = []
        cur.append(line)
        if len(cur) >= 30 and not line.startswith("CHAPTER"):
            docs.append(cur)
            cur = []
    if cur:
        docs.append(cur)
    return [{"text": "\n".join(d), "meta": {"part": i}} for i, d in enumerate(docs) if "".join(d).strip()]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/make_corpus.py SOURCE_DIR  (holding wikitext-2-test.txt and botchan.txt)")
    src = Path(sys.argv[1])
    cctx = zstandard.ZstdCompressor(level=10, write_checksum=True)
    arts = wikitext_articles(src / "wikitext-2-test.txt")
    assert len(arts) == 62, len(arts)  # 62 " = Title = " lines in the test split
    for i in range(16):
        d = OUT / "wikitext" / f"chunk{1 + i // 8}"
        d.mkdir(parents=True, exist_ok=True)
        payload = "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in arts[4 * i : 4 * i + 4])
        (d / f"example_train_{i % 8}.jsonl.zst").write_bytes(cctx.compress(payload.encode()))
    docs = botchan_docs(src / "botchan.txt")
    (OUT / "botchan").mkdir(parents=True, exist_ok=True)
    with open(OUT / "botchan" / "botchan.jsonl", "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(f"wikitext: {len(arts)} articles in 16 shards; botchan: {len(docs)} documents")


if __name__ == "__main__":
    main()
