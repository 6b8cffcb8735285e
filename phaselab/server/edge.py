"""The server's edge: the outermost ASGI layer, before any route (pure ASGI, so streaming and
client disconnects pass untouched). It stamps each request's arrival, checks the API key and the
body size, admits generation routes at arrival (a queue slot reserved before the body is read), and
answers any exception that escaped the routes with a 500 in OpenAI's shape, keeping the connection."""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phaselab.server.api_errors import APIError, error_bytes
from phaselab.server.options import ServerConfig

logger = logging.getLogger("phaselab.server")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


class _BodyTooLarge(APIError):
    pass


class Edge:
    """Outermost layer of the app (inside it Starlette's own): stamps arrival, checks the API key
    and the body size, reserves a queue slot for generation routes before their body is read,
    and turns any exception that escaped the routes into a 500 in OpenAI's shape without
    dropping the keep-alive connection (Starlette's ServerErrorMiddleware re-raises, and uvicorn
    then closes the connection)."""

    def __init__(self, app: ASGIApp, config: ServerConfig, state: Any) -> None:  # state: app.ServerState
        self.app = app
        self.config = config
        self.state = state
        self._key = config.api_key.encode() if config.api_key else None

    def _authorized(self, header: bytes) -> bool:
        """RFC 7235: the scheme is case-insensitive ("bearer", "BEARER"); the key is compared in
        constant time."""
        assert self._key is not None
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        reserved = False
        try:
            reserved = await self._handle(scope, receive, tracked_send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: answer, keep the connection
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await _send_error(send, APIError(500, f"internal error: {type(exc).__name__}: {exc}; the server "
                                                      "log has the traceback"))
        finally:
            if reserved:
                self.state.release_reservation(scope)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Returns whether a queue slot was reserved for this request (released by the caller)."""
        scope.setdefault("state", {})["arrived_ns"] = time.monotonic_ns()
        headers = dict(scope["headers"])
        if self._key is not None and scope["path"] != "/health":
            if not self._authorized(headers.get(b"authorization", b"")):
                await _send_error(send, APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                                 code="invalid_api_key",
                                                 headers={"WWW-Authenticate": 'Bearer realm="phaselab"'}))
                return False
        limit = self.config.max_request_bytes
        too_large = _BodyTooLarge(413, f"the request body is larger than the server's limit of {limit} bytes "
                                        "(--max-request-bytes)", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, too_large)
            return False
        reserved = False
        if scope["method"] == "POST" and scope["path"] in GENERATION_ROUTES:
            try:  # admission at arrival: a burst cannot pass the queue limit while its bodies are read
                self.state.admit(reserve=True)
            except APIError as e:
                await _send_error(send, e)
                return False
            scope["state"]["reserved"] = reserved = True
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large
            return message

        try:
            await self.app(scope, counted_receive, send)
        except _BodyTooLarge as e:  # raised while a route read the body; Starlette lets it through
            await _send_error(send, e)
        return reserved


async def _send_error(send: Send, err: APIError) -> None:
    body = error_bytes(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
