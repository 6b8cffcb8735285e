"""A tiny OpenAI-compatible server for the bench tests: canned SSE on 127.0.0.1 with scripted delays.

Raw asyncio (HTTP/1.1, keep-alive, chunked SSE) in a background thread. It logs when it received
each request and when each event's bytes were handed to the socket (`time.monotonic_ns()`, the
client's clock too), so tests can hold the client's numbers against what was actually sent as
well as against the script.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Script:
    """How the server answers one request."""

    first_delay_s: float = 0.05  # request received -> first token
    gaps_s: list[float] = field(default_factory=lambda: [0.02] * 4)  # before tokens 2..n
    honor_usage: bool = True  # send the usage chunk when stream_options.include_usage
    status: int = 200
    error_body: str = '{"error": {"message": "scripted failure", "type": "server_error"}}'
    cut_after: int | None = None  # close the connection after this many tokens (no [DONE])
    error_event_after: int | None = None  # send an error event after this many tokens, then [DONE]
    role_chunk: bool = True  # chat: a role-only chunk right away, before the first token
    prefill_blocks_others: bool = False  # this request's first-token wait stalls every other stream
    zero_tokens: bool = False  # finish at once: no content chunk at all

    @property
    def num_tokens(self) -> int:
        return 0 if self.zero_tokens else 1 + len(self.gaps_s)


@dataclass
class ServedRequest:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    received_ns: int
    token_write_ns: list[int] = field(default_factory=list)
    done_ns: int | None = None


ScriptFn = Callable[[dict[str, Any]], Script]


class FakeOpenAIServer:
    def __init__(self, script: ScriptFn | Script | None = None, model: str = "fake-model",
                 prompt_tokens: Callable[[dict[str, Any]], int] | None = None) -> None:
        self.script_fn: ScriptFn = script if callable(script) else (lambda body, s=script or Script(): s)
        self.model = model
        self.prompt_tokens = prompt_tokens or (lambda body: 7)
        self.served: list[ServedRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.num_completed = 0
        self._blocked_until_ns = 0  # interference emulation: no token is written before this
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> FakeOpenAIServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._server is not None

        async def shutdown() -> None:
            self._server.close()  # type: ignore[union-attr]
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in handlers:  # idle keep-alive connections and streams still running
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(5)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- HTTP --------------------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                received = time.monotonic_ns()
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
                body_bytes = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path == "/v1/models":
                    await self._send_json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
                elif method == "GET" and path == "/metrics":
                    await self._send_text(writer, 200, self._metrics_text())
                elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                    body = json.loads(body_bytes or b"{}")
                    served = ServedRequest(path, body, headers, received)
                    self.served.append(served)
                    if not await self._stream(writer, served):
                        return  # connection cut on purpose
                else:
                    await self._send_json(writer, 404, {"error": {"message": f"no route {path}"}})
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            pass
        finally:
            writer.close()

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        await writer.drain()

    async def _send_text(self, writer: asyncio.StreamWriter, status: int, text: str) -> None:
        data = text.encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        await writer.drain()

    def _metrics_text(self) -> str:
        return (
            "# HELP fake_requests_total Requests completed.\n# TYPE fake_requests_total counter\n"
            f"fake_requests_total {self.num_completed}\n"
            "# HELP fake_running Requests in flight.\n# TYPE fake_running gauge\n"
            f"fake_running {self.in_flight}\n"
        )

    async def _event(self, writer: asyncio.StreamWriter, payload: str) -> int:
        data = f"data: {payload}\n\n".encode()
        sent = time.monotonic_ns()  # handed to the socket now; the client stamps its arrival
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
        return sent

    async def _sleep_until_unblocked(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while (wait := self._blocked_until_ns - time.monotonic_ns()) > 0:
            await asyncio.sleep(wait / 1e9)

    async def _stream(self, writer: asyncio.StreamWriter, served: ServedRequest) -> bool:
        s = self.script_fn(served.body)
        if s.status != 200:
            data = s.error_body.encode()
            writer.write(f"HTTP/1.1 {s.status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                         .encode() + data)
            await writer.drain()
            return True
        chat = served.path.endswith("chat/completions")
        rid = ("chatcmpl-" if chat else "cmpl-") + served.headers.get("x-request-id", "x")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
                if chat:
                    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                    if text is not None:
                        delta["content"] = text
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text or "", "finish_reason": finish}
                return json.dumps({"id": rid, "object": "chunk", "choices": [choice]})

            if chat and s.role_chunk:
                await self._event(writer, chunk(None, role=True))
            if s.prefill_blocks_others:
                self._blocked_until_ns = max(self._blocked_until_ns, time.monotonic_ns() + int(s.first_delay_s * 1e9))
                await asyncio.sleep(s.first_delay_s)
            else:
                await self._sleep_until_unblocked(s.first_delay_s)
            for i in range(s.num_tokens):
                if i > 0:
                    await self._sleep_until_unblocked(s.gaps_s[i - 1])
                served.token_write_ns.append(await self._event(writer, chunk(f" tok{i}")))
                if s.cut_after is not None and i + 1 >= s.cut_after:
                    writer.transport.abort()  # no terminating chunk: the client sees a cut stream
                    return False
                if s.error_event_after is not None and i + 1 >= s.error_event_after:
                    await self._event(writer, json.dumps({"error": {"message": "scripted mid-stream error",
                                                                   "type": "server_error", "code": 500}}))
                    break
            else:
                await self._event(writer, chunk("" if not chat else None, finish="length"))
                include = (served.body.get("stream_options") or {}).get("include_usage")
                if include and s.honor_usage:
                    n_prompt = self.prompt_tokens(served.body)
                    await self._event(writer, json.dumps({
                        "id": rid, "object": "chunk", "choices": [],
                        "usage": {"prompt_tokens": n_prompt, "completion_tokens": s.num_tokens,
                                  "total_tokens": n_prompt + s.num_tokens}}))
            served.done_ns = await self._event(writer, "[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            self.num_completed += 1
            return True
        finally:
            self.in_flight -= 1
