"""SFT examples as token ids with answer-only loss masks, as NeMo's ``GPTSFTDataset`` builds them.

(Conversations become the same :class:`Example`, with a per-token ``mask``: snakellm.finetune.conversations.)

A record ``{input, output}`` is rendered through ``prompt_template`` (default
NeMo's ``"{input} {output}"``, which must end with ``{output}``). As in NeMo's
``_separate_template``, the template's pieces are tokenized separately and, for
a space-sensitive tokenizer (GPT-2 BPE: ``"x y" != "x" + "y"``), the whitespace in
front of a placeholder goes with the value (``" {output}"`` -> ``" France"``);
for a space-insensitive one (SentencePiece) it is dropped. The pieces before
``{output}`` are the context, the output piece is the answer.

``add_bos`` (NeMo default False) puts BOS in front of the context, ``add_eos``
(default True) EOD after the answer. Too long an example loses tokens from its
``truncation_field`` (NeMo's option: the template fields that may be cut; default
``input``) from the start (``truncation_method: left``, our default: a prompt ends
with its question) or the end (right, NeMo's default), then from the rest of the
context, and only if the answer alone is too long, from the answer's end; all
counted (:class:`EncodeStats`) and warned about in the job log. With ``answer_only_loss`` only the answer tokens (and EOD) are
predicted; otherwise every token is.

Batches are ``tokens``/``labels``/``loss_mask``/``position_ids`` ``[b, s]``; with
packing, several examples share a row (first-fit in a seeded order) and carry
``segment_ids`` so attention stays inside each example (block-diagonal causal
mask) and positions restart at 0 per example.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snakellm.errors import DataError

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class SFTFormatError(DataError):
    pass


@dataclass
class Example:
    context: list[int]
    answer: list[int]
    record: dict = field(default_factory=dict)
    truncated: int = 0  # tokens dropped to fit the sequence (a conversation: turns dropped)
    mask: list[int] | None = None  # per token of ids, 1 = trained (a conversation's assistant spans)

    @property
    def ids(self) -> list[int]:
        return self.context + self.answer

    def label_mask(self, answer_only_loss: bool = True) -> list[float]:
        """Per label position (label j predicts ids[j + 1]): 1.0 where the loss counts."""
        n = len(self.ids) - 1
        if not answer_only_loss:
            return [1.0] * n
        if self.mask is not None:
            return [float(m) for m in self.mask[1:]]
        first = max(len(self.context) - 1, 0)  # the label index of the first answer token
        return [0.0] * first + [1.0] * (n - first)


@dataclass
class EncodeStats:
    examples: int = 0
    context_truncated: int = 0
    answer_truncated: int = 0
    tokens_dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


LINE = "_line"  # where read_jsonl found a record (1-based), for messages; never a template field


def file_sha256(path: str | Path) -> str:
    """A whole file's sha256: what a fine-tune records of its splits, and DPO of its reference's log-probabilities."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_jsonl(path: str | Path, keys: tuple[str, ...] = ("input", "output")) -> list[dict]:
    """The ``{input, output, ...}`` records (or those with other string ``keys``: preference pairs) of a jsonl
    file, each with its line number under ``LINE``."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise SFTFormatError(f"{path}:{n}: not valid JSON: {e}") from None
            if isinstance(rec, dict) and keys == ("input", "output") and isinstance(rec.get("messages"), list):
                pass  # a conversation (prepare-sft's messages/sharegpt formats)
            elif not isinstance(rec, dict) or not all(
                isinstance(rec.get(k), str) or (keys != ("input", "output") and isinstance(rec.get(k), list))
                for k in keys
            ):
                want = " and ".join(repr(k) for k in keys)
                raise SFTFormatError(
                    f"{path}:{n}: expected an object with string {want}"
                    + (
                        " (run prepare-sft, sft_data format preference)"
                        if "chosen" in keys
                        else ", or a 'messages' list (run prepare-sft)"
                    )
                )
            rec[LINE] = n
            out.append(rec)
    if not out:
        raise SFTFormatError(f"{path}: no examples")
    return out


def space_sensitive(tok) -> bool:
    """NeMo's test: does tokenizing 'x y' differ from tokenizing 'x' and 'y' apart?"""
    return list(tok.encode("x y")) != list(tok.encode("x")) + list(tok.encode("y"))


