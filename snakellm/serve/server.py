"""``snakellm serve``: a checkpoint over HTTP, NeMo- and OpenAI-compatible.

``PUT /generate`` is NeMo ``MegatronServer``'s API (megatron_gpt_eval.py
server=True; nemo/collections/nlp/modules/common/text_generation_server.py,
the same in NeMo 1.23 and 2.0): the same fields and defaults
(``repetition_penalty`` 1.2, as NeMo <= 2.0.0; 2.1+ changed it to 1.0), the
same response ``{sentences, tokens, logprob, token_ids, offsets[, full_logprob]}``
with the prompt included in ``sentences``/``tokens``/``token_ids``. Differences,
on purpose: an invalid field is HTTP 400 with ``{"error": ..., "field": ...}``
(NeMo answers 200 with the message as a JSON string), and it runs on the CPU
(NeMo's needs CUDA). Unknown keys are ignored, as NeMo does.

``POST /v1/completions`` (and ``GET /v1/models``) follow OpenAI's completions
API closely enough for the official ``openai`` client: ``prompt`` (string or
list), ``max_tokens`` (16), ``temperature`` (1), ``top_p`` (1), ``n``, ``stop``,
``seed``; the stop text is not part of the returned text, as OpenAI does.

One model, one lock: requests are handled on their own threads
(``ThreadingHTTPServer``) and decode one at a time, so concurrent requests never
share a batch or a cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from snakellm.errors import UsageError
from snakellm.serve.generate import GenerationError, Generator, SamplingParams, token_strings

MAX_SENTENCES = 128


class BadRequest(UsageError, ValueError):
    def __init__(self, msg: str, field: str | None = None) -> None:
        super().__init__(msg)
        self.field = field


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_nemo(req: Any) -> tuple[list[str], SamplingParams, dict]:
    """NeMo MegatronServer's request -> (sentences, params, options); BadRequest names the field."""
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object", None)
    if "sentences" not in req:
        raise BadRequest("sentences is required (a list of strings)", "sentences")
    s = req["sentences"]
    if not isinstance(s, list) or not s or not all(isinstance(x, str) for x in s):
        raise BadRequest("sentences must be a non-empty list of strings", "sentences")
    if len(s) > MAX_SENTENCES:
        raise BadRequest(f"Maximum number of sentences is {MAX_SENTENCES}", "sentences")

    def get(key, default, ok, why):
        v = req.get(key, default)
        if not ok(v):
            raise BadRequest(f"{key} {why}, got {json.dumps(v)}", key)
        return v

    ttg = get("tokens_to_generate", 64, lambda v: _is_int(v) and v >= 1, "must be an integer >= 1")
    all_probs = get("all_probs", False, lambda v: isinstance(v, bool), "must be a boolean")
    temp = get("temperature", 1.0, lambda v: _is_num(v) and 0 < v <= 100, "must be a number in (0, 100]")
    add_bos = get("add_BOS", False, lambda v: isinstance(v, bool), "must be a boolean")
    greedy = get("greedy", False, lambda v: isinstance(v, bool), "must be a boolean")
    top_k = get("top_k", 0, lambda v: _is_num(v) and v >= 0 and float(v).is_integer(), "must be an integer >= 0")
    top_p = get("top_p", 0.9, lambda v: _is_num(v) and 0 <= v <= 1, "must be a number in [0, 1]")
    rp = get("repetition_penalty", 1.2, lambda v: _is_num(v) and v >= 1, "must be a number >= 1.0")
    ends = get(
        "end_strings",
        ["<|endoftext|>"],
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "must be a list of strings",
    )
    mintok = get("min_tokens_to_generate", 0, lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    logprob = get("compute_logprob", False, lambda v: isinstance(v, bool), "must be a boolean")
    seed = get("random_seed", None, lambda v: v is None or (_is_int(v) and v >= 0), "must be an integer >= 0 or null")
    for key in ("task_ids", "neighbors"):
        if req.get(key) is not None:
            raise BadRequest(f"{key} is not supported (p-tuning task ids / RETRO neighbours)", key)
    top_k = int(top_k)
    params = SamplingParams(
        max_new_tokens=ttg,
        min_new_tokens=mintok,
        greedy=greedy,
        temperature=float(temp),
        top_k=top_k,
        # NeMo applies top-k or top-p, never both (top-k wins)
        top_p=1.0 if top_k > 0 else float(top_p),
        repetition_penalty=float(rp),
        end_strings=ends,
        seed=seed,
    )
    return s, params, {"add_bos": add_bos, "all_probs": all_probs, "compute_logprob": logprob}


def nemo_response(gen: Generator, completions, opts: dict) -> dict:
    tok = gen.tok
    rows = [c.prompt_ids + c.ids for c in completions]
    out: dict[str, Any] = {"sentences": [], "tokens": [], "logprob": None, "token_ids": rows, "offsets": []}
    for ids in rows:
        out["sentences"].append(tok.decode(ids))
        out["tokens"].append(token_strings(tok, ids))
        out["offsets"].append([len(tok.decode(ids[:i])) for i in range(len(ids))])
    full = None
    if opts["compute_logprob"]:
        out["logprob"], full = gen.score(rows, full=opts["all_probs"])
    if opts["all_probs"]:
        out["full_logprob"] = full
    return out


def parse_openai(req: Any, model_name: str) -> tuple[list[str], SamplingParams, int]:
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object", None)
    prompt = req.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        prompts = prompt
    else:
        raise BadRequest("prompt must be a string or a non-empty list of strings", "prompt")

    def get(key, default, ok, why):
        v = req.get(key, default)
        if v is None:
            v = default
        if not ok(v):
            raise BadRequest(f"{key} {why}, got {json.dumps(v)}", key)
        return v

    max_tokens = get("max_tokens", 16, lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    temp = get("temperature", 1.0, lambda v: _is_num(v) and 0 <= v <= 2, "must be a number in [0, 2]")
    top_p = get("top_p", 1.0, lambda v: _is_num(v) and 0 < v <= 1, "must be a number in (0, 1]")
    n = get("n", 1, lambda v: _is_int(v) and 1 <= v <= 16, "must be an integer in [1, 16]")
    stop = get(
        "stop",
        [],
        lambda v: isinstance(v, str) or (isinstance(v, list) and len(v) <= 4 and all(isinstance(x, str) for x in v)),
        "must be a string or a list of up to 4 strings",
    )
    seed = get("seed", None, lambda v: v is None or _is_int(v), "must be an integer")
    get("logprobs", None, lambda v: v is None, "is not supported (use PUT /generate with compute_logprob)")
    get("echo", False, lambda v: v is False, "is not supported")
    get("stream", False, lambda v: v is False, "is not supported")
    for key in ("presence_penalty", "frequency_penalty"):
        get(key, 0, lambda v: v == 0, "is not supported (only 0)")
    model = req.get("model")
    if model not in (None, model_name):
        raise BadRequest(f"model {model!r} is not served here (this server serves {model_name!r})", "model")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        greedy=temp == 0,
        temperature=float(temp) if temp else 1.0,
        top_p=float(top_p),
        end_strings=[stop] if isinstance(stop, str) else stop,
        seed=None if seed is None else abs(int(seed)),
    )
    return [p for p in prompts for _ in range(n)], params, n


def openai_response(completions, params: SamplingParams, model_name: str, gen: Generator) -> dict:
    choices = []
    for i, c in enumerate(completions):
        text = c.text
        reason = "length"
        if c.finish_reason == "end_string":
            cut = min((text.find(s) for s in params.end_strings if s and s in text), default=-1)
            text = text[:cut] if cut >= 0 else text
            reason = "stop"
        elif c.finish_reason == "eod":
            text = gen.continuation(c.prompt_ids, c.ids[:-1])  # without the EOD token
            reason = "stop"
        choices.append({"text": text, "index": i, "logprobs": None, "finish_reason": reason})
    pt = sum(len(c.prompt_ids) for c in completions)
    ct = sum(len(c.ids) for c in completions)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
    }


