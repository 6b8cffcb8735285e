"""Issue 19's hardening items, each against a real `phaselab serve` subprocess.

`hard`: the bundled model behind an API key, 4 running at most and a queue limit of 50 (a burst
of 200 must not pass it). `tiny`: a tiny random model without a key, fast enough for schemathesis
to fuzz every route from the published /openapi.json. Nothing here asserts a wall-clock speed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests._server_helpers import ServerProcess, assert_openai_error, metric

MODEL = "smollm2-135m"
KEY = "hard-key"
QUEUE_LIMIT = 50
MAX_NUM_SEQS = 4
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit."}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    cfg = tiny_hf_config()
    tiny_dir = write_hf_dir(str(tmp_path_factory.mktemp("tiny") / "tiny"), cfg, random_weights(cfg))
    hard = ServerProcess("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "256",
                         "--api-key", KEY, "--max-num-seqs", str(MAX_NUM_SEQS),
                         "--max-queued-requests", str(QUEUE_LIMIT))
    tiny = ServerProcess("--model", tiny_dir, "--dtype", "float32", "--kv-cache-memory", "8MiB",
                         "--max-model-len", "64", "--served-model-name", "tiny")
    yield hard, tiny
    for s in (hard, tiny):
        assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def hard(launched):
    return launched[0].wait_ready()


@pytest.fixture(scope="module")
def tiny(launched):
    return launched[1].wait_ready()


def _post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def _idle(server) -> None:
    """Wait until the engine runs and queues nothing (dropped streams are aborted asynchronously)."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        if metric(text, "phaselab_num_requests_running") + metric(text, "phaselab_num_requests_waiting") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the server did not become idle within 60 s")


# -- item 2: the queue limit holds under a burst ------------------------------------------------------------
@pytest.mark.slow
def test_burst_of_200_cannot_pass_the_queue_limit(hard):
    """200 simultaneous long streams against --max-queued-requests 50: at most 50 wait plus
    --max-num-seqs run (a stream's headers come only once the engine took it), the rest get 503
    queue_full with Retry-After. None can finish during the burst (240 tokens each)."""

    async def burst() -> tuple[list[int], list[httpx.Response]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        statuses: list[int] = []
        rejected: list[httpx.Response] = []
        release = asyncio.Event()
        async with httpx.AsyncClient(timeout=300, limits=limits, headers=AUTH) as http:
            async def one() -> None:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}
                async with http.stream("POST", hard.url + "/v1/completions", json=body) as r:
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        await release.wait()  # hold the stream open; closing it aborts the request
                    else:
                        await r.aread()
                        rejected.append(r)

            tasks = [asyncio.create_task(one()) for _ in range(200)]
            while len(statuses) < 200:
                await asyncio.sleep(0.1)
            release.set()
            await asyncio.gather(*tasks)
        return statuses, rejected

    statuses, rejected = asyncio.run(burst())
    counts = collections.Counter(statuses)
    assert set(counts) <= {200, 503}, counts
    assert QUEUE_LIMIT <= counts[200] <= QUEUE_LIMIT + MAX_NUM_SEQS, counts
    for r in rejected:
        err = assert_openai_error(r, 503)
        assert err["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    _idle(hard)


# -- item 3: malformed requests are 400s and never close the connection ------------------------------------------
def _malformed() -> list[tuple[str, bytes, str | None]]:
    deep_array = "[" * 5000 + "]" * 5000
    deep_object = '{"a":' * 5000 + "1" + "}" * 5000
    shallow_but_deep = "[" * 200 + "]" * 200  # parses, but deeper than the server's bound
    return [
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                             "chat_template_kwargs": {"messages": CHAT}}).encode(),
         "chat_template_kwargs.messages"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                             "chat_template_kwargs": {"add_generation_prompt": "no"}}).encode(),
         "chat_template_kwargs.add_generation_prompt"),
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "stop": {deep_array}}}'.encode(), None),
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "user": {deep_object}}}'.encode(), None),
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "x", "stop": {shallow_but_deep}}}'.encode(), None),
        ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 1}' % MODEL.encode(), "prompt"),
        ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfffb"}]}'
         % MODEL.encode(), "messages.0.content"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b"{not json", None),
    ]


