"""``snakellm prepare-sft``: SQuAD json or any jsonl -> ``{input, output}`` (or conversation) jsonl splits.

Conversations (``format: messages`` or ``sharegpt``) become ``{"messages": [{role, content}, ...]}``
records (snakellm.finetune.conversations.normalize): rendered later, through the model's chat template,
by ``finetune``, ``render-sft`` and ``evaluate``.

The shape NeMo's SFT datasets read (``GPTSFTDataset``: one JSON object per line,
``prompt_template: "{input} {output}"``, ``label_key: output``). From a SQuAD
file every answerable question becomes one record: the rendered prompt as
``input``, the first answer as ``output`` (what the model is trained on and
what NeMo's ``exact_string_match`` compares against) and every gold answer in
``answers`` (what SQuAD's EM/F1 score against). Unanswerable (SQuAD 2.0
``is_impossible``) questions are skipped and counted.

Bad records are never dropped silently: each goes to ``rejected.jsonl`` with
its place (``file:line`` or ``article/paragraph/question``) and reason, and
``stats.json`` counts them by reason. The split is a seeded shuffle, so the
same input and seed always give the same files (byte for byte).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from snakellm.errors import UsageError
from snakellm.finetune.preference import KEYS as PREFERENCE_KEYS
from snakellm.io.atomic import atomic_group

SPLITS = ("train", "validation", "test")
DEFAULT_SQUAD_TEMPLATE = "Context: {context} Question: {question} Answer:"


class SFTDataError(UsageError, ValueError):
    """Input that cannot be read at all (not a quarantinable record), phrased with the file."""


class _Format(dict):
    """str.format_map mapping that reports unknown fields by name."""

    def __missing__(self, key: str) -> str:
        raise KeyError(key)


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def squad_records(path: str, template: str) -> Iterator[tuple[str, dict | None, str | None, Any]]:
    """(place, record or None, reject reason or None, raw) for every question of a SQuAD json."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SFTDataError(f"{path}: not a readable SQuAD JSON file: {e}") from None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        raise SFTDataError(f"{path}: a SQuAD file needs a top-level 'data' list of articles")
    for ai, art in enumerate(data):
        paras = art.get("paragraphs") if isinstance(art, dict) else None
        if not isinstance(paras, list):
            yield f"{path}:data[{ai}]", None, "article without a paragraphs list", art
            continue
        for pi, para in enumerate(paras):
            where = f"{path}:data[{ai}].paragraphs[{pi}]"
            context = para.get("context") if isinstance(para, dict) else None
            qas = para.get("qas") if isinstance(para, dict) else None
            if not _nonempty_str(context) or not isinstance(qas, list):
                yield where, None, "paragraph without a context string or a qas list", para
                continue
            for qi, qa in enumerate(qas):
                place = f"{where}.qas[{qi}]"
                if not isinstance(qa, dict):
                    yield place, None, "question is not an object", qa
                    continue
                if qa.get("is_impossible") is True:
                    yield place, None, "unanswerable", None
                    continue
                question, answers = qa.get("question"), qa.get("answers")
                if not _nonempty_str(question):
                    yield place, None, "missing or non-string question", qa
                    continue
                if not isinstance(answers, list) or not answers:
                    yield place, None, "no answers", qa
                    continue
                texts = [a.get("text") if isinstance(a, dict) else None for a in answers]
                if not all(_nonempty_str(t) for t in texts):
                    yield place, None, "empty or non-string answer text", qa
                    continue
                try:
                    prompt = template.format_map(
                        _Format(context=context, question=question, title=art.get("title", ""))
                    )
                except KeyError as e:
                    raise SFTDataError(
                        f"prompt template {template!r}: unknown field {e} (fields: context, question, title)"
                    ) from None
                # the prompt's fields stay beside it: a fine-tune's template may cut {context} and keep {question}
                rec = {"input": prompt, "output": texts[0], "answers": texts, "context": context, "question": question}
                rec["title"] = art["title"] if isinstance(art.get("title"), str) else ""
                if isinstance(qa.get("id"), str):
                    rec["id"] = qa["id"]
                yield place, rec, None, None


