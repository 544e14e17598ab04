"""Write resources/sft/preferences.jsonl: a small synthetic preference set (the tiny DPO example's data).

Each pair asks for a short remark about a thing; the chosen completion praises it, the rejected one
disparages it, in one of several sentence shapes. The preference (praise over disparagement) holds on
things and shapes never seen in training, so held-out reward accuracy measures what DPO learned.
Deterministic: the same file every run (seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

THINGS = (
    "the garden",
    "the river",
    "this book",
    "the new bridge",
    "the old school",
    "the harbour",
    "our village",
    "the museum",
    "the market",
    "this song",
    "the forest",
    "the castle",
    "the library",
    "the mountain road",
    "the little cafe",
    "the train station",
    "this painting",
    "the festival",
    "the lake",
    "the bakery",
    "the hospital",
    "the park",
    "the theatre",
    "the island",
    "the farm",
    "the valley",
    "the lighthouse",
    "the orchard",
    "the bookshop",
    "the square",
    "the chapel",
    "the meadow",
    "the pier",
    "the tower",
    "the market hall",
    "the stadium",
    "the zoo",
    "the canal",
    "the beach",
    "the hills",
)
GOOD = ("wonderful", "lovely", "beautiful", "excellent", "delightful", "charming", "pleasant", "splendid")
BAD = ("terrible", "awful", "ugly", "dreadful", "horrible", "miserable", "nasty", "dismal")
PROMPTS = (
    "Tell me about {t}.",
    "What do you think of {t}?",
    "Describe {t} in one sentence.",
    "Give a short remark about {t}.",
)
SHAPES = ("{T} is {a}.", "I find {t} {a}.", "Honestly, {t} is {a}.", "{T} looks {a} today.")


def pairs(seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for t in THINGS:
        for p in PROMPTS:
            shape = rng.choice(SHAPES)
            fill = {"t": t, "T": t[0].upper() + t[1:]}
            out.append(
                {
                    "prompt": p.format(t=t) + "\n",
                    "chosen": shape.format(a=rng.choice(GOOD), **fill),
                    "rejected": shape.format(a=rng.choice(BAD), **fill),
                }
            )
    return out


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "resources" / "sft" / "preferences.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in pairs()), encoding="utf-8")
    print(f"{out}: {len(pairs())} pairs")


if __name__ == "__main__":
    main()
