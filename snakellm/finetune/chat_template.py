"""Chat templates: which one, rendered exactly as ``transformers`` renders it, and where the assistant turns are.

**Which template** (:func:`load_template`): by default the model's own, from the run's
tokenizer directory (an imported Hugging Face model keeps its ``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template`` there); else a built-in by name (``chatml``,
``llama3``, ``mistral``: :data:`BUILTIN`) or a Jinja file (or a ``tokenizer_config.json``
holding one). No template and no setting is an error naming ``examples.chat_template``.

**Rendering** (:meth:`ChatTemplate.render`): the environment ``transformers``'
``apply_chat_template`` compiles (``chat_template_utils._cached_compile_jinja_template``):
a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks`` and loop controls, its
``tojson`` (no HTML escaping), ``raise_exception``, ``strftime_now``, the ``{% generation %}``
tag, and the tokenizer's special-token strings (``bos_token``, ``eos_token``, ...) as
variables. Tokenizing the rendered text without adding special tokens
(:class:`ChatTokenizer`) then gives ``apply_chat_template(tokenize=True)``'s ids: the
template's own BOS is the only BOS.

**Trained spans without generation markers** (:meth:`ChatTemplate.assistant_spans`): most
shipped templates have no ``{% generation %}`` markers, so the spans are found by rendering
the conversation prefix by prefix: assistant turn ``i`` is the text between the render of
``messages[:i]`` with the generation prompt (which ends with the role header) and the render
of ``messages[:i+1]`` (which ends with the turn's end-of-turn token), both of which must be
prefixes of the whole render. Inside it, the span starts where the message's content starts,
so a header the template writes with the message is never trained. A turn that cannot be
located that way is an error naming the template: an all-ones mask is never the fallback.
A template that does carry markers is trusted instead: its ``{% generation %}`` blocks are
the spans, so the mask is transformers' ``return_assistant_tokens_mask`` (and TRL's
``assistant_only_loss``) for it. Tokens overlapping a span are trained (transformers' rule).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from snakellm.errors import DataError

#: Built-in templates (text as Hugging Face model repositories ship them).
BUILTIN: dict[str, str] = {
    # ChatML, as Qwen2 / OpenHermes ship it (no default system prompt)
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama 3 Instruct (Meta-Llama-3-8B-Instruct's tokenizer_config.json)
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Mistral Instruct v0.1 (user/assistant alternating); a system prompt goes in front of the first user turn
    "mistral": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}"
        "{% set loop_messages = messages %}{% endif %}"
        "{{ bos_token }}{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{% if loop.first %}{{ '[INST] ' + system + message['content'] + ' [/INST]' }}"
        "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only system, user and assistant roles are supported!') }}{% endif %}"
        "{% endfor %}"
    ),
}

TRAIN_ON = ("all_assistant", "last_assistant", "all")
SETTING = "examples.chat_template"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(DataError):
    """A template that is missing, does not render, or whose assistant turns cannot be located."""


class _TemplateRaised(ChatTemplateError):
    """The template called raise_exception (rephrased with the template's source)."""


_TRACK: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("chat_generation_spans", default=None)


@lru_cache(maxsize=16)
def _compile(text: str) -> Any:
    """The Jinja template compiled in transformers' environment (same options, filters and globals)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (the markers only tag spans)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            out = str(caller())
            track = _TRACK.get()
            if track is not None:  # (blocks rendered so far, spans): the body starts after the blocks
                start = sum(map(len, track[0]))
                track[1].append((start, start + len(out)))
            return out

    def raise_exception(message: str) -> None:
        raise _TemplateRaised(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    return env.from_string(text)


@dataclass
class ChatTemplate:
    """A chat template with the special-token strings it is rendered with."""

    text: str
    source: str  # where it came from: a file, a built-in name, the run's tokenizer directory
    specials: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as transformers passes them

    @property
    def has_generation_markers(self) -> bool:
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.text) is not None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """The template's text for ``messages``, as ``apply_chat_template(tokenize=False)`` gives it."""
        return self._render(messages, add_generation_prompt, kwargs)[0]

    def generation_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The render and the character spans of its ``{% generation %}`` blocks (what transformers tracks)."""
        return self._render(messages, False, {})

    def _render(
        self, messages: Sequence[dict], add_generation_prompt: bool, kwargs: dict
    ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        variables = {**self.specials, **kwargs}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACK.set((blocks, spans))
        try:
            for block in _compile(self.text).generate(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ):
                blocks.append(block)
            return "".join(blocks), spans
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template ({self.source}) refused the conversation: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.source}) failed: {e}") from None
        finally:
            _TRACK.reset(token)

    def assistant_spans(
        self, messages: Sequence[dict], train_on: str = "all_assistant"
    ) -> tuple[str, list[tuple[int, int]]]:
        """The whole render and the character spans trained: each assistant content and its end-of-turn text.

        ``train_on``: ``all_assistant`` (every assistant turn), ``last_assistant`` (the last one), ``all``
        (the whole text). The span of turn ``i`` runs from its content's start in the render to the end of
        the render of ``messages[:i+1]`` (the end-of-turn token and what the template writes after it).
        """
        if train_on not in TRAIN_ON:
            raise ChatTemplateError(f"train_on {train_on!r}: expected one of {', '.join(TRAIN_ON)}")
        full, marked = self._render(messages, False, {})
        if train_on == "all":
            return full, [(0, len(full))]
        if self.has_generation_markers:  # the template tags its own spans: use them (as TRL and transformers do)
            if not marked:
                raise ChatTemplateError(
                    f"chat template ({self.source}): no {{% generation %}} span in the conversation"
                )
            return full, marked[-1:] if train_on == "last_assistant" else marked
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if train_on == "last_assistant":
            turns = turns[-1:]
        spans = []
        for i in turns:
            spans.append(self._turn_span(messages, i, full))
        return full, spans

    def _turn_span(self, messages: Sequence[dict], i: int, full: str) -> tuple[int, int]:
        head = self.render(messages[:i], add_generation_prompt=True) if i else ""
        upto = self.render(messages[: i + 1])
        why = None
        if not upto.startswith(head):
            why = "the render with the generation prompt is not a prefix of the render with the assistant turn"
        elif not full.startswith(upto):
            why = "the render up to the turn is not a prefix of the whole conversation's render"
        content = str(messages[i].get("content") or "")
        turn = upto[len(head) :]
        key = content if content.strip() and content in turn else content.strip()  # a template may trim it
        at = turn.rfind(key) if key else len(turn) - len(turn.lstrip())
        if why is None and at < 0:
            why = "the message's content does not appear in its turn's text"
        if why is not None:
            raise ChatTemplateError(
                f"chat template ({self.source}): cannot locate assistant turn {i} ({why}); set "
                f"{SETTING} to a template that renders conversations turn by turn (e.g. chatml, llama3, mistral)"
            )
        return len(head) + at, len(upto)


def specials_from_config(cfg: dict[str, Any]) -> dict[str, str]:
    """The special-token strings of a ``tokenizer_config.json`` (as strings or ``{content: ...}``)."""
    out = {}
    for k in _SPECIAL_KEYS:
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


def _text_of(path: Path) -> str | None:
    if path.suffix == ".json":
        try:
            t = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(t, list):  # [{name, template}, ...]: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return path.read_text(encoding="utf-8")


def own_template(tokenizer_dir: str | Path | None) -> tuple[str, str] | None:
    """(text, source) of a tokenizer directory's own template: ``chat_template.jinja``, else tokenizer_config's."""
    if tokenizer_dir is None:
        return None
    d = Path(tokenizer_dir)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        p = d / name
        if p.is_file():
            text = _text_of(p)
            if text:
                return text, str(p)
    return None


def load_template(
    setting: str | None, tokenizer_dir: str | Path | None, specials: dict[str, str] | None = None
) -> ChatTemplate:
    """The chat template for a run: the setting (a built-in name or a file), else the run's own.

    ``specials`` default to the tokenizer directory's ``tokenizer_config.json`` special tokens.
    """
    if specials is None:
        specials = {}
        cfg_file = Path(tokenizer_dir) / "tokenizer_config.json" if tokenizer_dir is not None else None
        if cfg_file is not None and cfg_file.is_file():
            try:
                specials = specials_from_config(json.loads(cfg_file.read_text(encoding="utf-8")))
            except ValueError as e:
                raise ChatTemplateError(f"{cfg_file}: not valid JSON: {e}") from None
    if setting:
        if setting in BUILTIN:
            return ChatTemplate(BUILTIN[setting], f"built-in {setting}", dict(specials))
        p = Path(setting)
        text = _text_of(p) if p.is_file() else None
        if not text:
            raise ChatTemplateError(
                f"{SETTING} {setting!r}: not a built-in ({', '.join(BUILTIN)}), a Jinja file or a "
                "tokenizer_config.json with a chat_template"
            )
        return ChatTemplate(text, str(p), dict(specials))
    found = own_template(tokenizer_dir)
    if found is None:
        raise ChatTemplateError(
            f"the run's tokenizer{f' ({tokenizer_dir})' if tokenizer_dir else ''} has no chat template: set "
            f"{SETTING} to one of {', '.join(BUILTIN)} or a Jinja file"
        )
    return ChatTemplate(found[0], found[1], dict(specials))


class ChatTokenizer:
    """Rendered chat text -> token ids and character offsets, as transformers tokenizes it.

    A ``tokenizer.json`` is encoded with ``tokenizers`` (what transformers' fast tokenizer is),
    control tokens in the text encoded as themselves and no special tokens added. Any other
    tokenizer (GPT-2 BPE files, SentencePiece) splits the text on the added/special tokens'
    strings first (as transformers' slow tokenizers do) and encodes the pieces between them.
    """

    def __init__(self, tokenizer: Any, tokenizer_dir: str | Path | None = None, specials: Sequence[str] = ()) -> None:
        self.tok = tokenizer
        self._rust = None
        tf = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
        if getattr(tokenizer, "kind", None) == "huggingface":
            tf = Path(tokenizer.files["tokenizer_file"])
        if tf is not None and tf.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self._rust = HFTokenizer.from_file(str(tf))
            self._rust.no_truncation()
            self._rust.no_padding()
            self._rust.encode_special_tokens = False
        words = {s for s in specials if s}
        if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer_config.json").is_file():
            cfg = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
            for v in (cfg.get("added_tokens_decoder") or {}).values():
                if isinstance(v, dict) and isinstance(v.get("content"), str):
                    words.add(v["content"])
            words |= set(specials_from_config(cfg).values())
        eod = getattr(tokenizer, "eod_token", None)
        if eod:
            words.add(eod)
        self._words = sorted(words, key=len, reverse=True)
        self._ids: dict[str, int] = {}

    def _special_id(self, word: str) -> int:
        if word not in self._ids:
            ids = list(map(int, self.tok.encode(word)))
            if len(ids) != 1:
                sp = getattr(self.tok, "_sp", None)
                pid = sp.piece_to_id(word) if sp is not None else None
                if pid is None or (sp is not None and pid == sp.unk_id()):
                    raise ChatTemplateError(f"the tokenizer has no single token for {word!r}")
                ids = [int(pid)]
            self._ids[word] = ids[0]
        return self._ids[word]

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` and each token's (start, end) character offsets."""
        if self._rust is not None:
            e = self._rust.encode(text, add_special_tokens=False)
            return list(e.ids), [tuple(o) for o in e.offsets]  # type: ignore[misc]
        ids: list[int] = []
        offs: list[tuple[int, int]] = []
        pattern = re.compile("|".join(map(re.escape, self._words))) if self._words else None
        pos = 0
        for m in list(pattern.finditer(text)) if pattern else []:
            self._piece(text, pos, m.start(), ids, offs)
            ids.append(self._special_id(m.group(0)))
            offs.append((m.start(), m.end()))
            pos = m.end()
        self._piece(text, pos, len(text), ids, offs)
        return ids, offs

    def _piece(self, text: str, a: int, b: int, ids: list[int], offs: list[tuple[int, int]]) -> None:
        """Encode ``text[a:b]``; each token's offsets: the characters its bytes fall in (as ``tokenizers`` gives)."""
        if a >= b:
            return
        sp = getattr(self.tok, "_sp", None)
        if sp is not None:  # SentencePiece gives each piece's byte span itself
            raw = text[a:b].encode("utf-8")
            char_at = [0] * (len(raw) + 1)
            pos = 0
            for i, ch in enumerate(text[a:b]):
                for _ in range(len(ch.encode("utf-8"))):
                    char_at[pos] = i
                    pos += 1
            char_at[len(raw)] = b - a
            try:
                proto = sp.encode(text[a:b], return_type="proto")  # sentencepiece >= 0.2.1
            except TypeError:
                proto = sp.encode(text[a:b], out_type="immutable_proto")
            for p in proto.pieces:
                ids.append(int(p.id))
                end = char_at[p.end - 1] + 1 if p.end > p.begin else char_at[p.begin]
                offs.append((a + char_at[p.begin], a + end))
            return
        piece = list(map(int, self.tok.encode(text[a:b])))
        decode_bytes = getattr(self.tok, "decode_bytes", None)
        raw = text[a:b].encode("utf-8")
        char_of = [i for i, ch in enumerate(text[a:b]) for _ in range(len(ch.encode("utf-8")))]
        done = 0  # bytes of the piece covered by the tokens so far
        n_bytes = 0
        for k in range(len(piece)):
            if decode_bytes is not None:  # byte-level BPE: every token is its own bytes
                n_bytes += len(decode_bytes(piece[k : k + 1]))
            else:
                n_bytes = len(self.tok.decode(piece[: k + 1]).encode("utf-8"))
            n_bytes = min(n_bytes, len(raw))
            start = char_of[done] if done < len(raw) else len(char_of)
            end = char_of[n_bytes - 1] + 1 if n_bytes > done else start
            ids.append(piece[k])
            offs.append((a + start, a + end))
            done = max(done, n_bytes)


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a span (transformers' rule for ``return_assistant_tokens_mask``)."""
    mask = [0] * len(offsets)
    ordered = sorted(spans)
    j = 0
    for t, (a, b) in enumerate(offsets):
        while j < len(ordered) and a >= ordered[j][1]:
            j += 1
        if j == len(ordered):
            break
        if b > ordered[j][0] and b > a:
            mask[t] = 1
    return mask


def encode_chat(
    template: ChatTemplate, tokenizer: ChatTokenizer, messages: Sequence[dict], train_on: str = "all_assistant"
) -> tuple[list[int], list[int]]:
    """(input_ids, trained flags) of a conversation: the template's ids, 1 on the assistant spans."""
    text, spans = template.assistant_spans(messages, train_on)
    ids, offsets = tokenizer.encode(text)
    return ids, token_mask(offsets, spans)
