"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are strict: a field a model does not declare is a 400 naming it (OpenAI answers an
unknown parameter the same way), so a misspelling (`max_token`, `temprature`) or a feature
phaselab does not implement (`guided_json`, `tool_choice`, `echo` on chat, ...) never silently
gets defaults. The declared fields are the allow-list: OpenAI's fields phaselab implements plus
the vLLM extensions in `VENDOR_EXTENSIONS`. OpenAI fields phaselab declares but does not
implement are rejected with a 400 when they would change the output (`UNSUPPORTED`).
The same models publish /openapi.json (server/openapi.py). Responses follow OpenAI's shapes;
`stop_reason` (the stop string or token id that ended a choice) is an extension that vLLM also sends.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_serializer


class _Request(BaseModel):
    # strict: "1" is not an int and 0 not a bool (the schema says so; a lax parse would accept
    # what /openapi.json rejects)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


# vLLM's extensions that phaselab implements (docs/server.md); every other non-OpenAI field is a 400
VENDOR_EXTENSIONS = ("top_k", "min_p", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                     "skip_special_tokens", "return_tokens_as_token_ids", "add_generation_prompt", "chat_template_kwargs")
MAX_TEMPERATURE = 2.0  # OpenAI's bound

_MESSAGE_SCHEMA = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string"},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    "name": {"type": "string"}}}
Messages = Annotated[list[dict[str, Any]], WithJsonSchema({"type": "array", "minItems": 1, "items": _MESSAGE_SCHEMA})]
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
Prompt = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}, _TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]})]


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)  # None: 1.0; 0: greedy
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # checked against the vocabulary too
    n: int = Field(default=1, ge=1)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    return_tokens_as_token_ids: bool = False  # vLLM extension: logprob tokens as "token_id:<id>"
    # OpenAI fields phaselab does not implement: rejected unless they leave the output unchanged
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


# field -> the values that leave the output unchanged (anything else is a 400)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class CompletionRequest(_SamplingFields):
    prompt: Prompt = None  # str | list[str] | list[int] | list[list[int]], checked by the server
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)  # top alternatives per token (+ the sampled one)
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Messages
    max_completion_tokens: int | None = Field(default=None, ge=1)  # preferred over max_tokens; None: the rest
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: extra template variables
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# -- responses ----------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """Only the fields set are sent: the role in a choice's first chunk, content afterwards."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "phaselab"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str  # ok | loading | draining | dead | failed | degraded (disagg: a role has no live worker)
    num_running: int
    num_waiting: int
    error: str | None = None
    reason: str | None = None


class VersionResponse(BaseModel):
    version: str


class RecordFlushResponse(BaseModel):
    path: str
    num_requests: int
    num_iterations: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: OpenAI's shape."""

    error: ErrorDetail
