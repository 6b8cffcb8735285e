"""1P1D across two simulated hosts (tests/_netns.py): a Ray head in namespace `a` runs the server
and the prefill worker, a Ray worker node in namespace `b` the decode worker, so every KV cache
crosses a real TCP link (a veth pair). Then the decode host dies mid-stream.

Needs root and iproute2; without them the test FAILS saying what is missing (CI runs as root).
The link is unshaped here; benchmarks/multihost_kv.py shapes it and reports the bandwidth.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests._netns import NetnsPair, NetnsUnavailable, RayHosts, require_netns, serve_disagg_on_a
from tests._server_helpers import free_port, metric, sse_events

pytestmark = pytest.mark.slow

PROMPT = list(range(5, 45))  # 40 token ids of the tiny vocabulary


def start_disagg_server(net: NetnsPair, hosts: RayHosts, model_dir: str, log_path: str, *extra: str
                        ) -> tuple[object, str]:
    """`phaselab serve --mode disagg` in namespace a, prefill pinned to host a, decode to host b."""
    port = free_port()
    args = ["--model", model_dir, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
            "--served-model-name", "tiny", *extra]
    return serve_disagg_on_a(net, hosts, port, args, log_path, ready_s=400)


def test_1p1d_across_two_hosts_then_the_decode_host_dies(tmp_path):
    try:
        require_netns()
    except NetnsUnavailable as e:
        pytest.fail(f"the multi-host test cannot run here: {e}")
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    cfg = tiny_hf_config()
    model_dir = write_hf_dir(str(tmp_path / "tiny"), cfg, random_weights(cfg))
    log_path = str(tmp_path / "server.log")
    with NetnsPair(control=True) as net:
        hosts = RayHosts(net).start()
        try:
            proc, url = start_disagg_server(net, hosts, model_dir, log_path, "--worker-timeout", "5",
                                            "--kv-lease-timeout", "5")
            # -- the KV crosses the link: counted by the router and, independently, by the veth ------
            sent_before = net.tx_bytes("a")
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
            text = httpx.get(url + "/metrics", timeout=30).text
            kv_bytes = metric(text, "phaselab_kv_transfer_bytes_moved_total")
            assert kv_bytes > 0
            assert net.tx_bytes("a") - sent_before >= kv_bytes  # host a sent at least the KV to host b
            assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"

            # -- the decode host dies mid-stream ---------------------------------------------------
            events: list = []

            def stream() -> None:
                long = {**body, "max_tokens": 200, "stream": True}
                with httpx.stream("POST", url + "/v1/completions", json=long, timeout=300) as s:
                    buf = ""
                    for chunk in s.iter_text():
                        buf += chunk
                        events[:] = sse_events(buf)

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            deadline = time.monotonic() + 120
            while len(events) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(events) >= 5, "the stream did not start"
            killed = net.kill_namespace_processes("b")
            assert killed > 0
            t.join(120)
            assert not t.is_alive(), "the stream did not end after its decode host died"
            assert events[-1] == "[DONE]", events[-3:]
            last = events[-2]
            if "error" in last:  # no other decode worker to re-route to: a clear error
                assert "decode" in last["error"]["message"], last
            else:
                assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
            # /health says which role is gone; new work is refused before any prefill
            deadline = time.monotonic() + 60
            health = httpx.get(url + "/health", timeout=10)
            while health.status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.5)
                health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503, health.text
            assert health.json()["status"] == "degraded" and "decode" in health.json()["reason"], health.text
            prefilled_before = metric(httpx.get(url + "/metrics", timeout=30).text, "phaselab_iteration_tokens_count",
                                      worker="prefill-0", phase="prefill")
            refused = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_live_worker", refused.text
            assert int(refused.headers["retry-after"]) >= 1
            # no leaked blocks on the survivor (the prefill worker), nothing prefilled for the refused one
            deadline = time.monotonic() + 60
            while True:
                text = httpx.get(url + "/metrics", timeout=30).text
                used = metric(text, "phaselab_kv_cache_blocks_used", worker="prefill-0")
                leases = metric(text, "phaselab_worker_kv_leases", worker="prefill-0")
                if (used == 0 and leases == 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert used == 0 and leases == 0, (used, leases)
            assert metric(text, "phaselab_iteration_tokens_count", worker="prefill-0",
                          phase="prefill") == prefilled_before
        finally:
            hosts.stop()
    with open(log_path) as f:
        log = f.read()
    assert "Traceback" not in log.split("is gone")[0], log[-5000:]  # nothing failed before the kill
