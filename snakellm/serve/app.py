"""The HTTP application: Starlette routes over the model worker.

Routes: NeMo's ``PUT /generate``; OpenAI's ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``; ``GET /health``.
HTTP itself (keep-alive, chunked bodies, SSE framing, malformed requests) is
uvicorn's and Starlette's; this module reads bodies within the limits, checks
the API key, hands each request to the :class:`ModelWorker` and turns every
failure into its status and error object (errors.py), so one bad request
never affects the next.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from snakellm.serve import nemo_api, openai_api
from snakellm.serve.errors import APIError
from snakellm.serve.settings import ServeSettings
from snakellm.serve.worker import Abandoned, ModelWorker

log = logging.getLogger("snakellm.serve")


@dataclass
class Served:
    """What the routes share: the worker, the settings, the model's id and chat template."""

    worker: ModelWorker
    settings: ServeSettings
    model_name: str
    chat_template: Any = None  # snakellm.serve.chat.ChatTemplate

    @property
    def limits(self) -> openai_api.Limits:
        return openai_api.Limits(self.settings.max_prompts, self.settings.max_total_tokens)


def _auth(served: Served, request: Request) -> None:
    key = served.settings.api_key
    if not key:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        why = "no Authorization header" if not given else "the API key is not valid"
        raise APIError(
            401, f"Incorrect or missing API key ({why}): send 'Authorization: Bearer KEY'", None, "invalid_api_key"
        )


async def _read_json(served: Served, request: Request) -> Any:
    """The body as JSON: 413 past max_body_bytes, 408 when it does not arrive in time, 400 when not JSON."""
    limit = served.settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({declared} bytes) is larger than this server's limit of {limit} bytes")
    buf = bytearray()

    async def collect() -> None:
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > limit:
                raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes")

    try:
        await asyncio.wait_for(collect(), served.settings.request_timeout)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {served.settings.request_timeout} s") from None
    if not buf.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        return json.loads(buf)
    except ValueError as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}") from None


async def _on_model(served: Served, job: Callable[[Any, threading.Event], Any]) -> Any:
    """``job(generator, gone)`` on the model worker; ``gone`` is set when the request times out."""
    gone = threading.Event()
    try:
        return await served.worker.run(lambda gen: job(gen, gone), served.settings.request_timeout, gone)
    except (TimeoutError, Abandoned):
        raise APIError(
            503, f"the model did not finish this request within {served.settings.request_timeout} s"
        ) from None


def _sse(item: Any) -> bytes:
    return f"data: {json.dumps(item, ensure_ascii=False)}\n\n".encode()


async def _stream(served: Served, job: Callable[[Any, Callable[[Any], None], threading.Event], None]) -> Response:
    """A streamed response from ``job(generator, emit, gone)`` (see stream.py).

    The status is decided by the job's checks: the response starts once the job has emitted START;
    a failure before that is the request's error. A failure later ends the stream with an error
    event; a client that goes away sets ``gone`` and the generation stops at its next token.
    """
    from snakellm.serve.stream import END, START

    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def emit(item: Any) -> None:
        loop.call_soon_threadsafe(q.put_nowait, item)

    def run(gen: Any) -> None:
        try:
            job(gen, emit, gone)
        finally:
            emit(END)

    task = asyncio.ensure_future(served.worker.run(run, None, gone))
    try:
        first = await asyncio.wait_for(q.get(), served.settings.request_timeout)
    except TimeoutError:
        gone.set()
        raise APIError(
            503, f"the model did not start this request within {served.settings.request_timeout} s"
        ) from None
    if first != START:
        await task  # the job failed its checks: its APIError is the answer
        raise APIError(500, "internal error: the stream ended before it started")

    async def events() -> AsyncIterator[bytes]:
        try:
            while (item := await q.get()) != END:
                yield _sse(item)
            try:
                await task
            except APIError as e:
                yield _sse(e.body())
            except Exception as e:
                log.exception("a streamed request failed")
                yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
            yield b"data: [DONE]\n\n"
        finally:
            gone.set()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


Handler = Callable[[Served, Request], Awaitable[Response]]


def _endpoint(served: Served, fn: Handler, nemo: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """``fn`` with every failure answered: APIError as its status, anything else as a logged 500."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(served, request)
        except APIError as e:
            body = nemo_api.error_body(e) if nemo and e.status == 400 else e.body()
            return JSONResponse(body, status_code=e.status)
        except Exception as e:  # a bug: logged with its traceback, answered, and the server goes on
            log.exception("%s %s failed", request.method, request.url.path)
            err = APIError(500, f"internal error: {type(e).__name__}: {e}")
            return JSONResponse(err.body(), status_code=500)

    return endpoint


async def completions(served: Served, request: Request) -> Response:
    from snakellm.serve.stream import cancel_on, completion_job

    _auth(served, request)
    req = openai_api.parse_completion(await _read_json(served, request), served.model_name, served.limits)
    if req.stream:
        return await _stream(served, lambda gen, emit, gone: completion_job(gen, req, served.limits, emit, gone))

    def job(gen: Any, gone: threading.Event) -> Any:
        choices = openai_api.run(gen, req, served.limits, on_step=cancel_on(gone))
        return openai_api.completion_body(gen, req, choices)

    return JSONResponse(await _on_model(served, job))


async def nemo_generate(served: Served, request: Request) -> Response:
    _auth(served, request)
    sentences, params, opts = nemo_api.parse(await _read_json(served, request), served.limits)
    out = await _on_model(served, lambda gen, gone: nemo_api.run(gen, sentences, params, opts, served.limits, gone))
    return JSONResponse(out)


async def models(served: Served, request: Request) -> Response:
    _auth(served, request)
    return JSONResponse({"object": "list", "data": [_model_card(served)]})


async def model(served: Served, request: Request) -> Response:
    _auth(served, request)
    name = request.path_params["name"]
    if name != served.model_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist: this server serves '{served.model_name}'",
            "model",
            "model_not_found",
        )
    return JSONResponse(_model_card(served))


def _model_card(served: Served) -> dict:
    return {"id": served.model_name, "object": "model", "created": int(served.worker.started), "owned_by": "snakellm"}


async def health(served: Served, request: Request) -> Response:
    return JSONResponse({"status": "ok", "model": served.model_name})


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 (no such route / method) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path} (PUT /generate, POST /v1/completions, POST /v1/chat/completions, GET /v1/models)"
    elif exc.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path} (allowed: {(exc.headers or {}).get('Allow', '')})"
    else:
        msg = str(exc.detail)
    return JSONResponse(APIError(exc.status_code, msg).body(), status_code=exc.status_code, headers=exc.headers)


def create_app(served: Served) -> Starlette:
    from snakellm.serve import chat

    routes = [
        Route("/generate", _endpoint(served, nemo_generate, nemo=True), methods=["PUT"]),
        Route("/v1/completions", _endpoint(served, completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(served, chat.endpoint), methods=["POST"]),
        Route("/v1/models", _endpoint(served, models), methods=["GET"]),
        Route("/v1/models/{name:path}", _endpoint(served, model), methods=["GET"]),
        Route("/health", _endpoint(served, health), methods=["GET"]),
        Route("/", _endpoint(served, health), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