def template_pieces(template: str, record: dict, sensitive: bool) -> tuple[list[str], list[str]]:
    """Split the rendered template into strings and their keys (placeholder name or '<template>')."""
    if not template.rstrip().endswith("{output}"):
        raise SFTFormatError(f"prompt template {template!r} must end with {{output}}")
    strings, keys = [], []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        literal = template[pos : m.start()]
        name = m.group(1)
        if name not in record or not isinstance(record[name], str):
            raise SFTFormatError(f"prompt template {template!r}: the record has no string field {name!r}")
        value = record[name]
        if sensitive:
            stripped = literal.rstrip(" ")
            lead = literal[len(stripped) :]
            if stripped:
                strings.append(stripped)
                keys.append("<template>")
            strings.append(lead + value)
        else:
            if literal.strip():
                strings.append(literal.strip())
                keys.append("<template>")
            strings.append(value)
        keys.append(name)
        pos = m.end()
    return strings, keys


@dataclass
class Encoder:
    """Turns records into :class:`Example`s (token ids split into context and answer).

    Too long an example loses tokens first from its ``truncation_field`` pieces (NeMo's
    ``truncation_field``: the template fields that may be cut, comma-separated), from their
    start (``truncation_method: left``) or end (right); so a prompt ``{context} {question}`` cut
    in ``context`` keeps the question and the template's words. Only if that is not enough
    the rest of the context is cut the same way, and last the answer's end; each is counted.
    """

    tok: Any
    max_seq_length: int
    template: str = "{input} {output}"
    add_bos: bool = False
    add_eos: bool = True
    truncation_method: str = "left"
    reserved: int = 0  # positions taken by p-tuning's virtual tokens
    bos_id: int | None = None
    eos_id: int | None = None
    truncation_field: str = "input"

    def __post_init__(self) -> None:
        if self.truncation_method not in ("left", "right"):
            raise SFTFormatError(f"truncation_method must be left or right, got {self.truncation_method!r}")
        self.sensitive = space_sensitive(self.tok)
        self.fields = {f.strip() for f in self.truncation_field.split(",") if f.strip()}
        if self.eos_id is None:
            self.eos_id = int(self.tok.eod_id)
        if self.bos_id is None:
            sp = getattr(self.tok, "_sp", None)
            bos = sp.bos_id() if sp is not None else -1
            self.bos_id = int(bos) if bos is not None and bos >= 0 else int(self.tok.eod_id)
        self.stats = EncodeStats()

    def _cut(self, pieces: list[list[int]], which: list[int], over: int) -> int:
        """Drop up to ``over`` tokens from the pieces ``which`` (left: their starts, first piece first)."""
        left = self.truncation_method == "left"
        cut = 0
        for i in which if left else reversed(which):
            take = min(over - cut, len(pieces[i]))
            if take:
                pieces[i] = pieces[i][take:] if left else pieces[i][: len(pieces[i]) - take]
                cut += take
            if cut >= over:
                break
        return cut

    def encode(self, rec: dict) -> Example:
        strings, keys = template_pieces(self.template, rec, self.sensitive)
        pieces = [list(map(int, self.tok.encode(s))) for s in strings[:-1]]
        answer = list(map(int, self.tok.encode(strings[-1])))
        head = [int(self.bos_id or 0)] if self.add_bos else []
        if self.add_eos:
            answer = answer + [int(self.eos_id or 0)]
        budget = self.max_seq_length - self.reserved
        over = len(head) + sum(map(len, pieces)) + len(answer) - budget
        self.stats.examples += 1
        cut = 0
        if over > 0:  # the truncation fields first, then the rest of the context (BOS stays first)
            cut = self._cut(pieces, [i for i, k in enumerate(keys[:-1]) if k in self.fields], over)
            cut += self._cut(pieces, list(range(len(pieces))), over - cut)
            if cut:
                self.stats.context_truncated += 1
                self.stats.tokens_dropped += cut
        context = head + [t for p in pieces for t in p]
        over = len(context) + len(answer) - budget
        if over > 0:
            self.stats.answer_truncated += 1
            self.stats.tokens_dropped += over
            answer = answer[: len(answer) - over]
        return Example(context, answer, rec, truncated=cut + max(over, 0))

    def encode_all(self, records: Sequence[dict]) -> list[Example]:
        return [self.encode(r) for r in records]


