"""Async streaming client for OpenAI-compatible servers: sends one request, keeps raw timestamps.

The hot path only stamps and stores: each SSE line is appended with `time.monotonic_ns()` the
moment the HTTP layer hands it over, and nothing is parsed, counted or subtracted until the
stream is over (`parse_stream`). Metrics are derived later, in `metrics.py`.

    scheduled ──▶ sent ──▶ response headers ──▶ line 1 .. line k (raw, stamped) ──▶ end
    (arrival      (POST     (status known)         │                                 ([DONE] or
     process)     begins)                          └─ parsed afterwards: content chunks,   body closed)
                                                      finish_reason, usage, error events

`time.monotonic_ns()` is the clock the engine uses (docs/metrics.md): on one host the client's
timestamps and the server's phase record compare directly.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from phaselab.workload.request_spec import RequestSpec  # noqa: F401 - the spec a client sends

# Request outcomes. "incomplete": the request started but its stream never finished (cut off,
# timed out, cancelled); "failed": the server refused it or reported an error.
STATUS_OK = "ok"
STATUS_FAILED = "failed"
STATUS_INCOMPLETE = "incomplete"

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestRecord:
    """The client's raw view of one request. Timestamps are `time.monotonic_ns()`."""

    request_id: str
    group: str
    warmup: bool
    num_prompt_tokens_requested: int | None
    max_tokens: int
    scheduled_ns: int = 0  # when the arrival process released it (before any --max-concurrency wait)
    sent_ns: int | None = None  # just before the POST
    headers_ns: int | None = None  # response status and headers received
    end_ns: int | None = None  # stream over: [DONE], or the body closed, or the error
    status_code: int | None = None
    lines: list[str] = field(default_factory=list)  # raw SSE lines (data/event/comment), in order
    line_ns: list[int] = field(default_factory=list)  # arrival of each line
    exception: str | None = None  # transport error or cancellation, "Type: message"
    is_transport_failure: bool = False  # no response at all: refused, reset before the headers
    error_body: str | None = None  # body of a non-200 response
    stale_connection_retries: int = 0  # pooled connection found closed before any response (resent once)


@dataclass
class ParsedStream:
    """What the stream said, with the arrival time of every content chunk."""

    token_ns: list[int]  # arrival of each chunk that carried generated text
    token_counts_in_chunks: int  # number of content chunks (= tokens when one token per chunk)
    usage_prompt_tokens: int | None
    usage_completion_tokens: int | None
    finish_reason: str | None
    saw_done: bool
    server_request_id: str | None
    error: str | None  # an error event inside the stream
    text_chars: int


def parse_stream(rec: RequestRecord) -> ParsedStream:
    """Read the recorded SSE lines after the fact. A content chunk is a choice with non-empty
    `delta.content` / `delta.reasoning_content` (chat) or `text` (completions): a role-only first
    chunk or an empty final chunk carrying just finish_reason is not a token the user sees."""
    token_ns: list[int] = []
    usage_prompt = usage_completion = None
    finish_reason = server_id = error = None
    saw_done = False
    text_chars = 0
    for line, ts in zip(rec.lines, rec.line_ns):
        if not line.startswith("data:"):
            continue  # comments (": ping"), "event:" lines, ids
        payload = line[5:].strip()
        if payload == "[DONE]":
            saw_done = True
            continue
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            error = error or f"unparsable stream event: {payload[:200]!r}"
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            err = obj["error"]
            error = error or (err.get("message") if isinstance(err, dict) else None) or str(err)
            continue
        server_id = server_id or obj.get("id")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            usage_prompt = usage.get("prompt_tokens", usage_prompt)
            usage_completion = usage.get("completion_tokens", usage_completion)
        for choice in obj.get("choices") or ():
            delta = choice.get("delta")
            text = (delta.get("content") or delta.get("reasoning_content") or "") if isinstance(delta, dict) \
                else (choice.get("text") or "")
            if text:
                token_ns.append(ts)
                text_chars += len(text)
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
            break  # n=1: the first choice is the request's stream
    return ParsedStream(
        token_ns=token_ns, token_counts_in_chunks=len(token_ns), usage_prompt_tokens=usage_prompt,
        usage_completion_tokens=usage_completion, finish_reason=finish_reason, saw_done=saw_done,
        server_request_id=server_id, error=error, text_chars=text_chars,
    )


