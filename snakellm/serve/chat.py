"""OpenAI chat completions: messages -> the run's chat template -> a completion.

The template is a Jinja template as Hugging Face writes them
(``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``),
rendered the way ``transformers``' ``apply_chat_template`` renders it (a
sandboxed environment with ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``bos_token``/``eos_token``, ``add_generation_prompt``),
so a served import gives the same prompt as the Hugging Face model. Where it
comes from, first found: ``serve --chat-template`` (a Jinja file or a
tokenizer_config.json), the run's tokenizer directory (an imported model keeps
its tokenizer_config.json there), else :data:`DEFAULT_TEMPLATE`, a plain-text
template for runs trained here (they have no chat tokens)::

    System: ...\\n\\nUser: ...\\n\\nAssistant: ...\\n\\nAssistant:

Messages: ``role`` system, developer (rendered as system), user or assistant;
``content`` a string or a list of ``{"type": "text", "text": ...}`` parts;
``name`` passed to the template. Tool calls, images and audio are rejected.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snakellm.serve.errors import APIError, bad
from snakellm.serve.openai_api import (
    Choice,
    GenRequest,
    _common,
    _model,
    _sampling,
    _usage,
    pieces,
    run,
    stream_chunk,
    usage_chunk,
)
from snakellm.serve.sampling import Fields, alternative_texts, is_int, token_bytes, token_texts

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant")


@dataclass
class ChatTemplate:
    text: str
    source: str  # where it came from, for the startup log
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict]) -> str:
        # the renderer fine-tuning uses (transformers' environment): served prompts are the trained ones
        from snakellm.finetune import chat_template as ct

        t = ct.ChatTemplate(self.text, self.source, {"bos_token": self.bos_token, "eos_token": self.eos_token})
        try:
            return t.render(messages, add_generation_prompt=True)
        except ct.ChatTemplateError as e:
            if "refused the conversation" in str(e):
                raise bad("messages", f"the chat template refused the messages: {str(e).split(': ', 1)[1]}") from None
            raise APIError(500, f"the chat template ({self.source}) failed: {e}") from None


def _from_file(path: Path) -> str | None:
    if path.suffix == ".json":
        t = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(t, list):  # [{name, template}, ...]: the default one
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return path.read_text(encoding="utf-8")


def load_template(option: str | None, tokenizer_block: dict, run_dir: Path | None, tok: Any) -> ChatTemplate:
    """The chat template: the option, else the run's tokenizer directory, else the default."""
    from snakellm.serve.generate import bos_id, token_strings, tokenizer_base

    specials = {"bos_token": token_strings(tok, [bos_id(tok)])[0], "eos_token": token_strings(tok, [tok.eod_id])[0]}
    if option:
        p = Path(option)
        text = _from_file(p) if p.is_file() else None
        if text is None:
            raise ValueError(
                f"--chat-template {option}: not a Jinja file or a tokenizer_config.json with chat_template"
            )
        return ChatTemplate(text, str(p), **specials)
    if isinstance(tokenizer_block.get("chat_template"), str):  # recorded with the run (import, chat fine-tune)
        return ChatTemplate(tokenizer_block["chat_template"], "the run's tokenizer block", **specials)
    base = tokenizer_base(tokenizer_block, run_dir) if run_dir is not None else None
    dirs = []
    for f in (tokenizer_block.get("files") or {}).values():
        p = Path(f)
        if not p.is_absolute() and base is not None:
            p = base / p
        if p.parent not in dirs:
            dirs.append(p.parent)
    for d in dirs:
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (d / name).is_file():
                text = _from_file(d / name)
                if text:
                    return ChatTemplate(text, str(d / name), **specials)
    return ChatTemplate(DEFAULT_TEMPLATE, "snakellm's default plain-text template", **specials)


