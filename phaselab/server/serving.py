"""OpenAI request -> engine requests, and engine Deltas -> OpenAI responses (JSON or SSE).

    POST body ─▶ parse (pydantic) ─▶ prompts -> token ids ─▶ SamplingParams per choice (n fan-out)
       ─▶ EngineThread.add ─▶ GenerationResponse: Deltas ─▶ chunks / one body ─▶ transport
                                                   └─ stamp_sent(tokens) right after each write

A request with P prompts and n samples becomes P x n engine requests; choice index
`p * n + k` (OpenAI's and vLLM's order), engine request id `<response id>-<choice index>`. A
seeded request's k-th sample uses seed + k, so its samples differ and each is reproducible.

Context boundary: a prompt of P tokens may ask for at most `max_model_len - P` tokens:
P + max_tokens == max_model_len is accepted (and all max_tokens can be generated, the engine caps
a request at max_model_len tokens), P + max_tokens == max_model_len + 1 is a 400. With
max_tokens = 1 this is "a prompt of max_model_len - 1 tokens is accepted, of max_model_len
rejected". Without max_tokens (chat; completions given null) the rest of the context is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from phaselab.core.outputs import TokenLogprobs
from phaselab.core.prompt import first_out_of_vocab, prompt_too_long
from phaselab.core.sampling_params import SamplingParams
from phaselab.errors import InvalidRequestError
from phaselab.server.engine_thread import Delta, EngineThread, NewRequest
from phaselab.server.api_errors import error_body, invalid
from phaselab.server.token_strings import TokenIdStrings, TokenStrings  # noqa: F401 - used by app.py too
from phaselab.server.openai_protocol import (
    UNSUPPORTED,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger("phaselab.server")

MAX_LOGPROBS = 20  # the sampler's limit
DONE = b"data: [DONE]\n\n"


# -- parsing ---------------------------------------------------------------------------------------------
MAX_JSON_DEPTH = 64  # deeper request bodies are a 400 (no OpenAI request nests beyond a handful of levels)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """JSON body -> request model; every problem is a 400 naming the field."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels; flatten it") from None
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    check_json(data)
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        unknown = [".".join(str(p) for p in err["loc"]) for err in errors if err["type"] == "extra_forbidden"]
        if unknown:
            raise invalid(f"unrecognized request argument supplied: {unknown[0]} (phaselab accepts OpenAI's fields "
                          "and the vLLM extensions listed in docs/server.md; remove it or check its spelling)",
                          param=unknown[0], code="unknown_parameter") from None
        err = errors[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise invalid(f"invalid value for {param}: {err['msg']}" if param else err["msg"], param=param) from None
    for name, allowed in UNSUPPORTED.items():
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if value not in allowed:
            raise invalid(f"{name}={value!r} is not supported by phaselab", param=name, code="unsupported_parameter")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != getattr(req, "n", 1):
        raise invalid("best_of different from n is not supported by phaselab", param="best_of",
                      code="unsupported_parameter")
    return req


def check_json(data: Any) -> None:
    """400 for what JSON allows but the server cannot serve: nesting deeper than MAX_JSON_DEPTH,
    and strings holding a lone UTF-16 surrogate ("\\ud800": not a character, the tokenizer cannot
    encode it). Iterative, so depth never costs Python stack."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise invalid(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels; flatten it",
                          param=".".join(path[:3]) or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                where = ".".join(path) or None
                raise invalid(f"{where or 'a string'} holds a lone UTF-16 surrogate, which is not a character; "
                              "send valid Unicode (pair the surrogates or drop them)", param=where) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, (*path, str(k))))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(value))


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of prompts (text or token ids)."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if is_ids(prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise invalid("prompt must be a string, a list of strings, a list of token ids, or a list of lists of "
                  "token ids (none of them empty)", param="prompt")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with content parts [{type: text, text}] joined into one string (as vLLM does)."""
    if not messages:
        raise invalid("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] has no role", param=f"messages.{i}.role")
        if "name" in m and not isinstance(m["name"], str):
            raise invalid(f"messages[{i}].name must be a string", param=f"messages.{i}.name")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}]: only text content parts are supported",
                                  param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                          param=f"messages.{i}.content")
        out.append({**m, "content": content if content is not None else ""})
    return out


