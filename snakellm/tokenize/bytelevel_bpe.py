"""Express a byte-level BPE ``tokenizer.json`` exactly as a tiktoken encoding, or say why not.

Llama 3, Qwen 2, GPT-NeoX/Pythia and GPT-2 ship ``tokenizer.json`` files that are
byte-level BPE: a regex splits the text into pieces, each piece's UTF-8 bytes are
mapped to printable characters (``ByteLevel``) and merged by BPE. tiktoken runs the
same algorithm about 3x faster, so ``plan`` builds a ``tiktoken.Encoding`` from the
file's vocabulary, merges, split pattern and special tokens when, and only when,
every part of the file has an exact tiktoken equivalent:

* normalizer: none, or NFC (applied with ``unicodedata.normalize`` before encoding);
* pre-tokenizer: ``ByteLevel(use_regex=true)`` (GPT-2's pattern) or
  ``Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]`` (Llama 3, Qwen 2),
  never ``add_prefix_space``;
* model: BPE over the 256 byte symbols, no byte fallback, dropout, subword prefix or
  word suffix; decoder ``ByteLevel``;
* merges whose results have ids in merge order (tiktoken merges by the result's id,
  tokenizers by the merge's line: the same order only then) and no token that only
  tiktoken could merge into (a non-byte token no merge produces);
* ``ignore_merges``: tiktoken always returns a piece found whole in the vocabulary
  (``ignore_merges: true``, Llama 3); with ``false`` that is the same only when every
  token's own merges rebuild it, which is checked by running the merges on every token;
* added tokens: only special ones (they are never matched in document text here; see
  README), and a post-processor that adds fixed tokens around a text (BOS/EOS via
  ``TemplateProcessing``) when ``add_special_tokens`` is asked for.

One difference cannot be ruled out from the file alone: tiktoken merges *any* adjacent
pair whose concatenation is a token, tokenizers only the listed merges. GPT-2 and every
trained file in the tests have tens of thousands of such unlisted splits and still give
identical ids on all the shipped text (BPE training only learns merges of pairs its own
merge order produces), but a hand-edited file can differ (the tests build one), and the
two libraries' Unicode tables (regex classes, NFC) may differ on rare characters; so
``snakellm tokenize`` compares ids with ``tokenizers`` on a sample of every chunk and
falls back when they differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from snakellm.errors import StepFailed


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as in ``encoder.py``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


# tokenizers' ByteLevel(use_regex=true) pattern (pre_tokenizers/byte_level.rs), as tiktoken writes it
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass
class Plan:
    """Everything the tiktoken path needs; ``reason`` says why it is exact."""

    encoding: Any  # tiktoken.Encoding
    nfc: bool
    prefix: list[int] = field(default_factory=list)  # post-processor tokens before / after each text
    suffix: list[int] = field(default_factory=list)
    reason: str = ""
    build: Any = None  # () -> another tiktoken.Encoding equal to ``encoding`` (one per encoder thread)


class NotExpressible(StepFailed):
    """The file has a part tiktoken cannot reproduce exactly (the message says which)."""


def _type(part: Any) -> str | None:
    return part.get("type") if isinstance(part, dict) else None


def _parts(part: Any, key: str) -> list[dict]:
    """The members of a ``Sequence`` (under ``key``), the part alone, or nothing for null."""
    if part is None:
        return []
    if _type(part) == "Sequence":
        return [p for p in part.get(key) or [] if isinstance(p, dict)]
    return [part] if isinstance(part, dict) else []


def _normalizer(spec: dict) -> bool:
    """True for NFC, False for none; anything else is not expressible."""
    parts = _parts(spec.get("normalizer"), "normalizers")
    kinds = [_type(p) for p in parts]
    if kinds == []:
        return False
    if kinds == ["NFC"]:
        return True
    raise NotExpressible(f"normalizer {'+'.join(map(str, kinds))} (only none or NFC can be applied before tiktoken)")


def _byte_level(p: dict, use_regex: bool) -> None:
    if p.get("add_prefix_space"):
        raise NotExpressible("ByteLevel pre-tokenizer with add_prefix_space")
    if bool(p.get("use_regex", True)) != use_regex:
        raise NotExpressible(f"ByteLevel pre-tokenizer with use_regex={p.get('use_regex', True)} in this position")


def _pattern(spec: dict) -> str:
    """The split regex of the pre-tokenizer."""
    parts = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    kinds = [_type(p) for p in parts]
    if kinds == ["ByteLevel"]:
        _byte_level(parts[0], use_regex=True)
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"]:
        split, bl = parts
        _byte_level(bl, use_regex=False)
        pat = split.get("pattern") or {}
        if "Regex" not in pat:
            raise NotExpressible("Split pre-tokenizer on a literal string (only a regex split is expressible)")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise NotExpressible(
                f"Split pre-tokenizer with behavior {split.get('behavior')}, invert {split.get('invert')}"
            )
        return str(pat["Regex"])
    raise NotExpressible(f"pre-tokenizer {'+'.join(map(str, kinds))} (expected ByteLevel or Split(regex)+ByteLevel)")


def _merges(model: dict) -> list[tuple[str, str]]:
    raw = model.get("merges") or []
    out = [tuple(m) if isinstance(m, list) else tuple(str(m).split(" ")) for m in raw]  # [a, b] or "a b"
    for k, pair in enumerate(out):
        if len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise NotExpressible(f"merge {k + 1} {raw[k]!r} is not a pair of symbols")
    return out  # type: ignore[return-value]


def _post_tokens(spec: dict, specials: dict[str, int]) -> tuple[list[int], list[int]]:
    """Ids the post-processor puts before and after a single text (add_special_tokens)."""
    parts = _parts(spec.get("post_processor"), "processors")
    prefix: list[int] = []
    suffix: list[int] = []
    for p in parts:
        if _type(p) == "ByteLevel":
            continue  # offsets only
        if _type(p) != "TemplateProcessing":
            raise NotExpressible(f"post-processor {_type(p)} with add_special_tokens")
        seen_a = False
        for item in p.get("single", []):
            if "Sequence" in item:
                if seen_a or item["Sequence"].get("id") != "A":
                    raise NotExpressible("TemplateProcessing single template other than specials around $A")
                seen_a = True
            elif "SpecialToken" in item:
                name = item["SpecialToken"]["id"]
                ids = (p.get("special_tokens", {}).get(name) or {}).get("ids")
                if not ids:
                    raise NotExpressible(f"TemplateProcessing special token {name!r} without ids")
                (suffix if seen_a else prefix).extend(int(i) for i in ids)
        if not seen_a:
            raise NotExpressible("TemplateProcessing single template without $A")
    return prefix, suffix


def plan(spec: dict, add_special_tokens: bool = False, reachable=None) -> Plan:
    """A tiktoken plan for the parsed ``tokenizer.json`` ``spec``; raises NotExpressible.

    ``reachable(tokens) -> list[bool]`` runs the file's own BPE on whole tokens (needed
    only when ``ignore_merges`` is false); the caller passes one built on ``tokenizers``.
    """
    nfc = _normalizer(spec)
    pattern = _pattern(spec)
    if _type(spec.get("decoder")) != "ByteLevel":
        raise NotExpressible(f"decoder {_type(spec.get('decoder'))} (expected ByteLevel)")
    model = spec.get("model") or {}
    if _type(model) != "BPE":
        raise NotExpressible(f"model {_type(model)} (expected BPE)")
    if model.get("byte_fallback"):
        raise NotExpressible("BPE with byte_fallback")
    if model.get("dropout"):
        raise NotExpressible("BPE with dropout")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotExpressible(f"BPE with {key} {model[key]!r}")

    added = spec.get("added_tokens") or []
    plain = [a["content"] for a in added if not a.get("special")]
    if plain:
        raise NotExpressible(
            f"{len(plain)} non-special added token(s) (e.g. {plain[0]!r}), which tokenizers matches in the text before BPE"
        )
    specials = {a["content"]: int(a["id"]) for a in added}
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = bytes_to_unicode()
    to_latin1 = {ord(c): b for b, c in alphabet.items()}  # str.translate, then latin-1: the token's bytes
    for tok, i in specials.items():
        if tok in vocab and i != vocab[tok]:
            raise NotExpressible(f"special token {tok!r} has id {i} but {vocab[tok]} in the vocabulary")
    plain_vocab = {t: i for t, i in vocab.items() if t not in specials}
    stray = set("".join(plain_vocab)) - set(alphabet.values())
    if stray:
        c = min(stray)
        bad = next(t for t in plain_vocab if c in t)
        raise NotExpressible(f"vocabulary token {bad!r} is not a byte-level string (character {c!r})")
    ranks = {t.translate(to_latin1).encode("latin-1"): int(i) for t, i in plain_vocab.items()}
    taken = set(ranks.values())
    for tok, i in specials.items():
        if tok not in vocab and i in taken:
            raise NotExpressible(f"special token {tok!r} has the id {i} of a vocabulary token")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise NotExpressible(
            f"{len(missing)} of the 256 byte symbols are not in the vocabulary (e.g. byte {missing[0]})"
        )

    # merge priority must be the order of the results' ids (what tiktoken merges by)
    merges = _merges(model)
    last = -1
    made: dict[str, int] = {}
    again: dict[str, list[int]] = {}
    get = vocab.get
    for k, (a, b) in enumerate(merges):
        t = a + b
        ia, ib, it = get(a), get(b), get(t)
        if ia is None or ib is None or it is None:
            what = a if ia is None else b if ib is None else t
            raise NotExpressible(f"merge {k + 1} ({a} {b}) uses or makes {what!r}, which is not in the vocabulary")
        if it <= ia or it <= ib or it < last:
            raise NotExpressible(
                f"merge ranks disagree with ids: merge {k + 1} ({a} {b}) makes id {it} after a merge that made id {last}"
            )
        last = it
        if t in made:
            again.setdefault(t, [made[t]]).append(k)
        else:
            made[t] = k
    # several merges making one token (Llama 3's converted merges) share its tiktoken rank; they may
    # only disagree when two of them overlap as x+y == y+z: tiktoken then takes the left one
    for t, ks in again.items():
        for k1 in ks:
            x, y = merges[k1]
            for k2 in ks:
                y2, z = merges[k2]
                if k2 < k1 and y2 == y and x + y == y + z:
                    raise NotExpressible(f"merges {k2 + 1} and {k1 + 1} both make {t!r} and overlap")
    # a token no merge makes: tokenizers reaches it only as a whole piece, tiktoken also by merging into it
    orphans = [t for t, i in vocab.items() if len(t) > 1 and t not in specials and t not in made]
    for t in orphans:
        if any(t[:k] in vocab and t[k:] in vocab for k in range(1, len(t))):
            raise NotExpressible(f"vocabulary token {t!r} is made by no merge but splits into two tokens")

    if not model.get("ignore_merges"):
        tokens = [t for t in vocab if len(t) > 1 and t not in specials]
        ok = reachable(tokens) if reachable and tokens else [True] * len(tokens)
        lost = [t for t, good in zip(tokens, ok, strict=True) if not good]
        if lost:
            raise NotExpressible(
                f"ignore_merges is false and {len(lost)} token(s) are not rebuilt by their own merges (e.g. {lost[0]!r}); "
                "tiktoken returns a piece found whole in the vocabulary"
            )

    prefix, suffix = _post_tokens(spec, specials) if add_special_tokens else ([], [])
    import tiktoken

    def build():
        return tiktoken.Encoding(
            "snakellm-tokenizer-json", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )

    try:
        enc = build()
    except (ValueError, RuntimeError, OverflowError) as e:  # a pattern tiktoken's regex engine rejects
        raise NotExpressible(f"tiktoken cannot build the encoding: {e}") from None
    shape = "ByteLevel regex" if pattern == GPT2_PATTERN else "Split(regex)+ByteLevel"
    reason = (
        f"byte-level BPE ({shape}{', NFC' if nfc else ''}, ignore_merges={bool(model.get('ignore_merges'))}, "
        f"{len(merges)} merges in id order) expressed exactly as tiktoken ranks"
    )
    return Plan(enc, nfc, prefix, suffix, reason, build)