class App:
    """The model and its lock; the request handlers call :meth:`nemo` and :meth:`openai`."""

    def __init__(self, gen: Generator, model_name: str) -> None:
        self.gen = gen
        self.model_name = model_name
        self.lock = threading.Lock()

    def nemo(self, req: Any) -> dict:
        sentences, params, opts = parse_nemo(req)
        with self.lock:
            outs = self.gen.generate(sentences, params, add_bos=opts["add_bos"])
            return nemo_response(self.gen, outs, opts)

    def openai(self, req: Any) -> dict:
        prompts, params, _ = parse_openai(req, self.model_name)
        with self.lock:
            try:
                outs = self.gen.generate(prompts, params)
            except GenerationError as e:  # in OpenAI's words
                f = {"tokens_to_generate": "max_tokens", "sentences": "prompt"}.get(e.field or "", e.field)
                raise BadRequest(str(e).replace("tokens_to_generate", "max_tokens"), f) from None
        return openai_response(outs, params, self.model_name, self.gen)


class Server(ThreadingHTTPServer):
    """A thread per request; a listen backlog that many clients connecting at once do not overflow
    (socketserver's default of 5 resets the connections beyond it while the model is busy)."""

    request_queue_size = 1024
    daemon_threads = True


def make_handler(app: App, quiet: bool = False):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "snakellm"

        def log_message(self, fmt, *args):
            if not quiet:
                sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {self.address_string()} {fmt % args}\n")

        def _send(self, code: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                return json.loads(raw or b"null")
            except ValueError as e:
                raise BadRequest(f"the request body is not valid JSON: {e}") from None

        def _dispatch(self, fn, openai: bool) -> None:
            try:
                self._send(200, fn(self._body()))
            except (BadRequest, GenerationError) as e:
                f = getattr(e, "field", None)
                if openai:
                    self._send(
                        400, {"error": {"message": str(e), "type": "invalid_request_error", "param": f, "code": None}}
                    )
                else:
                    self._send(400, {"error": str(e), "field": f})
            except Exception as e:  # a bug: say so, keep serving
                self._send(500, {"error": f"{type(e).__name__}: {e}"})
                raise

        def do_PUT(self):
            if self.path.rstrip("/") == "/generate":
                self._dispatch(app.nemo, openai=False)
            else:
                self._send(404, {"error": f"no PUT {self.path} (PUT /generate)"})

        def do_POST(self):
            if self.path.rstrip("/") == "/v1/completions":
                self._dispatch(app.openai, openai=True)
            else:
                self._send(
                    404,
                    {
                        "error": {
                            "message": f"no POST {self.path} (POST /v1/completions)",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": None,
                        }
                    },
                )

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": app.model_name, "object": "model", "created": 0, "owned_by": "snakellm"}],
                    },
                )
            elif self.path.rstrip("/") in ("", "/health"):
                self._send(200, {"status": "ok", "model": app.model_name})
            else:
                self._send(404, {"error": f"no GET {self.path}"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    from snakellm.serve.generate import load_generator

    p = argparse.ArgumentParser(
        prog="snakellm serve",
        description="Serve a checkpoint over HTTP: NeMo MegatronServer's PUT /generate and OpenAI's "
        "POST /v1/completions (GET /v1/models, GET /health). CPU or GPU.",
    )
    p.add_argument("checkpoint", help="a run dir (runs/NAME), its checkpoints/ dir or one iter_NNNNNNN/ dir")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=5555, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--blend", default=None, help="blend.json naming the tokenizer files (default: the run_config's)")
    p.add_argument("--model-name", default=None, help="the model id in OpenAI responses (default: the run's name)")
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no access log")
    a = p.parse_args(argv)
    from pathlib import Path

    from snakellm.models.loading import LoadError, locate

    try:
        d, _ = locate(a.checkpoint, a.iteration)
    except LoadError as e:
        print(f"snakellm serve: {e}", file=sys.stderr)
        return 2
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    gen = load_generator(a.checkpoint, blend=a.blend, device=a.device, iteration=a.iteration)
    name = a.model_name or (d.parent.name if d.name == "checkpoints" else Path(a.checkpoint).name)
    httpd = Server((a.host, a.port), make_handler(App(gen, name), a.quiet))
    host, port = a.host, httpd.server_address[1]
    print(
        f"snakellm serve: {name} on http://{host}:{port} (PUT /generate, POST /v1/completions)",
        file=sys.stderr,
        flush=True,
    )
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
