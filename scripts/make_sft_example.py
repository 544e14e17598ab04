"""Build resources/sft/botchan-counts.jsonl: the fine-tuning example's templated task (deterministic).

Each record has a name and a word taken from the shipped Botchan corpus
(resources/corpus/botchan/botchan.jsonl, public domain), a number word from
"zero" to "eight" and the one after it: ``{"name", "word", "number", "next"}``.
The example config renders it through the template ``"{name} says {word} and
counts {number}"`` with ``next`` as the answer ("Kiyo says came and counts
four" -> "five"): counting on, with a name and a word in front that change from
record to record. The tiny default model cannot do it before fine-tuning and
learns it in seconds; the test split's records are combinations it never saw.
Number words rather than digits: the tiny model's 2k-token vocabulary has
well-trained embeddings for them, its digit embeddings barely differ.

Names: capitalised words of the novel that occur at least 5 times, never in
lowercase, and at least 3 times after a lowercase word or a comma (proper nouns);
words: the 120 most frequent lowercase alphabetic words of 4 to 8 letters (ties
alphabetical). Records are drawn with a fixed seed, each (name, word, number) at
most once. Rerunning the script gives the same file byte for byte:
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
OUT = ROOT / "resources" / "sft" / "botchan-counts.jsonl"
SEED = 1234
WORDS = 120
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_WORD = re.compile(r"[A-Za-z]+")


def vocab(text: str) -> tuple[list[str], list[str]]:
    """(names, words) of the corpus, sorted, by the rules in the module docstring."""
    counts = Counter(_WORD.findall(text))
    mid = Counter(re.findall(r"[a-z,] ([A-Z][a-z]+)", text))  # capitalised after a lowercase word or a comma
    names = sorted(
        w for w, c in counts.items() if c >= 5 and w.istitle() and len(w) >= 3 and not counts[w.lower()] and mid[w] >= 3
    )
    ranked = sorted((w for w in counts if w.islower() and 4 <= len(w) <= 8), key=lambda w: (-counts[w], w))
    words = sorted(ranked[:WORDS])
    return names, words


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 600
    text = "\n".join(json.loads(line)["text"] for line in SOURCE.read_text(encoding="utf-8").splitlines())
    names, words = vocab(text)
    rng = random.Random(SEED)
    seen: set[tuple[str, str, int]] = set()
    rows = []
    while len(rows) < n:
        key = (rng.choice(names), rng.choice(words), rng.randrange(9))
        if key not in seen:
            seen.add(key)
            rows.append({"name": key[0], "word": key[1], "number": NUMBERS[key[2]], "next": NUMBERS[key[2] + 1]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {len(rows)} records from {len(names)} names and {len(words)} words")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