def classify(rec: RequestRecord, parsed: ParsedStream) -> tuple[str, str | None]:
    """(status, error message). Failed: refused, error status, error event, or never connected.
    Incomplete: started but the stream ended without [DONE] or a finish_reason (cut, timeout,
    cancelled). Otherwise ok, even with zero content chunks (e.g. an immediate EOS)."""
    if rec.is_transport_failure:
        return STATUS_FAILED, rec.exception
    if rec.status_code is not None and rec.status_code != 200:
        return STATUS_FAILED, f"HTTP {rec.status_code}: {(rec.error_body or '').strip()[:500]}"
    if parsed.error is not None:
        return STATUS_FAILED, parsed.error
    if rec.exception is not None and not parsed.saw_done:
        return STATUS_INCOMPLETE, rec.exception
    if not (parsed.saw_done or parsed.finish_reason):
        return STATUS_INCOMPLETE, "the stream ended before [DONE] or a finish_reason"
    return STATUS_OK, None


@dataclass(frozen=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str = ""
    endpoint: str = "chat"  # "chat" | "completions"
    api_key: str | None = None
    include_usage: bool = True  # ask for stream_options.include_usage
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float | None = None  # longest silence (no bytes) before giving up; None: wait
    extra_body: dict[str, Any] = field(default_factory=dict)


class StreamingClient:
    """One `httpx.AsyncClient` (connection pool) shared by every request of a run."""

    def __init__(self, cfg: ClientConfig) -> None:
        if cfg.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint {cfg.endpoint!r}: choose one of {sorted(ENDPOINT_PATHS)}")
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + ENDPOINT_PATHS[cfg.endpoint]
        self._headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=min(cfg.request_timeout_s or 30.0, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            headers=self._headers,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {"model": cfg.model, "max_tokens": spec.max_tokens, "stream": True,
                                "temperature": cfg.temperature}
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt if spec.prompt_token_ids is None else spec.prompt_token_ids
        if cfg.include_usage:
            body["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        body.update(cfg.extra_body)
        return body

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        """Stream one request into `rec` (created by the caller, so a cancelled run keeps it)."""
        body = self.body(spec)
        headers = {"X-Request-Id": spec.request_id}
        clock = time.monotonic_ns
        rec.sent_ns = clock()
        try:
            for attempt in (0, 1):
                try:
                    await self._stream(body, headers, rec)
                    break
                except httpx.RemoteProtocolError:
                    # Servers that close a connection after each streamed reply (llama.cpp's
                    # llama-server) leave dead sockets in the pool; a POST sent on one gets no
                    # response at all. Resend once, as HTTP clients do for a stale keep-alive
                    # connection; anything after the server answered is not retried.
                    if attempt == 1 or rec.headers_ns is not None:
                        raise
                    rec.stale_connection_retries += 1
        except asyncio.CancelledError:
            rec.exception = "cancelled: the run stopped before the stream finished"
            raise
        except httpx.HTTPError as e:
            rec.exception = f"{type(e).__name__}: {e or 'transport error'}"
            # no response at all (refused, reset before the headers) fails the request; a timeout,
            # or a stream cut after the server answered, leaves it incomplete
            rec.is_transport_failure = rec.headers_ns is None and not isinstance(e, httpx.ReadTimeout)
        finally:
            if rec.end_ns is None:
                rec.end_ns = clock()
        return rec

    async def _stream(self, body: dict[str, Any], headers: dict[str, str], rec: RequestRecord) -> None:
        lines, line_ns = rec.lines, rec.line_ns
        clock = time.monotonic_ns
        async with self._http.stream("POST", self.url, json=body, headers=headers) as resp:
            rec.headers_ns = clock()
            rec.status_code = resp.status_code
            if resp.status_code != 200:
                rec.error_body = (await resp.aread()).decode("utf-8", "replace")
                return
            async for line in resp.aiter_lines():
                # the hot path: stamp and keep; parse_stream() reads them after the stream
                if line:
                    line_ns.append(clock())
                    lines.append(line)
                    if line.endswith("[DONE]"):
                        rec.end_ns = line_ns[-1]  # the response is complete for the user here
            # reading on to the end of the body lets the connection go back to the pool


def new_record(spec: RequestSpec, scheduled_ns: int) -> RequestRecord:
    return RequestRecord(
        request_id=spec.request_id, group=spec.group, warmup=spec.warmup,
        num_prompt_tokens_requested=spec.num_prompt_tokens, max_tokens=spec.max_tokens,
        scheduled_ns=scheduled_ns,
    )


async def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id of GET /v1/models (what `--model` defaults to)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as http:
        resp = await http.get(base_url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
        return str(data[0]["id"])


async def fetch_metrics_text(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The server's Prometheus exposition (GET /metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as http:
        resp = await http.get(base_url.rstrip("/") + "/metrics")
        resp.raise_for_status()
        return resp.text
