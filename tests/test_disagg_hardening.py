"""`phaselab serve --mode disagg` hardening (issue 19 items 5 and 8), against real server processes:
the disaggregation options reach the workers from the command line, a KV lease that no decode
worker picks up in time is freed by the prefill worker and counted, and idle workers' gauges
show the present, not the last iteration. (Item 1, a dead role, is tests/test_multihost.py.)"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests._server_helpers import ServerProcess, metric, sse_events

pytestmark = pytest.mark.slow

PROMPT = list(range(5, 45))  # 40 token ids: 3 blocks of 16


def _tiny(tmp_path) -> str:
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    cfg = tiny_hf_config()
    return write_hf_dir(str(tmp_path / "tiny"), cfg, random_weights(cfg))


def _wait_metric(url: str, name: str, want: float, timeout_s: float = 30.0, **labels: str) -> tuple[float, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        value = metric(text, name, **labels)
        if value == want or time.monotonic() > deadline:
            return value, text
        time.sleep(0.25)


def test_kv_lease_expires_when_no_decode_worker_fetches_and_idle_gauges_are_fresh(tmp_path):
    """The decode worker is made to stall 6 s before every fetch (fault injection) while the lease
    lasts 1 s: the prefill worker frees the parked KV at expiry (`expired` counted), the decode
    side's late fetch finds nothing, and the request ends with a clear error (recovery off).
    The prefill worker's blocks are held by the lease in between (ray-actor transport keeps the
    KV in its cache), so its kv_cache_blocks_used gauge must read > 0 and then 0 while idle."""
    server = ServerProcess("--mode", "disagg", "--model", _tiny(tmp_path), "--dtype", "float32",
                           "--kv-cache-memory", "8MiB", "--max-model-len", "128", "--prefill-threads", "1",
                           "--decode-threads", "1", "--served-model-name", "tiny", "--kv-transport", "ray-actor",
                           "--kv-lease-timeout", "1", "--fault-transfer-delay", "6", "--no-recover-lost-kv",
                           "--transfer-timeout", "10")
    try:
        server.wait_ready(400)
        url = server.url
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        message = events[-2]["error"]["message"]
        assert "KV" in message or "kv" in message, message
        expired, text = _wait_metric(url, "phaselab_worker_kv_leases_ended_total", 1, outcome="expired",
                                     worker="prefill-0")
        assert expired == 1, text
        assert metric(text, "phaselab_worker_kv_leases", worker="prefill-0") == 0
        # idle now: every worker's gauges show the present (no iteration ran since the lease ended)
        for worker in ("prefill-0", "decode-0"):
            for gauge in ("phaselab_kv_cache_blocks_used", "phaselab_num_requests_running",
                          "phaselab_num_requests_waiting"):
                value, text = _wait_metric(url, gauge, 0, timeout_s=10, worker=worker)
                assert value == 0, (worker, gauge, value)
        assert metric(text, "phaselab_disagg_request_failures_total") >= 1
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"  # both roles still live
    finally:
        server.signal(signal.SIGTERM)
        assert server.stop(60) == 0, server.log()[-3000:]


def test_serve_disagg_options_reach_the_engine(tmp_path):
    """--prefill-workers/--decode-workers and a DisaggConfig flag, seen in what the server runs."""
    server = ServerProcess("--mode", "disagg", "--model", _tiny(tmp_path), "--dtype", "float32",
                           "--kv-cache-memory", "8MiB", "--max-model-len", "64", "--prefill-workers", "1",
                           "--decode-workers", "2", "--prefill-threads", "1", "--decode-threads", "1",
                           "--served-model-name", "tiny", "--worker-timeout", "7", "--record", str(tmp_path / "run"))
    try:
        server.wait_ready(400)
        body = {"model": "tiny", "prompt": PROMPT[:8], "max_tokens": 2, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        deadline = time.monotonic() + 30  # each worker's text reaches /metrics within a refresh (about 1 s)
        while True:
            text = httpx.get(server.url + "/metrics", timeout=30).text
            workers = {s.split('worker="')[1].split('"')[0] for s in text.splitlines()
                       if s.startswith("phaselab_worker_busy_ratio{")}
            if workers == {"prefill-0", "decode-0", "decode-1"} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert workers == {"prefill-0", "decode-0", "decode-1"}, workers
        flushed = httpx.post(server.url + "/record/flush", timeout=60).json()
        import json
        import os

        with open(os.path.join(flushed["path"], "config.json")) as f:
            config = json.load(f)
        assert '"worker_timeout_s": 7.0' in json.dumps(config), config
    finally:
        server.signal(signal.SIGTERM)
        assert server.stop(60) == 0, server.log()[-3000:]