def preference_records(path: str) -> Iterator[tuple[str, dict | None, str | None, Any]]:
    """Preference pairs ``{prompt, chosen, rejected}`` (TRL's explicit-prompt form) of a jsonl file.

    A bad pair is quarantined with its place and reason: a missing or non-string field, an empty
    completion, chosen equal to rejected (nothing to prefer). The prompt may be empty; other keys are kept.
    """
    for place, obj, reason, raw in json_objects(path):
        if obj is None:
            yield place, None, reason, raw
            continue
        missing = [k for k in PREFERENCE_KEYS if k not in obj]
        if missing:
            yield place, None, f"missing key {', '.join(missing)}", obj
            continue
        if any(isinstance(obj[k], list) for k in PREFERENCE_KEYS):  # the conversational form
            rec, why = conversational_pair(obj)
            if rec is None:
                yield place, None, why, obj
            else:
                yield place, rec, None, None
            continue
        bad = [k for k in PREFERENCE_KEYS if not isinstance(obj[k], str)]
        if bad:
            yield place, None, f"non-string {', '.join(bad)}", obj
            continue
        empty = [k for k in ("chosen", "rejected") if not obj[k].strip()]
        if empty:
            yield place, None, f"empty {', '.join(empty)}", obj
            continue
        if obj["chosen"] == obj["rejected"]:
            yield place, None, "chosen equals rejected", obj
            continue
        yield (
            place,
            {k: obj[k] for k in PREFERENCE_KEYS} | {k: v for k, v in obj.items() if k not in PREFERENCE_KEYS},
            None,
            None,
        )


def conversational_pair(obj: dict) -> tuple[dict | None, str | None]:
    """TRL's conversational preference pair: ``prompt`` messages, ``chosen``/``rejected`` message lists (each
    with an assistant turn), normalised to ``{role, content}``; (None, reason) for a bad one."""
    from snakellm.finetune.conversations import normalize

    if not all(isinstance(obj[k], list) for k in PREFERENCE_KEYS):
        return None, "mixed forms: prompt, chosen and rejected must all be message lists (or all strings)"
    out: dict[str, Any] = {}
    for k in ("chosen", "rejected"):
        if not obj[k]:
            return None, f"empty {k}"
        msgs, why = normalize(obj["prompt"] + obj[k], "messages")
        if msgs is None:
            return None, f"{k}: {why}"
        if not any(m["role"] == "assistant" for m in msgs[len(obj["prompt"]) :]):
            return None, f"{k}: no assistant turn"
        out["prompt"], out[k] = msgs[: len(obj["prompt"])], msgs[len(obj["prompt"]) :]
    if out["chosen"] == out["rejected"]:
        return None, "chosen equals rejected"
    return out | {k: v for k, v in obj.items() if k not in PREFERENCE_KEYS}, None


