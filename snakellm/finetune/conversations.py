"""Conversations as fine-tuning examples: the adapter of the ``messages`` and ``sharegpt`` formats.

A record is one conversation. :func:`normalize` turns OpenAI's ``messages`` (``{role, content}``,
roles ``system``/``developer``, ``user``, ``assistant``) or ShareGPT's ``conversations``
(``{from, value}``, ``human``/``gpt``/``system``) into ``[{role, content}, ...]``, or names what is
wrong (an unknown role, non-string content, an empty conversation, no assistant turn): prepare-sft
quarantines such records with their place. :class:`ChatEncoder` renders a conversation through
the chat template (snakellm.finetune.chat_template) into one :class:`~snakellm.finetune.dataset.Example`
whose per-token mask trains the assistant spans; a conversation longer than the sequence loses whole
turns (a user message and the replies after it) from the oldest, the system prompt kept; one still
too long with a single turn left is skipped. Both are counted (:class:`ChatStats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from snakellm.finetune import chat_template as ct
from snakellm.finetune.dataset import Example, SFTFormatError

ROLE_MAPS: dict[str, dict[str, str]] = {
    "messages": {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"},
    "sharegpt": {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"},
}
FIELDS = {"messages": ("role", "content"), "sharegpt": ("from", "value")}
DEFAULT_KEYS = {"messages": "messages", "sharegpt": "conversations"}


def normalize(turns: Any, fmt: str) -> tuple[list[dict] | None, str | None]:
    """(``[{role, content}]``, None) for a valid conversation, else (None, the reason)."""
    role_key, content_key = FIELDS[fmt]
    roles = ROLE_MAPS[fmt]
    if not isinstance(turns, list):
        return None, "conversation is not a list"
    if not turns:
        return None, "empty conversation"
    out = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            return None, f"message {i} is not an object"
        role = m.get(role_key)
        if role not in roles:
            return None, f"unknown role {role!r} (message {i})"
        content = m.get(content_key)
        if not isinstance(content, str):
            return None, f"non-string content (message {i})"
        if not content.strip():
            return None, f"empty content (message {i})"
        out.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        return None, "no assistant turn"
    return out, None


def is_conversation(rec: dict) -> bool:
    return isinstance(rec.get("messages"), list)


def turn_groups(messages: Sequence[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(leading system messages, turns): each turn starts at a user message and holds the replies after it."""
    k = 0
    while k < len(messages) and messages[k]["role"] == "system":
        k += 1
    head = list(messages[:k])
    groups: list[list[dict]] = []
    for m in messages[k:]:
        if m["role"] == "user" or not groups:
            groups.append([m])
        else:
            groups[-1].append(m)
    return head, groups


