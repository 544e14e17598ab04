"""``snakellm render-sft``: what ``finetune`` trains on, one example a line, before packing.

Each record of ``--data`` (conversations in OpenAI's ``messages`` or ShareGPT's shape, or
``{input, output}`` records) goes through the same adapter ``finetune`` uses: the run's chat
template (or ``--chat-template``) and ``--train-on`` for conversations, the prompt template
and answer-only loss for input/output. Out: ``{"input_ids": [...], "labels": [...]}`` per
example in Hugging Face's convention (labels equal the ids where trained, -100 elsewhere; the
model shifts them). ``--show N`` prints N examples with the trained text between ``[[`` and
``]]`` (axolotl's debug view, as text). Records that are not a valid conversation are
skipped and counted by reason, with their lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from snakellm.finetune import dataset as ds
from snakellm.io.atomic import write_text

FORMATS = ("auto", "messages", "sharegpt", "jsonl")
IGNORE = -100


def detect(obj: dict) -> str:
    """A record's format from its keys: messages, conversations (sharegpt) or input/output (jsonl)."""
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "input" in obj and "output" in obj:
        return "jsonl"
    raise ds.SFTFormatError("no 'messages', 'conversations' or 'input'/'output' key (set --format)")


def read_records(path: str, fmt: str, messages_key: str | None) -> tuple[list[dict], Counter[str], list[str]]:
    """(records as finetune reads them, rejects by reason, rejected places)."""
    from snakellm.finetune.conversations import DEFAULT_KEYS, normalize
    from snakellm.finetune.sft_data import json_objects

    out: list[dict] = []
    reasons: Counter[str] = Counter()
    places: list[str] = []
    for place, obj, reason, _ in json_objects(path):
        if obj is None:
            if reason != "blank line":
                reasons[str(reason)] += 1
                places.append(place)
            continue
        line = int(place.rsplit(":", 1)[1])
        f = fmt
        if f == "auto":
            try:
                f = detect(obj)
            except ds.SFTFormatError as e:
                raise ds.SFTFormatError(f"{place}: {e}") from None
        if f == "jsonl":
            if not (isinstance(obj.get("input"), str) and isinstance(obj.get("output"), str)):
                reasons["no string input/output"] += 1
                places.append(place)
                continue
            out.append({**obj, ds.LINE: line})
            continue
        if f == "messages" and isinstance(obj.get("messages"), list) and messages_key is None:
            turns = obj["messages"]  # prepare-sft's own output is OpenAI-shaped
        else:
            key = messages_key or DEFAULT_KEYS[f]
            if key not in obj:
                reasons[f"missing key {key}"] += 1
                places.append(place)
                continue
            turns = obj[key]
        messages, why = normalize(turns, f)
        if messages is None:
            reasons[str(why)] += 1
            places.append(place)
            continue
        out.append({"messages": messages, ds.LINE: line})
    return out, reasons, places


def examples(a: argparse.Namespace, records: list[dict]) -> tuple[list[ds.Example], Any, dict]:
    """The examples finetune would build, its encoder, and the run's description."""
    from snakellm.finetune import conversations as conv
    from snakellm.finetune.runtime import load_tokenizer
    from snakellm.models.loading import describe_run

    base = describe_run(a.run, seq_length=a.max_seq_length)
    seq = a.max_seq_length or base["arch"]["seq_length"]
    tok = load_tokenizer(base["tokenizer"])
    chats = [r for r in records if conv.is_conversation(r)]
    if chats and len(chats) != len(records):
        raise ds.SFTFormatError(f"{a.data}: conversations and input/output records mixed in one file")
    if chats:
        enc: Any = conv.chat_encoder(base["tokenizer"], tok, a.chat_template, seq + 1, a.train_on)
        exs = enc.encode_all(chats, a.data)
        warning = conv.length_warning(a.data, enc)
    else:
        enc = ds.Encoder(tok, seq + 1, a.template, a.add_bos, a.add_eos, a.truncation_method,
                         truncation_field=a.truncation_field)  # fmt: skip
        exs = enc.encode_all(records)
        warning = ds.truncation_warning(a.data, exs, enc)
    if warning:
        print(f"snakellm render-sft: {warning}", file=sys.stderr)
    return exs, enc, base


def token_flags(e: ds.Example, answer_only_loss: bool) -> list[int]:
    """Per token of the example: 1 where trained (the label convention before the shift)."""
    if not answer_only_loss:
        return [1] * len(e.ids)
    if e.mask is not None:
        return list(e.mask)
    return [0] * len(e.context) + [1] * len(e.answer)


def show(e: ds.Example, flags: list[int], tok: Any) -> str:
    """The example's text with every trained run of tokens between [[ and ]]."""
    out: list[str] = []
    run: list[int] = []
    cur = None
    for t, f in [*zip(e.ids, flags, strict=True), (None, None)]:
        if f != cur and run:
            text = tok.decode(run)
            out.append(f"[[{text}]]" if cur else text)
            run = []
        if t is not None:
            run.append(t)
        cur = f
    return "".join(out)


def render(a: argparse.Namespace) -> dict:
    records, reasons, places = read_records(a.data, a.format, a.messages_key)
    if not records:
        raise ds.SFTFormatError(f"{a.data}: no usable records ({dict(reasons)})")
    exs, enc, _ = examples(a, records)
    lines = []
    trained = total = 0
    for e in exs:
        flags = token_flags(e, a.answer_only_loss)
        labels = [t if f else IGNORE for t, f in zip(e.ids, flags, strict=True)]
        trained += sum(flags)
        total += len(flags)
        lines.append(json.dumps({"input_ids": e.ids, "labels": labels}) + "\n")
    write_text(Path(a.out), "".join(lines))
    if a.show:
        tok = enc.tok.tok if hasattr(enc.tok, "tok") else enc.tok
        for k, e in enumerate(exs[: a.show]):
            print(f"--- example {k} (line {e.record.get(ds.LINE)}): {len(e.ids)} tokens, "
                  f"{sum(token_flags(e, a.answer_only_loss))} trained", file=sys.stderr)  # fmt: skip
            print(show(e, token_flags(e, a.answer_only_loss), tok))
    return {
        "examples": len(exs),
        "tokens": total,
        "trained_tokens": trained,
        "rejected": sum(reasons.values()),
        "rejected_by_reason": dict(reasons),
        "rejected_at": places[:20],
        "encode": enc.stats.as_dict(),
        "template": getattr(getattr(enc, "template", None), "source", None),
    }
