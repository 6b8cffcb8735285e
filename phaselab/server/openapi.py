"""/openapi.json built from the pydantic models the server validates with (server/openai_protocol.py).

The routes read their bodies themselves (to answer every problem in OpenAI's error shape), so
FastAPI cannot see their request models; this module publishes them instead, with every status a
route can answer and the headers that go with it (Retry-After on 503, WWW-Authenticate on 401).
Generated clients and fuzzers (schemathesis, in tests/test_server_hardening.py) work from it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from phaselab.server import openai_protocol as p

_REF = "#/components/schemas/{model}"

# path -> method, summary, request model, 200 response model (None: text), error statuses
_ROUTES: dict[str, tuple[str, str, type[BaseModel] | None, type[BaseModel] | None, tuple[int, ...]]] = {
    "/v1/completions": ("post", "OpenAI completions (JSON, or SSE with stream=true)", p.CompletionRequest,
                        p.CompletionResponse, (400, 401, 404, 413, 500, 503)),
    "/v1/chat/completions": ("post", "OpenAI chat completions (JSON, or SSE with stream=true)",
                             p.ChatCompletionRequest, p.ChatCompletionResponse, (400, 401, 404, 413, 500, 503)),
    "/v1/models": ("get", "The served model", None, p.ModelList, (401, 503)),
    "/tokenize": ("post", "Prompt or messages -> token ids", p.TokenizeRequest, p.TokenizeResponse,
                  (400, 401, 404, 413, 503)),
    "/detokenize": ("post", "Token ids -> text", p.DetokenizeRequest, p.DetokenizeResponse,
                    (400, 401, 404, 413, 503)),
    "/health": ("get", "200 when ready; 503 with a status and reason otherwise (no API key needed)", None,
                p.HealthResponse, (503,)),
    "/metrics": ("get", "Prometheus text exposition (docs/metrics.md)", None, None, (401,)),
    "/version": ("get", "phaselab's version", None, p.VersionResponse, (401,)),
    "/record/flush": ("post", "Write the run directory now (400 without --record)", None, p.RecordFlushResponse,
                      (400, 401, 503)),
}

_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, an unknown or out-of-range field (`param` names it), context too long",
    401: "Missing or wrong API key (`Authorization: Bearer KEY`)",
    404: "Unknown model (`code: model_not_found`) or route",
    413: "Body larger than --max-request-bytes",
    500: "The engine loop failed while the request ran",
    503: "Loading, draining, engine dead, a disaggregated role without live workers, or the queue is full",
}

_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying (where retrying helps)",
                                "required": False, "schema": {"type": "string"}}}
_WWW_AUTHENTICATE = {"WWW-Authenticate": {"description": "the scheme to use: Bearer", "required": False,
                                          "schema": {"type": "string"}}}

# OpenAPI 3.1: the schema of an event-stream media type describes one event
_SSE_EVENT = {"type": "object", "required": ["data"], "description": "one server-sent event",
              "properties": {"data": {"type": "string", "description": "a chunk object as JSON (the *Chunk schemas), "
                                                                         "or [DONE] last"}}}


def build_openapi(title: str, version: str, api_key: bool) -> dict[str, Any]:
    models: list[type[BaseModel]] = [p.ErrorResponse]
    for _, _, req, resp, _ in _ROUTES.values():
        models += [m for m in (req, resp) if m is not None]
    inputs = [(m, "validation") for m in dict.fromkeys(models)]
    outputs = [(m, "serialization") for m in dict.fromkeys(models)]
    keys, defs = models_json_schema(inputs + outputs, ref_template=_REF)

    def ref(model: type[BaseModel], mode: str) -> dict[str, Any]:
        return keys[(model, mode)]  # type: ignore[index,return-value]

    error = {"application/json": {"schema": ref(p.ErrorResponse, "serialization")}}
    paths: dict[str, Any] = {}
    for path, (method, summary, req, resp, statuses) in _ROUTES.items():
        op: dict[str, Any] = {"summary": summary, "operationId": path.strip("/").replace("/", "_") + "_" + method}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(req, "validation")}}}
        if resp is None:
            ok = {"text/plain": {"schema": {"type": "string"}}}
        else:
            ok = {"application/json": {"schema": ref(resp, "serialization")}}
            if req in (p.CompletionRequest, p.ChatCompletionRequest):
                ok["text/event-stream"] = {"schema": _SSE_EVENT}
        responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
        for status in statuses:
            if status == 401 and not api_key:
                continue
            entry: dict[str, Any] = {"description": _DESCRIPTIONS[status], "content": error}
            if path == "/health" and status == 503:
                entry["content"] = {"application/json": {"schema": ref(p.HealthResponse, "serialization")}}
            if status == 503:
                entry["headers"] = _RETRY_AFTER
            if status == 401:
                entry["headers"] = _WWW_AUTHENTICATE
            responses[str(status)] = entry
        op["responses"] = responses
        if api_key:
            op["security"] = [] if path == "/health" else [{"bearer": []}]
        paths[path] = {method: op}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible API of phaselab (docs/server.md). Unknown request fields are "
                                "a 400 naming them."},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
