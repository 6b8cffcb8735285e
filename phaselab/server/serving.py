"""OpenAI request -> engine requests (the answer's side is responses.py).

    POST body ─▶ parse (pydantic) ─▶ prompts -> token ids ─▶ SamplingParams per choice (n fan-out)
       ─▶ EngineThread.add ─▶ responses.GenerationResponse: Deltas ─▶ chunks / one body ─▶ transport
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

import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from phaselab.core.outputs import TokenLogprobs
from phaselab.core.prompt import first_out_of_vocab, prompt_too_long
from phaselab.core.sampling_params import SamplingParams
from phaselab.errors import InvalidRequestError
from phaselab.server.engine_thread import NewRequest
from phaselab.server.api_errors import invalid
from phaselab.server.openai_protocol import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)


MAX_LOGPROBS = 20  # the sampler's limit


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
