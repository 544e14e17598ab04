"""``snakellm serve``: a checkpoint over HTTP on uvicorn, NeMo- and OpenAI-compatible.

``PUT /generate`` is NeMo ``MegatronServer``'s API (nemo_api.py);
``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models``
are OpenAI's, as the ``openai`` client and lm-eval call them (openai_api.py,
chat.py). The HTTP stack is uvicorn (h11) + Starlette (app.py); requests run
on the continuous-batching engine (engine/serving.py): concurrent clients share
the running decode batch, one scheduler thread owns the model.

uvicorn closes a kept-alive connection that stays idle after a response; it
does not time out a connection that never completes a request head (a
stalled or slow client). :func:`idle_protocol` adds that: every connection
without a request in progress is closed after ``idle_timeout`` seconds.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Any

from snakellm.serve.engine.settings import EngineSettings
from snakellm.serve.settings import ServeSettings

log = logging.getLogger("snakellm.serve")


def idle_protocol() -> type:
    """uvicorn's h11 protocol with the idle timeout also before and during a request head."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_idle()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_idle()  # a request head not complete yet: it must arrive in time

        def _arm_idle(self) -> None:
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    return IdleTimeoutH11Protocol


def make_server(app: Any, settings: ServeSettings) -> Any:
    import copy

    import uvicorn
    import uvicorn.config

    # one stream: uvicorn sends its access log to stdout and everything else to stderr; ours all go to stderr
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config = uvicorn.Config(
        app,
        log_config=log_config,
        http=idle_protocol(),
        ws="none",
        lifespan="off",
        timeout_keep_alive=max(1, int(round(settings.idle_timeout))),
        limit_concurrency=settings.max_connections,
        log_level="warning" if settings.quiet else "info",
        access_log=not settings.quiet,
        server_header=False,
    )
    return uvicorn.Server(config)


def bind(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def build(
    gen: Any,
    settings: ServeSettings,
    model_name: str,
    tokenizer_block: dict | None = None,
    run_dir: Path | None = None,
    engine: EngineSettings | None = None,
) -> Any:
    """The Starlette app serving ``gen`` (the chat template from the settings, the run, or the default).

    Requests run on the continuous-batching engine (:class:`BatchingWorker`): concurrent clients
    share the decode batch.
    """
    from snakellm.serve.app import Served, create_app
    from snakellm.serve.chat import load_template
    from snakellm.serve.engine.serving import BatchingWorker

    template = load_template(settings.chat_template, tokenizer_block or {}, run_dir, gen.tok)
    log.info("chat template: %s", template.source)
    return create_app(Served(BatchingWorker(gen, engine), settings, model_name, template))


def serve_in_thread(
    gen: Any, settings: ServeSettings, model_name: str, engine: EngineSettings | None = None
) -> tuple[str, Any]:
    """(url, stop) of a server on a background thread (for scripts; ``stop()`` ends it)."""
    sock = bind(settings.host, settings.port)
    server = make_server(build(gen, settings, model_name, engine=engine), settings)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()

    def stop() -> None:
        server.should_exit = True
        t.join(timeout=30)
        sock.close()

    return f"http://{settings.host}:{sock.getsockname()[1]}", stop