@pytest.mark.slow
def test_malformed_requests_are_400_on_one_kept_alive_connection(hard):
    connects: list[str] = []

    def trace(event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            connects.append(event)

    with httpx.Client(base_url=hard.url, headers=AUTH, timeout=120,
                      limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as http:
        for path, body, param in _malformed():
            r = http.post(path, content=body, headers={"content-type": "application/json"},
                          extensions={"trace": trace})
            err = assert_openai_error(r, 400, param)
            assert err["type"] == "invalid_request_error"
            assert r.headers.get("connection", "").lower() != "close", (path, r.headers)
            good = http.get("/v1/models", extensions={"trace": trace})
            assert good.status_code == 200 and good.json()["data"][0]["id"] == MODEL
        # the error statuses the edge answers keep the connection too
        assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"},
                        extensions={"trace": trace}).status_code == 401
        assert http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"},
                         extensions={"trace": trace}).status_code == 404
        ok = http.post("/v1/chat/completions", extensions={"trace": trace}, json={
            "model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0,
            "chat_template_kwargs": {"add_generation_prompt": False}})  # documented: overrides the field
        assert ok.status_code == 200, ok.text
    assert len(connects) == 1, f"{len(connects)} TCP connections: an error closed the kept-alive one"
    # add_generation_prompt inside chat_template_kwargs reaches the template (the prompt is shorter)
    with_prompt = _post(hard, "/tokenize", {"messages": CHAT}).json()["count"]
    assert ok.json()["usage"]["prompt_tokens"] < with_prompt


# -- item 4: unknown fields are 400s naming them; bounds; tiny temperature; stop_token_ids --------------------------
@pytest.mark.slow
def test_unknown_and_unimplemented_fields_are_400_naming_them(hard):
    comp = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    cases = [
        ("/v1/completions", comp, "guided_json", {"type": "object"}),
        ("/v1/completions", comp, "guided_regex", "a+"),
        ("/v1/chat/completions", chat, "guided_choice", ["a", "b"]),
        ("/v1/completions", comp, "prompt_logprobs", 1),
        ("/v1/chat/completions", chat, "echo", True),
        ("/v1/chat/completions", chat, "functions", [{"name": "f"}]),
        ("/v1/chat/completions", chat, "tool_choice", "auto"),
        ("/v1/chat/completions", chat, "parallel_tool_calls", True),
        ("/v1/chat/completions", chat, "modalities", ["text"]),
        ("/v1/completions", comp, "max_token", 3),
        ("/v1/completions", comp, "temprature", 0.5),
        ("/v1/chat/completions", chat, "top_logprob", 2),
    ]
    for path, base, field, value in cases:
        err = assert_openai_error(_post(hard, path, {**base, field: value}), 400, field)
        assert err["code"] == "unknown_parameter" and field in err["message"]
    # bounds: temperature in [0, 2] (OpenAI's), stop_token_ids inside the vocabulary
    for bad in (2.01, -0.1, 1e9):
        assert_openai_error(_post(hard, "/v1/completions", {**comp, "temperature": bad}), 400, "temperature")
    assert _post(hard, "/v1/completions", {**comp, "temperature": 2}).status_code == 200
    vocab = 49152
    for ids, param in (([vocab], "stop_token_ids"), ([5, 10**9], "stop_token_ids"), ([-1], "stop_token_ids.0")):
        assert_openai_error(_post(hard, "/v1/completions", {**comp, "stop_token_ids": ids}), 400, param)
    assert _post(hard, "/v1/completions", {**comp, "stop_token_ids": [vocab - 1]}).status_code == 200


