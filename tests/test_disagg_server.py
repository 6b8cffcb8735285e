"""`phaselab serve --mode disagg`: the OpenAI server over a prefill and a decode worker on Ray."""

from __future__ import annotations

import signal

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