def json_objects(path: str) -> Iterator[tuple[str, dict | None, str | None, Any]]:
    """(place, object, None, None) for every JSON object line of a jsonl file; (place, None, reason, raw) else."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise SFTDataError(f"{path}: cannot open: {e}") from None
    with fh:
        for n, raw in enumerate(fh, 1):
            place = f"{path}:{n}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield place, None, "not valid UTF-8", raw.decode("utf-8", "replace")
                continue
            if not text.strip():
                yield place, None, "blank line", text
                continue
            try:
                obj = json.loads(text)
            except ValueError:
                yield place, None, "not valid JSON", text.rstrip("\n")
                continue
            if not isinstance(obj, dict):
                yield place, None, "not a JSON object", obj
                continue
            yield place, obj, None, None


def conversation_records(path: str, fmt: str, key: str | None) -> Iterator[tuple[str, dict | None, str | None, Any]]:
    """Conversations (``messages`` or ``sharegpt``) as ``{messages: [{role, content}, ...]}`` records."""
    from snakellm.finetune.conversations import DEFAULT_KEYS, normalize

    key = key or DEFAULT_KEYS[fmt]
    for place, obj, reason, raw in json_objects(path):
        if obj is None:
            yield place, None, reason, raw
            continue
        if key not in obj:
            yield place, None, f"missing key {key}", obj
            continue
        messages, why = normalize(obj[key], fmt)
        if messages is None:
            yield place, None, why, obj
            continue
        rec: dict[str, Any] = {"messages": messages}
        if isinstance(obj.get("id"), str | int):
            rec["id"] = obj["id"]
        yield place, rec, None, None


def jsonl_records(
    path: str, input_key: str, output_key: str, template: str | None
) -> Iterator[tuple[str, dict | None, str | None, Any]]:
    """Records of a jsonl file with configurable keys; ``output`` may be a string or a list of gold answers."""
    for place, obj, reason, raw in json_objects(path):
        if obj is None:
            yield place, None, reason, raw
            continue
        if input_key not in obj or output_key not in obj:
            missing = [k for k in (input_key, output_key) if k not in obj]
            yield place, None, f"missing key {', '.join(missing)}", obj
            continue
        inp, out = obj[input_key], obj[output_key]
        answers = out if isinstance(out, list) else [out]
        if not _nonempty_str(inp):
            yield place, None, f"empty or non-string {input_key}", obj
            continue
        if not answers or not all(_nonempty_str(a) for a in answers):
            yield place, None, f"empty or non-string {output_key}", obj
            continue
        if template:
            fields = {k: v for k, v in obj.items() if isinstance(v, str)}
            try:
                inp = template.format_map(_Format(fields))
            except KeyError as e:
                raise SFTDataError(
                    f"{place}: prompt template {template!r} names field {e}, not in the record"
                ) from None
        rec = {"input": inp, "output": answers[0], "answers": answers}
        yield place, rec, None, None


def split_counts(n: int, split: list[float]) -> list[int]:
    """Records per split from shares (any positive numbers; normalised), rounding down, rest to train."""
    total = sum(split)
    counts = [int(n * s / total) for s in split]
    counts[0] += n - sum(counts)
    return counts


def parse_split(text: str) -> list[float]:
    parts = [p for p in str(text).replace("/", ",").split(",") if p.strip()]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise SFTDataError(f"split {text!r}: expected three numbers, e.g. 80,10,10") from None
    if len(vals) != 3 or any(v < 0 for v in vals) or vals[0] <= 0:
        raise SFTDataError(f"split {text!r}: expected train,validation,test shares (train > 0), e.g. 80,10,10")
    return vals


def prepare(
    source: str,
    out_dir: str,
    *,
    fmt: str = "squad",
    template: str | None = None,
    input_key: str = "input",
    output_key: str = "output",
    messages_key: str | None = None,
    split: str = "80,10,10",
    seed: int = 1234,
    limit: int | None = None,
) -> dict:
    """Write ``{train,validation,test}.jsonl``, ``rejected.jsonl`` and ``stats.json`` under ``out_dir``."""
    if fmt == "squad":
        it = squad_records(source, template or DEFAULT_SQUAD_TEMPLATE)
    elif fmt == "jsonl":
        it = jsonl_records(source, input_key, output_key, template)
    elif fmt == "preference":
        it = preference_records(source)
    elif fmt in ("messages", "sharegpt"):
        it = conversation_records(source, fmt, messages_key)
    else:
        raise SFTDataError(f"unknown format {fmt!r} (squad, jsonl, messages, sharegpt, preference)")
    shares = parse_split(split)
    good: list[dict] = []
    rejected: list[dict] = []
    reasons: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    seen = 0
    for place, rec, reason, raw in it:
        seen += 1
        if rec is not None:
            good.append(rec)
        elif reason == "unanswerable":
            skipped[reason] += 1
        else:
            reasons[str(reason)] += 1
            rejected.append({"where": place, "reason": reason, "content": raw})
    if not good:
        raise SFTDataError(f"{source}: no usable records ({seen} seen: {dict(reasons) or dict(skipped)})")
    order = list(range(len(good)))
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    counts = split_counts(len(order), shares)
    if any(c == 0 and share > 0 for c, share in zip(counts, shares, strict=True)):  # share 0: left empty on purpose
        raise SFTDataError(
            f"{source}: too few records: {len(order)} used ({len(good)} usable of {seen}, "
            f"{sum(reasons.values())} rejected) split {split} give "
            + ", ".join(f"{n} {c}" for n, c in zip(SPLITS, counts, strict=True))
            + ": a split with a share needs at least one record (add records or change split/limit)"
        )
    splits: dict[str, list[dict]] = {}
    start = 0
    for name, c in zip(SPLITS, counts, strict=False):
        splits[name] = [good[i] for i in order[start : start + c]]
        start += c
    stats = {
        "source": source,
        "format": fmt,
        "records": seen,
        "accepted": len(good),
        "used": len(order),
        "skipped": dict(skipped),
        "rejected": sum(reasons.values()),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "splits": {k: len(v) for k, v in splits.items()},
        "seed": seed,
        "split": shares,
    }
    if seen != len(good) + sum(reasons.values()) + sum(skipped.values()):
        raise RuntimeError("record accounting mismatch")  # pragma: no cover (a bug, never bad input)
    out = Path(out_dir)
    names = [out / f"{s}.jsonl" for s in SPLITS] + [out / "rejected.jsonl", out / "stats.json"]
    with atomic_group(*names) as tmps:
        for s, tmp in zip(SPLITS, tmps, strict=False):
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in splits[s]), encoding="utf-8")
        tmps[3].write_text(
            "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rejected), encoding="utf-8"
        )
        tmps[4].write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats
