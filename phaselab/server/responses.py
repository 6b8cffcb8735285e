"""Engine Deltas -> OpenAI responses: one JSON body, or server-sent events as the tokens come
(the request's side is serving.py). Each write is followed by the sent stamp of the tokens it
carried (EngineThread.stamp_sent): the record's delivery time is when the bytes left, not when the
engine produced them. A client that disconnects aborts its requests, freeing their blocks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from phaselab.core.outputs import TokenLogprobs
from phaselab.server.engine_thread import Delta, EngineThread
from phaselab.server.api_errors import error_body
from phaselab.server.token_strings import TokenIdStrings, TokenStrings
from phaselab.server.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)


DONE = b"data: [DONE]\n\n"


@dataclass
class Choice:
    """Per-choice accumulation on the event loop."""

    index: int
    request_id: str  # the engine request behind this choice
    prompt_index: int
    num_prompt_tokens: int
    num_logprobs: int | None  # None: no logprobs
    echo_text: str = ""
    echo_token_ids: list[int] = field(default_factory=list)
    echo_logprobs: list[TokenLogprobs | None] | None = None
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_unsent_tokens: int = 0  # tokens whose chunk was not written yet
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    metrics: Any = None
    started: bool = False  # first chunk (role / echo) sent


_DISCONNECTED = None  # put on a response's queue when the client went away


class GenerationResponse(Response):
    """An ASGI response fed by the engine thread: SSE (stream) or one JSON body.

    It also watches the connection: a client that goes away (at any phase: queued, prefill,
    decode) gets its engine requests aborted via `EngineThread.close`, which runs in `finally`
    on every exit path (done, disconnect, error, cancellation).
    """

    def __init__(self, *, kind: str, engine: EngineThread, response_id: str, model: str, choices: list[Choice],
                 queue: asyncio.Queue[Delta], request_ids: list[str], stream: bool, include_usage: bool,
                 tokens: TokenStrings | TokenIdStrings, on_done: Callable[[], None]) -> None:
        super().__init__(status_code=200, media_type="text/event-stream" if stream else "application/json")
        self.kind, self.engine, self.response_id, self.model = kind, engine, response_id, model
        self.choices = {c.index: c for c in choices}
        self.queue, self.request_ids = queue, request_ids
        self.stream, self.include_usage = stream, include_usage
        self.tokens, self.on_done = tokens, on_done
        self.created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        try:
            if self.stream:
                await self._stream(send)
            else:
                await self._complete(send)
        except OSError:
            pass  # the transport broke mid-write: treated like a disconnect
        finally:
            watcher.cancel()
            self.engine.close(self.request_ids)
            self.on_done()

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait(_DISCONNECTED)  # type: ignore[arg-type]
                return

    async def _next_batch(self) -> list[Delta] | None:
        """Every Delta available now (at least one); None when the client disconnected."""
        batch = [await self.queue.get()]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        return None if any(d is _DISCONNECTED for d in batch) else batch

    def _apply(self, d: Delta) -> Choice:
        c = self.choices[d.index]
        c.metrics = d.metrics
        c.num_tokens += len(d.token_ids)
        c.num_unsent_tokens += len(d.token_ids)
        c.text.append(d.text)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        return c

    def _stamp(self, choices: list[Choice], sent_ns: int) -> None:
        """These choices' pending tokens were just handed to the transport; a finished choice's
        record closes at this write (engine.mark_delivered)."""
        for c in choices:
            if c.metrics is not None:
                self.engine.stamp_sent(c.metrics, c.num_unsent_tokens, sent_ns,
                                       delivered_id=c.request_id if c.finish_reason is not None else None)
            c.num_unsent_tokens = 0

    def _usage(self) -> UsageInfo:
        prompt = {c.prompt_index: c.num_prompt_tokens for c in self.choices.values()}  # once per prompt
        completion = sum(c.num_tokens for c in self.choices.values())
        return UsageInfo(prompt_tokens=sum(prompt.values()), completion_tokens=completion,
                         total_tokens=sum(prompt.values()) + completion)

    # -- non-streaming ---------------------------------------------------------------------------------
    async def _complete(self, send: Send) -> None:
        unfinished = set(self.choices)
        while unfinished:
            batch = await self._next_batch()
            if batch is None:
                return  # nobody to answer; `finally` aborts
            for d in batch:
                if d.error is not None:
                    await _send_json(send, 500, error_body(d.error, "internal_server_error", code="engine_error"))
                    return
                if self._apply(d).finish_reason is not None:
                    unfinished.discard(d.index)
        body = self._full_response().model_dump_json().encode()
        await _send_json(send, 200, body, [(b"x-request-id", self.response_id.encode())])
        self._stamp(list(self.choices.values()), time.monotonic_ns())

    def _full_response(self) -> BaseModel:
        usage = self._usage()
        order = sorted(self.choices.values(), key=lambda c: c.index)
        if self.kind == "chat":
            return ChatCompletionResponse(
                id=self.response_id, created=self.created, model=self.model, usage=usage,
                choices=[ChatChoice(index=c.index, message=ChatMessage(role="assistant", content="".join(c.text)),
                                    logprobs=self._chat_logprobs(c.logprobs) if c.num_logprobs is not None else None,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in order])
        choices = []
        for c in order:
            logprobs = None
            if c.num_logprobs is not None:
                logprobs = self._completion_logprobs(c, c.echo_logprobs or [], c.echo_token_ids)
                tail = self._completion_logprobs(c, c.logprobs, None)
                for f in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(logprobs, f).extend(getattr(tail, f))
            choices.append(CompletionChoice(index=c.index, text=c.echo_text + "".join(c.text), logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    # -- streaming -------------------------------------------------------------------------------------
    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-request-id", self.response_id.encode())]})
        first = b"".join(self._first_chunk(c) or b"" for c in sorted(self.choices.values(), key=lambda c: c.index))
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        unfinished = set(self.choices)
        while unfinished:
            batch = await self._next_batch()
            if batch is None:
                return
            parts: list[bytes] = []
            written: list[Choice] = []
            for d in batch:
                if d.error is not None:
                    err = _sse(error_body(d.error, "internal_server_error", code="engine_error"))
                    await send({"type": "http.response.body", "body": b"".join(parts) + err + DONE, "more_body": False})
                    self._stamp(written, time.monotonic_ns())
                    return
                c = self._apply(d)
                chunk = self._chunk(c, d)
                if chunk is not None:
                    parts.append(chunk)
                    written.append(c)
                if c.finish_reason is not None:
                    unfinished.discard(d.index)
            if not unfinished:
                if self.include_usage:
                    parts.append(self._usage_chunk())
                parts.append(DONE)
            if parts:
                await send({"type": "http.response.body", "body": b"".join(parts), "more_body": bool(unfinished)})
                self._stamp(written, time.monotonic_ns())

    def _first_chunk(self, c: Choice) -> bytes | None:
        """Chat: the assistant role; completions with echo: the prompt text."""
        if self.kind == "chat":
            choice = ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
            return self._chunk_bytes([choice])
        if c.echo_text or c.echo_logprobs:
            logprobs = self._completion_logprobs(c, c.echo_logprobs or [], c.echo_token_ids) \
                if c.num_logprobs is not None else None
            return self._chunk_bytes([CompletionChoice(index=c.index, text=c.echo_text, logprobs=logprobs)])
        return None

    def _chunk(self, c: Choice, d: Delta) -> bytes | None:
        """One SSE event for this Delta, or None when it carries nothing to show yet (its tokens
        wait for the next event: held-back text of an incomplete character or a possible stop string)."""
        want_logprobs = c.num_logprobs is not None and bool(d.logprobs)
        if not d.text and d.finish_reason is None and not want_logprobs:
            return None
        if self.kind == "chat":
            logprobs = self._chat_logprobs(d.logprobs or []) if want_logprobs else None
            choice: Any = ChatStreamChoice(index=c.index, delta=DeltaMessage(content=d.text), logprobs=logprobs,
                                           finish_reason=d.finish_reason, stop_reason=d.stop_reason)
        else:
            logprobs = self._completion_logprobs(c, d.logprobs or [], None) if want_logprobs else None
            choice = CompletionChoice(index=c.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason,
                                      stop_reason=d.stop_reason)
        return self._chunk_bytes([choice])

    def _chunk_bytes(self, choices: list[Any]) -> bytes:
        cls = ChatCompletionChunk if self.kind == "chat" else CompletionChunk
        return _sse_model(cls(id=self.response_id, created=self.created, model=self.model, choices=choices))

    def _usage_chunk(self) -> bytes:
        cls = ChatCompletionChunk if self.kind == "chat" else CompletionChunk
        return _sse_model(cls(id=self.response_id, created=self.created, model=self.model, choices=[],
                              usage=self._usage()))

    # -- logprobs shapes -------------------------------------------------------------------------------
    def _completion_logprobs(self, c: Choice, entries: list[TokenLogprobs | None], token_ids: list[int] | None
                             ) -> CompletionLogprobs:
        """Legacy shape: parallel lists; top_logprobs maps token text -> logprob and always holds
        the sampled token (so up to logprobs + 1 entries). Prompt positions without a logprob
        (the first token of an echoed prompt) are null."""
        out = CompletionLogprobs()
        for i, e in enumerate(entries):
            tid = e.token_id if e is not None else token_ids[i]  # type: ignore[index]
            s = self.tokens.text(tid)
            out.tokens.append(s)
            out.text_offset.append(c.text_offset)
            c.text_offset += len(s)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e.logprob)
            top = {self.tokens.text(t): lp for t, lp in e.top[: c.num_logprobs]}
            top.setdefault(s, e.logprob)
            out.top_logprobs.append(top)
        return out

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        """Chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
        content = []
        for e in entries:
            s, raw = self.tokens.get(e.token_id)
            top = []
            for t, lp in e.top:
                ts, traw = self.tokens.get(t)
                top.append(TopLogprob(token=ts, logprob=lp, bytes=list(traw)))
            content.append(ChatTokenLogprob(token=s, logprob=e.logprob, bytes=list(raw), top_logprobs=top))
        return ChatLogprobs(content=content)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _sse_model(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


async def _send_json(send: Send, status: int, body: bytes | dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
