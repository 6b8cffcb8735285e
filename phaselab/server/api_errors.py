"""Errors of the HTTP API, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every error the server answers with is an `APIError` (raised by a route, a middleware or the
request parsing) and renders through `error_body`; an error after a stream began is the same
body sent as one SSE event, followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with `status` and an OpenAI error body; `headers` go with it (Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(err: APIError) -> bytes:
    return json.dumps(err.body()).encode()


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request cannot be served as given."""
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after_s: int | None = 1) -> APIError:
    """503: not now (loading, draining, queue full, engine dead); Retry-After where retrying helps."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, code=code, headers=headers)
