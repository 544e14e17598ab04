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


async def _on_model(served: Served, job: Callable[[Any], Any]) -> Any:
    try:
        return await served.worker.run(job, served.settings.request_timeout)
    except (TimeoutError, Abandoned):
        raise APIError(
            503, f"the model did not finish this request within {served.settings.request_timeout} s"
        ) from None


def _sse(chunks: list[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for c in chunks:
            yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode()
        yield b"data: [DONE]\n\n"

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
    _auth(served, request)
    req = openai_api.parse_completion(await _read_json(served, request), served.model_name, served.limits)

    def job(gen: Any) -> Any:
        choices = openai_api.run(gen, req, served.limits)
        if req.stream:
            return openai_api.completion_chunks(gen, req, choices)
        return openai_api.completion_body(gen, req, choices)

    out = await _on_model(served, job)
    return _sse(out) if req.stream else JSONResponse(out)


async def nemo_generate(served: Served, request: Request) -> Response:
    _auth(served, request)
    sentences, params, opts = nemo_api.parse(await _read_json(served, request), served.limits)
    out = await _on_model(served, lambda gen: nemo_api.run(gen, sentences, params, opts, served.limits))
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
