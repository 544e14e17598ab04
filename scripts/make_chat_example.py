"""Build resources/sft/botchan-chat.jsonl: the chat fine-tuning example's conversations (deterministic).

Multi-turn conversations in OpenAI's ``messages`` shape over the counting task of
resources/sft/botchan-counts.jsonl (scripts/make_sft_example.py): a system prompt, the user's
"Kiyo says came and counts four", the assistant's "five", the user's "and then?" and the
assistant's "six". The held-out score is on the last reply, which needs the turn before it.
One record in twelve carries a third exchange ("and then?" -> "seven"), so conversations differ
in length. Number words from zero to seven, so that two or three steps on stay below "ten".
Rerunning the script gives the same file byte for byte: ``python scripts/make_chat_example.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "resources" / "sft" / "botchan-counts.jsonl"
OUT = ROOT / "resources" / "sft" / "botchan-chat.jsonl"
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SYSTEM = "Count on from the number."


def main(argv: list[str]) -> int:
    rows = []
    for k, line in enumerate(SOURCE.read_text(encoding="utf-8").splitlines()):
        r = json.loads(line)
        n = NUMBERS.index(r["number"])
        if n > 6:
            continue
        turns = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{r['name']} says {r['word']} and counts {r['number']}"},
            {"role": "assistant", "content": NUMBERS[n + 1]},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": NUMBERS[n + 2]},
        ]
        if k % 12 == 0 and n + 3 < len(NUMBERS):
            turns += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": NUMBERS[n + 3]}]
        rows.append({"messages": turns})
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {len(rows)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