# template variables the server sets itself; chat_template_kwargs may override only add_generation_prompt
_RESERVED_TEMPLATE_VARS = ("messages",)


def render_chat(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None) -> str:
    """Messages -> prompt text through the chat template. `chat_template_kwargs` become template
    variables (vLLM's extension); its `add_generation_prompt` overrides the top-level field, as in
    vLLM. Anything the template cannot render is a 400, never a 500."""
    kwargs = dict(template_kwargs or {})
    for name in _RESERVED_TEMPLATE_VARS:
        if name in kwargs:
            raise invalid(f"chat_template_kwargs may not set {name!r}: give the conversation in the request's "
                          f"{name!r} field", param=f"chat_template_kwargs.{name}")
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    if not isinstance(add_generation_prompt, bool):
        raise invalid("chat_template_kwargs.add_generation_prompt must be true or false",
                      param="chat_template_kwargs.add_generation_prompt")
    conversation = chat_messages(messages)
    try:
        return str(tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **kwargs))
    except InvalidRequestError as e:
        raise invalid(str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - the template ran on the client's data: a TypeError there is theirs
        raise invalid(f"the chat template could not render these messages ({type(e).__name__}: {e}); check "
                      "messages and chat_template_kwargs", param="chat_template_kwargs" if kwargs else "messages"
                      ) from None


_PARAM_RE = re.compile(r"invalid sampling parameter (\w+)=")


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
                    ) -> SamplingParams:
    try:
        return SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,  # -1: off (vLLM's spelling)
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
    except InvalidRequestError as e:
        m = _PARAM_RE.search(str(e))
        raise invalid(str(e), param=m.group(1) if m else None) from None


def resolve_max_tokens(num_prompt: int, max_tokens: int | None, max_model_len: int, prompt_param: str,
                       max_tokens_param: str) -> int:
    """Check the context boundary (module docstring); None means the rest of the context."""
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"{max_tokens_param} must be at least 1", param=max_tokens_param)
    too_long = prompt_too_long(num_prompt, max_model_len) is not None  # the engine's own limit (core/prompt.py)
    if too_long or (max_tokens is not None and num_prompt + max_tokens > max_model_len):
        asked = f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} to generate)" \
            if max_tokens is not None else f"a prompt of {num_prompt} tokens"
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens, but you requested {asked}; "
            f"the prompt plus {max_tokens_param} may be at most {max_model_len} tokens: shorten the prompt or lower "
            f"{max_tokens_param}",
            param=max_tokens_param if max_tokens is not None and not too_long else prompt_param,
            code="context_length_exceeded",
        )
    return max_tokens if max_tokens is not None else max_model_len - num_prompt


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = first_out_of_vocab(ids, vocab_size)  # the engine's own check (core/prompt.py), as an HTTP 400
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def fan_out(response_id: str, prompts: list[tuple[list[int], str | None]], params: list[SamplingParams], n: int
            ) -> list[NewRequest]:
    """P prompts x n samples -> engine requests; a seeded sample k uses seed + k."""
    out = []
    for p, ((ids, text), base) in enumerate(zip(prompts, params)):
        for k in range(n):
            child = base if k == 0 or base.seed is None else dataclasses.replace(base, seed=base.seed + k)
            index = p * n + k
            out.append(NewRequest(f"{response_id}-{index}", ids, child, index, text))
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def prompt_logprobs_fn(token_ids: list[int], k: int) -> Callable[[Any], list[TokenLogprobs | None]]:
    """For echo + logprobs: the prompt's own logprobs (teacher forcing), run on the engine thread."""

    def run(engine: Any) -> list[TokenLogprobs | None]:
        import torch

        logits = engine.score(token_ids)  # (P, vocab) fp32
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # row i predicts token i + 1
        targets = torch.tensor(token_ids[1:], dtype=torch.long)
        chosen = logprobs.gather(1, targets[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        top_v, top_i = logprobs.topk(k, dim=-1) if k else (None, None)
        out: list[TokenLogprobs | None] = [None]
        for row, (t, lp, rank) in enumerate(zip(targets.tolist(), chosen.tolist(), ranks.tolist())):
            top = list(zip(top_i[row].tolist(), top_v[row].tolist())) if top_i is not None else []
            out.append(TokenLogprobs(t, lp, rank, top))
        return out

    return run


# -- responses ------------------------------------------------------------------------------------------------
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
