"""``snakellm serve`` settings: the one source of the server's flags and their defaults.

The CLI flags come from :class:`ServeSettings` through the settings framework
(``setting()`` fields, :func:`add_arguments`), so a default is written once,
here. The limits exist because one request holds the single model worker:
``max_prompts`` bounds prompts x n of one request, ``max_total_tokens`` the
tokens (prompt + new) it may put through the model, ``max_body_bytes`` what the
server reads before answering 413.
"""

from __future__ import annotations

from dataclasses import dataclass

from snakellm.config.settings import setting


@dataclass(frozen=True)
class ServeSettings:
    """``snakellm serve``: where to listen, who may call, what one request may ask for."""

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = setting(5555, "port (0: any free port; the chosen one is printed)")
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every request but GET /health (default: no key)"
    )
    model_name: str | None = setting(
        None, "the model id in OpenAI responses and GET /v1/models (default: the run's name)"
    )
    chat_template: str | None = setting(
        None,
        "the chat template for /v1/chat/completions: a Jinja file, or a tokenizer_config.json holding "
        "'chat_template' (default: the run's tokenizer_config.json, else snakellm's plain-text template)",
    )
    request_timeout: float = setting(
        600.0, "seconds a request may take (reading its body, waiting for the model, generating); then 408/503"
    )
    idle_timeout: float = setting(
        30.0, "seconds a connection may stay idle (no request yet, an unfinished request head, or between requests)"
    )
    max_prompts: int = setting(256, "the most prompts x n (OpenAI) or sentences (NeMo) in one request (else 413)")
    max_total_tokens: int = setting(
        131072, "the most tokens one request may run through the model: rows x (prompt + new tokens) (else 413)"
    )
    max_body_bytes: int = setting(16 * 1024 * 1024, "the largest request body read (else 413)")
    max_connections: int = setting(1024, "open connections at most; beyond it new requests get 503")
    device: str = setting("auto", "where the model runs", choices=("auto", "cpu", "cuda"))
    threads: int | None = setting(None, "torch CPU threads (default: torch's)")
    iteration: int | None = setting(None, "the checkpoint iteration (default: the latest)")
    blend: str | None = setting(None, "a blend.json naming the tokenizer files (default: the run's)")
    quiet: bool = setting(False, "no access log")
