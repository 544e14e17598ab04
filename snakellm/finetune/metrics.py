"""Evaluation metrics: NeMo's ``exact_string_match`` and SQuAD's exact match / F1.

``exact_string_match`` is NeMo's default SFT metric
(``nemo/collections/common/metrics/classification_accuracy.py::ExactStringMatchMetric``):
``correct += pred == target`` over raw strings, no strip, no lowercasing, no
normalisation (the same in NeMo 1.23, 2.0 and 2.4). NeMo's ``pred`` is the
decoded generation after the prompt, ``target`` the decoded answer token ids;
callers pass exactly those strings.

SQuAD's metrics are the official v1.1 ``evaluate-v1.1.py``: answers normalised
(lowercase, punctuation and the articles a/an/the removed, whitespace
collapsed), exact match and token F1 each taken as the maximum over all gold
answers, averaged over questions (reported here as fractions, not percentages).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def exact_string_match(preds: Sequence[str], labels: Sequence[str]) -> float:
    """NeMo's ExactStringMatchMetric: the share of raw-equal pairs (0.0 for no pairs, as NeMo's 0/0 guard)."""
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions but {len(labels)} labels")
    correct = sum(1 for p, t in zip(preds, labels, strict=False) if p == t)
    return correct / len(preds) if preds else 0.0


def normalize_answer(s: str) -> str:
    """SQuAD v1.1: lower, drop punctuation, drop articles, collapse whitespace (in that order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def squad_exact(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def squad_f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_scores(preds: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean over questions of the best EM and F1 against any gold answer."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predictions but {len(golds)} gold answer lists")
    if not preds:
        return {"squad_exact_match": 0.0, "squad_f1": 0.0}
    em = sum(max(squad_exact(p, g) for g in gs) for p, gs in zip(preds, golds, strict=False)) / len(preds)
    f1 = sum(max(squad_f1(p, g) for g in gs) for p, gs in zip(preds, golds, strict=False)) / len(preds)
    return {"squad_exact_match": em, "squad_f1": f1}
