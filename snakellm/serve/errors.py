"""The one error a request handler raises: status, message and the field at fault.

Every API answers it in OpenAI's error object shape
(``{"error": {"message", "type", "param", "code"}}``) except NeMo's
``PUT /generate``, which keeps ``{"error", "field"}`` (see nemo_api).

Statuses: 400 a field's value or an unsupported field (named in ``param``),
invalid JSON, a prompt that does not fit the context; 401 a missing or wrong
API key; 404 an unknown route or model; 405 a known route with another method;
408 a request body not received within the request timeout; 413 a body, a
prompt count or a token count over the server's limits; 422 a JSON body that is
not a request object; 500 a bug (logged, the server keeps serving); 503 the
model queue did not reach the request within the request timeout.
"""

from __future__ import annotations

from snakellm.errors import SnakellmError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "server_overloaded",
}


class APIError(SnakellmError):
    """A request the server answers with ``status`` and a message naming ``param`` (the server goes on)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param)
