"""Build resources/sft/botchan-words.jsonl: the fine-tuning example's templated task (deterministic).

Each record pairs a name and a word taken from the shipped Botchan corpus
(resources/corpus/botchan/botchan.jsonl, public domain): ``{"name", "word"}``.
The example config renders it through the template
``"{name}'s word is {word}. What is {name}'s word? Answer:"`` with ``word`` as the
answer: a one-fact reading-comprehension task (the answer is in the prompt, as in
SQuAD) that the tiny default model cannot do before fine-tuning and learns in
seconds, and that generalises to pairs it never saw (the test split's).

Names: capitalised words of the novel that occur at least 5 times, never in
lowercase, and at least 3 times after a lowercase word or a comma (proper nouns); words: lowercase alphabetic words of 4 to 8 letters occurring at least
5 times. Pairs are drawn with a fixed seed, each name-word pair at most once.
Rerunning the script gives the same file byte for byte:
``python scripts/make_sft_example.py [RECORDS]`` (default 600).
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "resources" / "corpus" / "botchan" / "botchan.jsonl"
OUT = ROOT / "resources" / "sft" / "botchan-words.jsonl"
SEED = 1234
_WORD = re.compile(r"[A-Za-z]+")


def vocab(text: str) -> tuple[list[str], list[str]]:
    """(names, words) of the corpus, sorted, by the rules in the module docstring."""
    counts = Counter(_WORD.findall(text))
    mid = Counter(re.findall(r"[a-z,] ([A-Z][a-z]+)", text))  # capitalised after a lowercase word or a comma
    names = sorted(
        w
        for w, c in counts.items()
        if c >= 5 and w.istitle() and len(w) >= 3 and not counts[w.lower()] and mid[w] >= 3
    )
    words = sorted(w for w, c in counts.items() if c >= 5 and w.islower() and 4 <= len(w) <= 8)
    return names, words


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 600
    text = "\n".join(json.loads(line)["text"] for line in SOURCE.read_text(encoding="utf-8").splitlines())
    names, words = vocab(text)
    rng = random.Random(SEED)
    seen: set[tuple[str, str]] = set()
    rows = []
    while len(rows) < n:
        pair = (rng.choice(names), rng.choice(words))
        if pair not in seen:
            seen.add(pair)
            rows.append({"name": pair[0], "word": pair[1]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {len(rows)} records from {len(names)} names and {len(words)} words")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
