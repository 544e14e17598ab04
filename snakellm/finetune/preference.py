"""Preference pairs for DPO: TRL's tokenization, its truncation, the batches and the losses.

Tokenization as TRL's ``DPOTrainer`` (1.x, ``_prepare_dataset``): the prompt
alone and the prompt plus each completion (plus the EOS token for plain-text
pairs) are tokenized, and the completion starts where the two token lists
diverge (their common prefix with the prompt's tokens is the prompt). Then
``max_prompt_length`` cuts the prompt (its end kept under ``keep_end``, its
start under ``keep_start``, as TRL 0.x did) and ``max_length`` each whole
sequence as TRL's collator does (``keep_start``: ``ids[:max_length]``, a pair
whose prompt alone fills ``max_length`` is dropped and counted; ``keep_end``:
``ids[-max_length:]``).

A micro-batch of ``n`` pairs is ``2 n`` rows, the chosen sequences first (TRL's
layout); the loss mask marks the predicted completion tokens, so a row's summed
log-probability is minus its masked cross-entropy. The losses are TRL's:
``sigmoid``, ``hinge``, ``ipo`` (length-normalised), ``robust`` (DPOTrainer)
and ``simpo`` (CPOTrainer's, with ``cpo_alpha`` 0: reference-free, average
log-probabilities, margin ``gamma``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from snakellm.config.checks import dpo_conflict as check_settings  # noqa: F401  (the config check's rule)
from snakellm.errors import DataError

KEYS = ("prompt", "chosen", "rejected")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
REFERENCE_FREE = ("simpo",)


class PreferenceError(DataError):
    pass


@dataclass(frozen=True)
class Truncation:
    """``dpo.max_length`` (None: no cut), ``dpo.max_prompt_length`` and ``dpo.truncation_mode``."""

    max_length: int | None = None
    max_prompt_length: int | None = None
    mode: str = "keep_start"


@dataclass
class Side:
    """One sequence of a pair: its token ids and the index of its first completion token."""

    ids: list[int]
    first: int

    @property
    def completion_tokens(self) -> int:
        """Completion tokens in the sequence (TRL's ``completion_mask.sum()``, the first token included)."""
        return len(self.ids) - self.first


@dataclass
class Pair:
    index: int  # line of the split file (0-based)
    chosen: Side
    rejected: Side


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize(tok: Any, rec: dict, chat: Any = None) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids as TRL's DPOTrainer tokenizes a pair.

    Conversational (message lists): the prompt rendered by the run's chat template with the generation prompt,
    and prompt + each completion rendered without it, no EOS added (``chat``: a
    :class:`snakellm.finetune.conversations.ChatEncoder`, its template and tokenizer). Plain text:

    TRL appends the EOS text to each completion and tokenizes it; every tokenizer here encodes
    that text as the EOD id after the rest (GPT-2's encoder splits at it, as Hugging Face's does),
    so the id is appended instead (SentencePiece would spell ``</s>`` out).
    """
    if isinstance(rec["prompt"], list):
        if chat is None:
            raise PreferenceError("conversational pairs need the run's chat template")
        from snakellm.finetune.chat_template import ChatTemplateError

        try:
            prompt = chat.tok.encode(chat.template.render(rec["prompt"], add_generation_prompt=True))[0]
            pc = chat.tok.encode(chat.template.render(rec["prompt"] + rec["chosen"]))[0]
            pr = chat.tok.encode(chat.template.render(rec["prompt"] + rec["rejected"]))[0]
        except ChatTemplateError as e:
            raise PreferenceError(f"line {rec.get('_line', '?')}: {e}") from None
        n = min(common_prefix_length(prompt, pc), common_prefix_length(prompt, pr))
        return list(prompt[:n]), list(pc[n:]), list(pr[n:])
    eod, eod_text = int(tok.eod_id), getattr(tok, "eod_token", None)

    def with_eos(text: str) -> list[int]:
        if eod_text and text.endswith(eod_text):
            text = text[: -len(eod_text)]
        return list(tok.encode(text)) + [eod]

    prompt = list(tok.encode(rec["prompt"])) if rec["prompt"] else []
    pc, pr = with_eos(rec["prompt"] + rec["chosen"]), with_eos(rec["prompt"] + rec["rejected"])
    n = min(common_prefix_length(prompt, pc), common_prefix_length(prompt, pr))
    return prompt[:n], pc[n:], pr[n:]


def truncate(prompt: list[int], completion: list[int], t: Truncation) -> Side:
    if t.max_prompt_length is not None and len(prompt) > t.max_prompt_length:
        prompt = prompt[-t.max_prompt_length :] if t.mode == "keep_end" else prompt[: t.max_prompt_length]
    ids, first = prompt + completion, len(prompt)
    if t.max_length is not None and len(ids) > t.max_length:
        if t.mode == "keep_end":
            cut = len(ids) - t.max_length
            ids, first = ids[cut:], max(first - cut, 0)
        else:
            ids = ids[: t.max_length]
    return Side(ids, first)


def is_conversational(records: Sequence[dict]) -> bool:
    return any(isinstance(r.get("prompt"), list) for r in records)


def encode_pairs(
    tok: Any, records: Sequence[dict], t: Truncation, chat: Any = None
) -> tuple[list[Pair], dict[str, int]]:
    """The pairs that keep a completion token (TRL's filter), and counts of what was cut or dropped."""
    pairs, stats = [], {"pairs": len(records), "dropped_prompt_fills_max_length": 0, "truncated": 0}
    for i, rec in enumerate(records):
        p, c, r = tokenize(tok, rec, chat)
        if t.max_prompt_length is not None and len(p) > t.max_prompt_length:
            stats["truncated"] += 1
        pl = min(len(p), t.max_prompt_length) if t.max_prompt_length is not None else len(p)
        if t.max_length is not None and t.mode == "keep_start" and pl >= t.max_length:
            stats["dropped_prompt_fills_max_length"] += 1
            continue
        ch, rj = truncate(p, c, t), truncate(p, r, t)
        if t.max_length is not None and (pl + max(len(c), len(r)) > t.max_length):
            stats["truncated"] += 1
        if min(len(ch.ids), len(rj.ids)) < 2:
            raise PreferenceError(f"pair {i}: fewer than two tokens after truncation (dpo.max_length {t.max_length})")
        pairs.append(Pair(i, ch, rj))
    stats["kept"] = len(pairs)
    return pairs, stats


def collate(pairs: Sequence[Pair], pad_id: int, multiple_of: int = 8) -> dict:
    """``2 n`` rows, chosen first: tokens = ids[:-1], labels = ids[1:], the loss mask on completion tokens."""
    import torch

    sides = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    longest = max(len(s.ids) - 1 for s in sides)
    width = -(-longest // multiple_of) * multiple_of
    rows = len(sides)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.float32)
    for r, s in enumerate(sides):
        n = len(s.ids) - 1
        tokens[r, :n] = torch.tensor(s.ids[:-1])
        labels[r, :n] = torch.tensor(s.ids[1:])
        mask[r, max(s.first - 1, 0) : n] = 1.0
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask,
        "position_ids": torch.arange(width).unsqueeze(0).expand(rows, width).contiguous(),
        "completion_tokens": torch.tensor([float(s.completion_tokens) for s in sides]),
    }


def sequence_logps(model: Any, b: dict) -> Any:
    """Each row's summed log-probability of its completion tokens (minus the masked cross-entropy)."""
    per_tok = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return -(per_tok.float() * b["loss_mask"].to(per_tok.device)).sum(dim=1)


def mask_padded_vocab(gpt: Any, vocab_size: int) -> Any:
    """Logits of the embedding's padding rows set to -inf, so log-probabilities are over the tokenizer's
    vocabulary (as transformers computes them); a no-op hook-free return when nothing is padded."""
    import torch
    from megatron.core import parallel_state

    layer = gpt.output_layer
    rank = parallel_state.get_tensor_model_parallel_rank()  # its slice of the vocabulary: [rank * local, ...)

    def hook(_m: Any, _args: Any, out: Any) -> Any:
        logits, bias = out
        local = logits.shape[-1]
        start = rank * local
        if start + local <= vocab_size:
            return out
        keep = torch.arange(start, start + local, device=logits.device) < vocab_size
        return logits.masked_fill(~keep, float("-inf")), bias

    if int(gpt.vocab_size) <= vocab_size:  # megatron-core's GPTModel.vocab_size: the padded size
        return None
    return layer.register_forward_hook(hook)


def preference_loss(
    pc: Any,
    pr: Any,
    rc: Any,
    rr: Any,
    *,
    loss: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    completion_tokens: tuple[Any, Any] | None = None,
    predicted_tokens: tuple[Any, Any] | None = None,
    weight: Any = None,
    held_out: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """(mean loss over the pairs, TRL's metrics as 0-d tensors) from the policy's and reference's summed
    completion log-probabilities (``rc``/``rr`` unused by simpo). ``completion_tokens``: TRL's completion
    mask sums (ipo), ``predicted_tokens``: CPO's loss-mask sums (simpo's averages). ``weight``: 1 per pair,
    0 for a filler (validation under FSDP). ``held_out``: also ``reward_accuracy``, the share of pairs whose
    chosen reward beats the rejected one with a tie counted half (0.5 where the policy is its reference; TRL's
    strict ``rewards/accuracies`` is 0 there)."""
    import torch.nn.functional as F

    ls = label_smoothing
    if loss == "simpo":
        assert predicted_tokens is not None
        c, r = pc / predicted_tokens[0].clamp(min=1), pr / predicted_tokens[1].clamp(min=1)
        logits = c - r - simpo_gamma / beta
        per = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        reward_c, reward_r = beta * c.detach(), beta * r.detach()
    else:
        cl, rl = pc - rc, pr - rr
        d = cl - rl
        if loss == "sigmoid":
            per = -F.logsigmoid(beta * d)
        elif loss == "hinge":
            per = F.relu(1 - beta * d)
        elif loss == "ipo":
            assert completion_tokens is not None
            delta = cl / completion_tokens[0].clamp(min=1.0) - rl / completion_tokens[1].clamp(min=1.0)
            per = (delta - 1 / (2 * beta)) ** 2
        elif loss == "robust":
            per = (-(1 - ls) * F.logsigmoid(beta * d) + ls * F.logsigmoid(-beta * d)) / (1 - 2 * ls)
        else:
            raise ValueError(f"dpo.loss {loss!r}: one of sigmoid, ipo, hinge, robust, simpo")
        reward_c, reward_r = beta * cl.detach(), beta * rl.detach()
    w = weight if weight is not None else per.new_ones(per.shape)
    n = w.sum().clamp(min=1)

    def mean(x: Any) -> Any:
        return (x.float() * w).sum() / n

    stats = {
        "rewards/chosen": mean(reward_c),
        "rewards/rejected": mean(reward_r),
        "rewards/accuracies": mean((reward_c > reward_r).float()),
        "rewards/margins": mean(reward_c - reward_r),
        "logps/chosen": mean(pc.detach()),
        "logps/rejected": mean(pr.detach()),
    }
    if held_out:
        stats["reward_accuracy"] = mean((reward_c > reward_r).float() + 0.5 * (reward_c == reward_r).float())
    return mean(per), stats
