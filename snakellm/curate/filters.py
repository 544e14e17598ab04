"""Quality filters (datatrove's) and language identification, each rule named and counted.

:func:`build` turns a source's ``curate`` settings into a :class:`Judge`, whose
:meth:`Judge.verdict` gives the first rule a document fails (``None``: kept). Rule names are
``<filter>:<datatrove's reason>`` (``gopher_quality:gopher_short_doc``, ``c4:too_few_sentences``,
``fineweb:line_punct_ratio``) and ``language_id`` for language identification.

The filters are datatrove's own classes, configured with our settings (which tests check are
datatrove's parameters with datatrove's defaults). Their word splitting is a datatrove
``WordTokenizer`` given to them as their ``language``: datatrove's default for English is
spaCy, which needs a model package this project does not install; ours splits words and
punctuation with one regex (``\\w+`` runs, and each other non-space run), sentences with
datatrove's own ``WhitespaceTokenizer`` rule. C4's filter also removes lines from a document it
keeps; here it only judges (a curated document's text is the chunk's, unchanged).

Language identification runs on the text with newlines as spaces; its model ships inside its
package (no download at run time): py3langid (langid.py's 97-language model, numpy) or pycld2
(Chromium's CLD2). docs/data.md#curation gives their measured accuracy and speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from snakellm.config import sections as S

LANGUAGE_RULE = "language_id"


def _tokenizer() -> Any:
    import regex
    from datatrove.utils.word_tokenizers import WhitespaceTokenizer, strip_strings

    class RegexWordTokenizer(WhitespaceTokenizer):
        """Words are ``\\w+`` runs (apostrophes inside kept: don't), other non-space runs are tokens of their own."""

        _words = regex.compile(r"\w+(?:['’]\w+)*|[^\w\s]+")

        def word_tokenize(self, text: str) -> list[str]:
            return strip_strings(self._words.findall(text))

    return RegexWordTokenizer()


_TOKENIZER: Any = None


def word_tokenizer() -> Any:
    """The one WordTokenizer the filters share (datatrove caches tokenizers by identity)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = _tokenizer()
    return _TOKENIZER


def _kwargs(cls: type, values: dict[str, Any] | None) -> dict[str, Any]:
    """The filter's settings with defaults filled, as datatrove's keyword arguments (lists as its tuples)."""
    full = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
    full.update(values or {})
    out = dict(full)
    for k in ("top_n_grams", "dup_n_grams"):
        if k in out:
            out[k] = tuple((int(n), float(f)) for n, f in out[k])
    if out.get("stop_chars") is not None:
        out["stop_chars"] = tuple(out["stop_chars"])
    return out


def make_filter(name: str, values: dict[str, Any] | None) -> Any:
    """datatrove's filter ``name`` (one of snakellm.config.sections.CURATE_FILTERS) with these settings."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    classes = {
        "gopher_repetition": (GopherRepetitionFilter, S.GopherRepetitionSettings),
        "gopher_quality": (GopherQualityFilter, S.GopherQualitySettings),
        "c4": (C4QualityFilter, S.C4Settings),
        "fineweb": (FineWebQualityFilter, S.FineWebSettings),
    }
    if name not in classes:
        raise ValueError(f"unknown filter {name!r} (known: {', '.join(S.CURATE_FILTERS)})")
    cls, settings = classes[name]
    unknown = set(values or {}) - {f.name for f in dataclasses.fields(settings)}
    if unknown:
        raise ValueError(f"filter {name}: unknown setting(s) {', '.join(sorted(unknown))}")
    return cls(**_kwargs(settings, values), language=word_tokenizer())


def language_identifier(model: str) -> Callable[[str], tuple[str, float]]:
    """text -> (ISO 639-1 code, confidence in [0, 1]) with a model shipped inside its package."""
    if model == "py3langid":
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)

        def py3langid(text: str) -> tuple[str, float]:
            lang, p = ident.classify(text)
            return str(lang), float(p)

        return py3langid
    if model == "pycld2":
        import pycld2

        def cld2(text: str) -> tuple[str, float]:
            try:
                reliable, _, details = pycld2.detect(text)
            except pycld2.error:  # invalid UTF-8 (lone surrogates): clean it and try again
                reliable, _, details = pycld2.detect(text.encode("utf-8", "replace").decode("utf-8"))
            code, pct = details[0][1], details[0][2]
            return ("un" if code == "un" else code.split("-")[0]), (pct / 100.0 if reliable else 0.0)

        return cld2
    raise ValueError(f"unknown language model {model!r} (known: {', '.join(S.LANGUAGE_MODELS)})")


@dataclasses.dataclass
class Judge:
    """The configured filters in their order, and the language rule."""

    filters: list[tuple[str, Any]]
    languages: set[str] | None
    threshold: float
    identify: Callable[[str], tuple[str, float]] | None

    def rules(self) -> list[str]:
        return ([LANGUAGE_RULE] if self.identify else []) + [n for n, _ in self.filters]

    def verdict(self, text: str) -> tuple[str | None, str | None, float]:
        """(the first failed rule or None, language or None, its confidence)."""
        from datatrove.data import Document

        lang, score = None, 0.0
        if self.identify is not None:
            lang, score = self.identify(text.replace("\n", " "))
            if self.languages is not None and (lang not in self.languages or score < self.threshold):
                return LANGUAGE_RULE, lang, score
        if self.filters:
            doc = Document(text=text, id="")
            for name, f in self.filters:
                ok = f.filter(doc)
                if ok is not True and not (isinstance(ok, tuple) and ok[0]):
                    reason = ok[1] if isinstance(ok, tuple) and len(ok) > 1 else "rejected"
                    return f"{name}:{reason}", lang, score
                doc.text = text  # C4 rewrites a kept document's text: every filter judges the chunk's text
        return None, lang, score


def build(curate: dict[str, Any]) -> Judge:
    """A source's ``curate`` settings as a Judge (no filter, no language ID: keeps everything)."""
    filters_cfg = curate.get("filters") or {}
    unknown = set(filters_cfg) - set(S.CURATE_FILTERS)
    if unknown:
        raise ValueError(f"unknown filter(s) {', '.join(sorted(unknown))} (known: {', '.join(S.CURATE_FILTERS)})")
    filters = [(n, make_filter(n, filters_cfg[n])) for n in S.CURATE_FILTERS if n in filters_cfg]
    langs = curate.get("languages")
    model = curate.get("language_model") or S.CurateSettings().language_model
    return Judge(
        filters=filters,
        languages=set(langs) if langs else None,
        threshold=float(curate.get("language_threshold", S.CurateSettings().language_threshold)),
        identify=language_identifier(model) if langs else None,
    )


def split_tokenizer() -> Any:
    """A datatrove WordTokenizer whose words are ``str.split()``'s: what our MinHash shingles use on
    datatrove's simplified text, so datatrove's MinHash pipeline can run beside ours with the same words
    (scripts/bench_curate.py; datatrove's default for English needs a spaCy model)."""
    from datatrove.utils.word_tokenizers import WhitespaceTokenizer

    class SplitWordTokenizer(WhitespaceTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

    return SplitWordTokenizer()
