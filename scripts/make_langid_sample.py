#!/usr/bin/env python3
"""Build resources/langid/postgres-messages.jsonl: labelled text in 12 languages for measuring language ID.

Usage: python scripts/make_langid_sample.py [LOCALE_DIR] (default /usr/share/locale; output is committed).

PostgreSQL 15's server messages (Debian's postgresql-15 package, postgres-15.mo, PostgreSQL licence) and
their translations: for each language, 40 messages of at least 60 characters, evenly spaced over the
catalogue sorted by message id, printf placeholders removed; English from the same messages' ids.
Deterministic: the same catalogues give the same bytes.
"""

from __future__ import annotations

import gettext
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "resources" / "langid" / "postgres-messages.jsonl"
LANGS = {"de": "de", "es": "es", "fr": "fr", "it": "it", "ja": "ja", "ka": "ka", "ko": "ko", "ru": "ru"}
LANGS.update({"sv": "sv", "uk": "uk", "zh_CN": "zh"})
PER_LANGUAGE = 40
PLACEHOLDER = re.compile(r"\"?%[-+ #0-9.*]*[hlLqjzt]*[sdiuoxXfFeEgGcp%]\"?")


def clean(text: str) -> str:
    return " ".join(PLACEHOLDER.sub("", text).split())


def catalog(root: Path, locale: str) -> list[tuple[str, str]]:
    with open(root / locale / "LC_MESSAGES" / "postgres-15.mo", "rb") as fh:
        cat = gettext.GNUTranslations(fh)._catalog  # type: ignore[attr-defined]
    pairs = []
    for k, v in cat.items():
        if isinstance(k, str) and k and isinstance(v, str):
            a, b = clean(k), clean(v)
            if len(a) >= 60 and len(b) >= 60 and a != b:
                pairs.append((a, b))
    return sorted(pairs)


def pick(items: list, n: int) -> list:
    return [items[i * len(items) // n] for i in range(n)] if len(items) > n else items


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/usr/share/locale")
    rows = []
    english = catalog(root, "de")
    rows += [{"lang": "en", "text": en} for en, _ in pick(english, PER_LANGUAGE)]
    for locale, code in LANGS.items():
        rows += [{"lang": code, "text": t} for _, t in pick(catalog(root, locale), PER_LANGUAGE)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {len(rows)} texts in {len(LANGS) + 1} languages")


if __name__ == "__main__":
    main()