@dataclass
class ChatStats:
    examples: int = 0
    shortened: int = 0  # conversations that lost turns to fit
    turns_dropped: int = 0
    skipped_too_long: int = 0
    trained_tokens: int = 0
    tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class ChatEncoder:
    """Conversations -> examples (token ids + trained mask) through one chat template."""

    def __init__(
        self,
        template: ct.ChatTemplate,
        tokenizer: ct.ChatTokenizer,
        max_seq_length: int,
        train_on: str = "all_assistant",
        reserved: int = 0,
    ) -> None:
        if train_on not in ct.TRAIN_ON:
            raise SFTFormatError(f"train_on {train_on!r}: expected one of {', '.join(ct.TRAIN_ON)}")
        self.template, self.tok, self.max_seq_length = template, tokenizer, max_seq_length
        self.train_on, self.reserved = train_on, reserved
        self.stats = ChatStats()
        self.skipped: list[Any] = []  # where each skipped conversation was (its line)

    def _encode(self, messages: Sequence[dict], where: str) -> tuple[list[int], list[int]]:
        try:
            return ct.encode_chat(self.template, self.tok, messages, self.train_on)
        except ct.ChatTemplateError as e:
            raise SFTFormatError(f"{where}: {e}") from None

    def encode(self, rec: dict, where: str = "") -> Example | None:
        """The conversation as one example (None: too long even with one turn; counted)."""
        messages = rec["messages"]
        budget = self.max_seq_length - self.reserved
        ids, mask = self._encode(messages, where)
        dropped = 0
        if len(ids) > budget:
            head, groups = turn_groups(messages)
            while len(ids) > budget and len(groups) > 1:
                groups = groups[1:]
                dropped += 1
                rest = head + [m for g in groups for m in g]
                if not any(m["role"] == "assistant" for m in rest):
                    break
                ids, mask = self._encode(rest, where)
        self.stats.examples += 1
        if len(ids) > budget or not any(mask):
            self.stats.skipped_too_long += 1
            self.skipped.append(rec.get("_line", where))
            return None
        if dropped:
            self.stats.shortened += 1
            self.stats.turns_dropped += dropped
        self.stats.tokens += len(ids)
        self.stats.trained_tokens += sum(mask)
        return Example(ids, [], rec, truncated=dropped, mask=mask)

    def encode_all(self, records: Sequence[dict], path: str = "") -> list[Example]:
        out = []
        for r in records:
            e = self.encode(r, f"{path}:{r.get('_line', '?')}")
            if e is not None:
                out.append(e)
        return out

    def prompt_and_reply(self, rec: dict, where: str = "") -> tuple[list[int], str, str, str]:
        """For evaluation: the prompt (the conversation without its last assistant turn, plus the generation
        prompt) as ids, the reference reply, the text that ends a reply (the template's end-of-turn), and the
        prompt's text."""
        messages = rec["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        try:
            prompt = self.template.render(messages[:last], add_generation_prompt=True)
            _, spans = self.template.assistant_spans(messages[: last + 1], "last_assistant")
            full = self.template.render(messages[: last + 1])
        except ct.ChatTemplateError as e:
            raise SFTFormatError(f"{where}: {e}") from None
        reply = messages[last]["content"]
        a, b = spans[-1]
        turn = full[a:b]
        at = turn.find(reply.strip()) if reply.strip() else 0
        end = turn[at + len(reply.strip()) :].strip() if at >= 0 else ""
        ids, _ = self.tok.encode(prompt)
        return ids, reply, end, prompt


def length_warning(path: Any, enc: ChatEncoder) -> str | None:
    """The job log's line about conversations shortened or skipped for length (None when none was)."""
    st = enc.stats
    if not st.shortened and not st.skipped_too_long:
        return None
    rows = ", ".join(map(str, enc.skipped[:5])) + (", ..." if len(enc.skipped) > 5 else "")
    return (
        f"warning: {path}: {st.shortened} of {st.examples} conversations longer than {enc.max_seq_length - 1} "
        f"tokens lost their oldest turns ({st.turns_dropped} turns dropped, system prompts kept); "
        f"{st.skipped_too_long} still too long were skipped" + (f" (lines {rows})" if rows else "")
    )


def chat_encoder(
    tok_info: dict, tokenizer: Any, chat_template: str | None, max_seq_length: int, train_on: str, reserved: int = 0
) -> ChatEncoder:
    """The encoder for a run's tokenizer block: its own template unless ``chat_template`` names one."""
    tdir = tokenizer_dir(tok_info)
    specials = None
    if tok_info.get("chat_template") and not chat_template and not ct.own_template(tdir):
        tmpl = ct.ChatTemplate(str(tok_info["chat_template"]), "the run's tokenizer block")
    else:
        try:
            tmpl = ct.load_template(chat_template, tdir, specials)
        except ct.ChatTemplateError as e:
            raise SFTFormatError(str(e)) from None
    if not tmpl.specials:
        tmpl.specials = {"eos_token": tok_info.get("eod_token") or ""}
    return ChatEncoder(tmpl, ct.ChatTokenizer(tokenizer, tdir), max_seq_length, train_on, reserved)


def tokenizer_dir(tok_info: dict) -> str | None:
    """The directory of a run's tokenizer files (an imported model's tokenizer_config.json lies there)."""
    from pathlib import Path

    files = [Path(f) for f in (tok_info.get("files") or {}).values()]
    return str(files[0].parent) if files else None