def _content(i: int, c: Any, role: str) -> str:
    if isinstance(c, str):
        return c
    if c is None and role == "assistant":
        return ""
    if isinstance(c, list):
        out = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(
                    f"messages[{i}].content", f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}"
                )
            out.append(part["text"])
        return "".join(out)
    raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def parse_messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise bad(
                f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}"
            )
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(
                f"messages[{i}]", f"messages[{i}].{sorted(extra)[0]} is not supported (no tools or function calls)"
            )
        if "content" not in m:
            raise bad(f"messages[{i}].content", f"messages[{i}].content is required")
        msg = {"role": "system" if role == "developer" else role, "content": _content(i, m["content"], role)}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise bad(f"messages[{i}].name", f"messages[{i}].name must be a string")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body: Any, model_name: str, limits: Any, template: ChatTemplate) -> GenRequest:
    """POST /v1/chat/completions' body -> a GenRequest whose one prompt is the rendered conversation."""
    f = Fields(body)
    model = _model(f, model_name)
    messages = parse_messages(f.rest.pop("messages", None))
    mt = f.take("max_tokens", None, lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
    mct = f.take("max_completion_tokens", None, lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
    if mt is not None and mct is not None and mt != mct:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    max_tokens = mct or mt
    want = f.take("logprobs", False, lambda v: isinstance(v, bool), "must be a boolean")
    top = f.take("top_logprobs", None, lambda v: is_int(v) and 0 <= v <= 20, "must be an integer in [0, 20]")
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    n, stream, usage = _common(f, limits, 1)
    params = _sampling(f, max_tokens or 10**9)
    f.done()
    prompt = template.render(messages)
    lp = (top or 0) if want else None
    return GenRequest(
        [prompt], n, params, False, lp, stream, usage, list(params.end_strings), model, max_tokens is None
    )


def _entry(gen: Any, c: Choice, i: int) -> dict:
    """Token ``i`` of prompt + completion: its text as :func:`token_texts` spells it (a leading space kept),
    its bytes, and its alternatives spelt the same way at the same place."""
    assert c.scored is not None
    tok, ids, alts = gen.tok, c.scored.ids, c.scored.top[i]

    def one(s: str, t: int, p: float | None) -> dict:
        raw = token_bytes(tok, t) if s.startswith("bytes:") else s.encode("utf-8")
        return {"token": s, "logprob": p, "bytes": list(raw)}

    (text,) = token_texts(tok, ids, i, i + 1)
    keys = alternative_texts(tok, ids, i, [t for t, _ in alts])
    return {
        **one(text, ids[i], c.scored.logprobs[i]),
        "top_logprobs": [one(k, t, p) for k, (t, p) in zip(keys, alts, strict=True)],
    }


def _logprobs(gen: Any, c: Choice, lo: int, hi: int) -> dict | None:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` for tokens lo..hi."""
    if c.scored is None:
        return None
    p = len(c.prompt_ids)
    return {"content": [_entry(gen, c, p + i) for i in range(lo, hi)]}


def _shown(c: Choice) -> int:
    """Generated tokens the client sees (a final end-of-document token is not content)."""
    return len(c.ids) - (1 if c.eod else 0)


def chat_body(gen: Any, req: GenRequest, choices: list[Choice]) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": _now(),
        "model": req.model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(gen, c, 0, _shown(c)),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": _usage(choices, req.n),
    }


def chat_chunk(
    req: GenRequest, cid: str, created: int, index: int, delta: dict, lp: dict | None, reason: str | None
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
    return stream_chunk(req, cid, created, "chat.completion.chunk", choice)


def chat_chunks(gen: Any, req: GenRequest, choices: list[Choice], cid: str, created: int) -> list[dict]:
    """A finished chat completion as stream chunks: the role, one chunk per token, the finish."""
    out = []
    for c in choices:
        out.append(chat_chunk(req, cid, created, c.index, {"role": "assistant", "content": ""}, None, None))
        for i, text in enumerate(pieces(gen, c)[: _shown(c)]):
            out.append(chat_chunk(req, cid, created, c.index, {"content": text}, _logprobs(gen, c, i, i + 1), None))
        out.append(chat_chunk(req, cid, created, c.index, {}, None, c.finish_reason))
    if req.include_usage:
        out.append(usage_chunk(req, cid, created, "chat.completion.chunk", choices))
    return out


def _now() -> int:
    import time

    return int(time.time())


async def endpoint(served: Any, request: Any) -> Any:
    """POST /v1/chat/completions."""
    from starlette.responses import JSONResponse

    from snakellm.serve.app import _auth, _on_model, _read_json, _stream
    from snakellm.serve.stream import cancel_on, chat_job

    _auth(served, request)
    req = parse_chat(await _read_json(served, request), served.model_name, served.limits, served.chat_template)
    if req.stream:
        return await _stream(served, lambda gen, emit, gone: chat_job(gen, req, served.limits, emit, gone))

    def job(gen: Any, gone: Any) -> Any:
        return chat_body(gen, req, run(gen, req, served.limits, on_step=cancel_on(gone)))

    return JSONResponse(await _on_model(served, job))
