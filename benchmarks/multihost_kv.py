"""KV transfer bandwidth of 1P1D across two simulated hosts, at several shaped link rates.

    sudo python benchmarks/multihost_kv.py [--rates none 1gbit 100mbit] [--delay-ms 0] [--requests 6]
        [--prompt-tokens 384] [--model PATH] [--dtype bfloat16] [--out benchmarks/results/multihost_kv.json]

Two network namespaces joined by a veth pair (tests/_netns.py): a Ray head with the server and the
prefill worker in `a`, a Ray worker node with the decode worker in `b`, so each request's KV cache
crosses the veth over TCP (Ray's object transfer). The link is shaped with `tc` (tbf at the rate,
netem delay if given) between batches, without restarting anything. Per rate, `--requests`
prompts of `--prompt-tokens` tokens ask for 2 tokens each, one after another (so transfers do not
overlap), and the report gives:

  per request   KV bytes / transfer time (router record: transfer start -> end, which includes
                Ray's fetch setup and the decode side's copy into its cache), median and range
  aggregate     sum of KV bytes / sum of transfer times
  link          veth bytes a -> b during the batch (an independent count: KV + protocol overhead)
  shaped        the tbf rate; achieved / shaped is the fraction of the link the transfer used

Needs root and iproute2. Results name the CPU; times drift on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests._netns import NetnsPair, RayHosts, require_netns  # noqa: E402
from tests._server_helpers import free_port  # noqa: E402
from _machine import cpu_model, write_json  # noqa: E402

RATE_BITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


def rate_bytes_per_s(rate: str) -> float | None:
    for unit, bits in RATE_BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * bits / 8
    return None


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram summed over every label set."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name == name + "_sum":
                    total += s.value
                elif s.name == name + "_count":
                    count += s.value
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", nargs="+", default=["none", "1gbit", "100mbit"])
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "multihost_kv.json"))
    ns = ap.parse_args()
    require_netns()
    results: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                           "cpu_model": cpu_model(), "cores": os.cpu_count()},
                               "config": vars(ns), "rates": []}
    with NetnsPair(control=True) as net:
        hosts = RayHosts(net).start()
        try:
            port = free_port()
            cmd = [sys.executable, "-m", "phaselab", "serve", "--host", "0.0.0.0", "--port", str(port),
                   "--mode", "disagg", "--ray-address", hosts.address, "--prefill-resources", '{"prefill_host": 1}',
                   "--decode-resources", '{"decode_host": 1}', "--prefill-threads", "1", "--decode-threads", "1",
                   "--dtype", ns.dtype, "--kv-cache-memory", "256MiB", "--max-model-len", "1024",
                   "--no-enable-prefix-caching", "--served-model-name", "m"]
            if ns.model:
                cmd += ["--model", ns.model]
            log_path = os.path.join(hosts.temp_dir, "server.log")
            log = open(log_path, "w")  # noqa: SIM115
            proc = net.popen("a", cmd, stdout=log, stderr=log, env={**hosts.env, "OMP_WAIT_POLICY": "PASSIVE"})
            url = f"http://{net.addr['control_a']}:{port}"
            print(f"starting the 1P1D server across {net.ns['a']} / {net.ns['b']} ...", file=sys.stderr, flush=True)
            _wait_ready(url, proc, log_path)
            for rate in ns.rates:
                shaped = rate if rate != "none" else None
                net.shape(shaped, ns.delay_ms or None, burst="512kb" if shaped and "gbit" in shaped else "256kb")
                row = _measure(url, net, ns, rate)
                row["qdisc"] = net.qdisc("a")
                results["rates"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "qdisc"}), file=sys.stderr, flush=True)
        finally:
            hosts.stop()
    write_json(ns.out, results)
    print(f"wrote {ns.out}", file=sys.stderr)
    return 0


def _wait_ready(url: str, proc: Any, log_path: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready in {timeout_s} s:\n{open(log_path).read()[-4000:]}")


def _measure(url: str, net: NetnsPair, ns: argparse.Namespace, rate: str) -> dict[str, Any]:
    per_request: list[float] = []
    kv_bytes: list[float] = []
    link_before = net.tx_bytes("a")
    text = httpx.get(url + "/metrics", timeout=30).text
    t_sum0, _ = histogram_totals(text, "phaselab_kv_transfer_seconds")
    b_sum0, _ = histogram_totals(text, "phaselab_kv_transfer_bytes")
    for i in range(ns.requests):
        prompt = [1000 + (i * 7919 + k * 104729) % 40000 for k in range(ns.prompt_tokens)]  # distinct prompts
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        text = httpx.get(url + "/metrics", timeout=30).text
        t_sum, _ = histogram_totals(text, "phaselab_kv_transfer_seconds")
        b_sum, _ = histogram_totals(text, "phaselab_kv_transfer_bytes")
        if t_sum > t_sum0:
            per_request.append((b_sum - b_sum0) / (t_sum - t_sum0))
            kv_bytes.append(b_sum - b_sum0)
        t_sum0, b_sum0 = t_sum, b_sum
    text = httpx.get(url + "/metrics", timeout=30).text
    link_bytes = net.tx_bytes("a") - link_before
    shaped = rate_bytes_per_s(rate)
    med = statistics.median(per_request) if per_request else None
    return {
        "rate": rate, "shaped_bytes_per_s": shaped, "delay_ms": ns.delay_ms, "requests": ns.requests,
        "kv_bytes_per_request": statistics.median(kv_bytes) if kv_bytes else None,
        "bandwidth_bytes_per_s": {"median": med, "min": min(per_request, default=None),
                                  "max": max(per_request, default=None)},
        "aggregate_bytes_per_s": sum(kv_bytes) / sum(b / bw for b, bw in zip(kv_bytes, per_request))
        if per_request else None,
        "achieved_over_shaped": (med / shaped) if med and shaped else None,
        "link_bytes_a_to_b": link_bytes, "kv_bytes_total": sum(kv_bytes),
    }


if __name__ == "__main__":
    sys.exit(main())