def truncation_warning(path: str | Path, exs: Sequence[Example], enc: Encoder) -> str | None:
    """The job log's line about over-long examples of one file (None when none was cut): counts and lines."""
    cut = [e.record.get(LINE, n) for n, e in enumerate(exs, 1) if e.truncated]
    if not cut:
        return None
    rows = ", ".join(map(str, cut[:5])) + (", ..." if len(cut) > 5 else "")
    return (
        f"warning: {path}: {len(cut)} of {len(exs)} examples longer than {enc.max_seq_length - 1} tokens were "
        f"truncated ({sum(e.truncated for e in exs)} tokens dropped; truncation_field {enc.truncation_field!r} "
        f"from the {enc.truncation_method}; {enc.stats.answer_truncated} answers cut); lines {rows}"
    )


def sample_order(n: int, seed: int, start: int, count: int) -> list[int]:
    """Example indices for global samples start..start+count: epochs of seeded permutations (resumable)."""
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for s in range(start, start + count):
        epoch, i = divmod(s, n)
        if epoch not in cache:
            perm = list(range(n))
            random.Random(seed * 1_000_003 + epoch).shuffle(perm)
            cache[epoch] = perm
        out.append(cache[epoch][i])
    return out


def collate(
    examples: Sequence[Example],
    pad_id: int,
    answer_only_loss: bool = True,
    pad_to: int | None = None,
    multiple_of: int = 8,
) -> dict:
    """One row per example: tokens = ids[:-1], labels = ids[1:], loss on answer positions (as torch tensors)."""
    import torch

    longest = max(len(e.ids) - 1 for e in examples)
    width = pad_to if pad_to is not None else -(-longest // multiple_of) * multiple_of
    b = len(examples)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    for r, e in enumerate(examples):
        ids = e.ids
        n = len(ids) - 1
        tokens[r, :n] = torch.tensor(ids[:-1])
        labels[r, :n] = torch.tensor(ids[1:])
        mask[r, :n] = torch.tensor(e.label_mask(answer_only_loss))
    pos = torch.arange(width).unsqueeze(0).expand(b, width).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": pos}


def pack(examples: Sequence[Example], width: int, seed: int) -> list[list[int]]:
    """First-fit packing of examples (by index, in a seeded order) into rows of ``width`` tokens."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = len(examples[i].ids) - 1
        for r, free in enumerate(room):
            if free >= need:
                rows[r].append(i)
                room[r] -= need
                break
        else:
            rows.append([i])
            room.append(width - need)
    return rows


def collate_packed(rows: Sequence[Sequence[Example]], width: int, pad_id: int, answer_only_loss: bool = True) -> dict:
    """Packed rows: positions restart per example, ``segment_ids`` tell examples apart (0 = padding)."""
    import torch

    b = len(rows)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    pos = torch.zeros((b, width), dtype=torch.long)
    seg = torch.zeros((b, width), dtype=torch.long)
    for r, exs in enumerate(rows):
        at = 0
        for k, e in enumerate(exs, 1):
            ids = e.ids
            n = len(ids) - 1
            tokens[r, at : at + n] = torch.tensor(ids[:-1])
            labels[r, at : at + n] = torch.tensor(ids[1:])
            mask[r, at : at + n] = torch.tensor(e.label_mask(answer_only_loss))
            pos[r, at : at + n] = torch.arange(n)
            seg[r, at : at + n] = k
            at += n
        if at < width:  # padding: its own segment, positions continuing (never attended to by real tokens)
            pos[r, at:] = torch.arange(width - at)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": pos, "segment_ids": seg}


def packed_segments(segment_ids):
    """The packed rows' segment ids as the model's ``attention_mask`` argument, int32 ``[b, 1, 1, s]``: the
    attention (snakellm.models.attention) builds FlexAttention's block mask from them, causal within a segment;
    a tensor, so megatron-core's recomputation saves it as it saves a mask."""
    import torch

    return segment_ids.to(torch.int32)[:, None, None, :]


def packed_attention_mask(segment_ids):
    """Megatron's boolean mask [b, 1, s, s], True = masked: causal and block-diagonal by segment."""
    import torch

    s = segment_ids.size(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    return ~(causal.unsqueeze(0) & same).unsqueeze(1)