@pytest.mark.slow
def test_tiny_positive_temperature_is_greedy(hard):
    """temperature 1e-38 used to overflow logits / T to inf and emit token 0 every step; it must
    now give the greedy output (temperature 0 is the independent reference)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
    greedy = _post(hard, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]
    for t in (1e-38, 1e-45, 1e-300):
        tiny = _post(hard, "/v1/completions", {**body, "temperature": t}).json()["choices"][0]
        assert tiny["text"] == greedy["text"], (t, tiny["logprobs"]["tokens"])


# -- item 6: /openapi.json publishes the request/response schemas and error statuses --------------------------------
@pytest.mark.slow
def test_openapi_publishes_models_and_errors(hard):
    doc = httpx.get(hard.url + "/openapi.json", headers=AUTH).json()
    schemas = doc["components"]["schemas"]
    for path, req, resp in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                            ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + req)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + resp)
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert {"400", "401", "404", "413", "503"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "Retry-After" in op["responses"]["503"]["headers"]
        assert schemas[req]["additionalProperties"] is False
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temperature["minimum"] == 0 and temperature["maximum"] == 2
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_or_schema_violation(tiny, tmp_path):
    """Fuzz every published operation (valid and invalid bodies) with a bounded example count:
    no 5xx, every status and content type documented, every body matching its schema, and every
    schema-invalid body rejected."""
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
              "response_headers_conformance,negative_data_rejection")
    cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
           "run", tiny.url + "/openapi.json", "--checks", checks, "--mode", "all", "--max-examples", "25",
           "--seed", "19", "--no-shrink", "--request-timeout", "60", "--report", "junit",
           "--report-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its cache goes there
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failure" not in r.stdout.split("SUMMARY")[-1], r.stdout[-3000:]


# -- item 7: the Bearer scheme is case-insensitive; 401 says how to authenticate -------------------------------------
@pytest.mark.slow
def test_bearer_scheme_case_insensitive_and_www_authenticate(hard):
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"bEaReR  {KEY}"):
        assert httpx.get(hard.url + "/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in (None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer{KEY}"):
        r = httpx.get(hard.url + "/v1/models", headers={"Authorization": header} if header else {})
        assert_openai_error(r, 401)
        assert r.headers["www-authenticate"].lower().startswith("bearer"), r.headers


# -- item 9: vLLM's metric names and labels ----------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_metric_names_parse_like_a_dashboard(hard):
    _idle(hard)
    before = httpx.get(hard.url + "/metrics", headers=AUTH).text
    n = 3
    for _ in range(n):
        r = _post(hard, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
                                            "temperature": 0, "stream": True})
        assert r.status_code == 200
    text = httpx.get(hard.url + "/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {"model_name": MODEL, "engine": "0"}

    def samples(name: str) -> list:
        return [s for s in families[name].samples if all(s.labels.get(k) == v for k, v in labels.items())]

    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens"):
        fam = families[name]
        assert fam.type == "histogram", name
        buckets = [s for s in samples(name) if s.name == name + "_bucket"]
        count = next(s.value for s in samples(name) if s.name == name + "_count")
        total = next(s.value for s in samples(name) if s.name == name + "_sum")
        assert buckets and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count, name
        assert all(a.value <= b.value for a, b in zip(buckets, buckets[1:])), name  # cumulative
        assert count > 0 and total >= 0, name
    # histogram_quantile needs the same count as phaselab's own histogram of the same meaning
    for vllm_name, ours in (("vllm:time_to_first_token_seconds", "phaselab_time_to_first_token_seconds"),
                            ("vllm:e2e_request_latency_seconds", "phaselab_e2e_request_latency_seconds"),
                            ("vllm:inter_token_latency_seconds", "phaselab_inter_token_latency_seconds")):
        assert metric(text, vllm_name + "_count", **labels) == metric(text, ours + "_count"), vllm_name
    # counters (rate() over _total) and gauges, with vLLM's labels
    assert families["vllm:prompt_tokens"].type == "counter"
    assert metric(text, "vllm:prompt_tokens_total", **labels) == metric(text, "phaselab_prompt_tokens_total")
    generated = metric(text, "vllm:generation_tokens_total", **labels) - \
        metric(before, "vllm:generation_tokens_total", **labels)
    assert generated == 5 * n  # an independent count: n requests x 5 tokens each
    assert metric(text, "vllm:request_success_total", finished_reason="length", **labels) >= n
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[gauge].type == "gauge" and len(samples(gauge)) == 1, gauge
    assert metric(text, "vllm:num_requests_running", **labels) == 0
