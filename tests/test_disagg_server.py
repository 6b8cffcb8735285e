"""`phaselab serve --mode disagg`: the OpenAI server over a prefill and a decode worker on Ray."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests._server_helpers import ServerProcess

pytestmark = pytest.mark.slow


def test_serve_disagg_streams_records_and_exits_cleanly(tmp_path):
    record = tmp_path / "run"
    server = ServerProcess("--mode", "disagg", "--dtype", "bfloat16", "--kv-cache-memory", "256MiB",
                           "--prefill-threads", "1", "--decode-threads", "1", "--record", str(record))
    try:
        server.wait_ready(300)
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        chat = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        text = httpx.get(server.url + "/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        workers = {s.labels["worker"] for s in families["phaselab_iterations"].samples}
        assert {"prefill-0", "decode-0"} <= workers
        ttft = [s for s in families["phaselab_time_to_first_token_seconds"].samples
                if s.name.endswith("_count") and s.labels["worker"] == "router"]
        assert ttft[0].value == 2
    finally:
        server.signal(signal.SIGTERM)
        assert server.stop(60) == 0, server.log()[-3000:]
    assert (record / "requests.jsonl").read_text().count("\n") == 2


def test_disagg_server_without_record_holds_a_bounded_number_of_records(tmp_path):
    """Without --record nothing reads the kept records, so the router must not keep them: 2,000
    short requests through a 1P1D server, then the router holds no closed record or iteration and
    only the records of requests still in flight (the count comes from the router's recorder, the
    number served from the client: two independent counts)."""
    import asyncio

    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    cfg = tiny_hf_config()
    model_dir = write_hf_dir(str(tmp_path / "tiny"), cfg, random_weights(cfg))
    server = ServerProcess("--mode", "disagg", "--model", model_dir, "--dtype", "float32", "--kv-cache-memory",
                           "8MiB", "--max-model-len", "64", "--prefill-threads", "1", "--decode-threads", "1")
    num_requests, concurrency = 2000, 32
    try:
        server.wait_ready(300)

        async def drive() -> tuple[int, list[int]]:
            served = 0
            peaks: list[int] = []
            sem = asyncio.Semaphore(concurrency)
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                async def one(i: int) -> None:
                    nonlocal served
                    body = {"model": "tiny", "prompt": [5 + i % 7, 6, 7 + i % 3], "max_tokens": 1 + i % 2,
                            "temperature": 0, "ignore_eos": True}
                    async with sem:
                        r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 1 + i % 2
                    served += 1
                    if i % 250 == 0:  # mid-run: what the router holds while requests are in flight
                        peaks.append((await http.get("/health")).json()["records"]["num_open"])

                await asyncio.gather(*(one(i) for i in range(num_requests)))
            return served, peaks

        served, peaks = asyncio.run(drive())
        assert served == num_requests
        for _ in range(100):  # the last responses' delivery stamps reach the engine thread just after them
            records = httpx.get(server.url + "/health", timeout=30).json()["records"]
            if records["num_open"] == 0 and records["num_awaiting_delivery"] == 0:
                break
            time.sleep(0.1)
        assert records["num_kept_requests"] == 0 and records["num_kept_iterations"] == 0, records
        assert records["num_open"] == 0 and records["num_awaiting_delivery"] == 0, records
        assert max(peaks) <= concurrency, peaks  # in flight only, never the history
        text = httpx.get(server.url + "/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        ttft = [s for s in families["phaselab_time_to_first_token_seconds"].samples
                if s.name.endswith("_count") and s.labels["worker"] == "router"]
        assert ttft[0].value == num_requests  # observed into Prometheus, then dropped
    finally:
        server.signal(signal.SIGTERM)
        assert server.stop(60) == 0, server.log()[-3000:]
