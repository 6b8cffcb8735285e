"""benchmarks/serve_vs_peers.py, peer_servers.py and peer_tables.py: their pure helpers only (no server,
no peer, no timing asserted)."""

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
_spec.loader.exec_module(svp)  # puts benchmarks/ on sys.path
import peer_servers as ps  # noqa: E402
import peer_tables as pt  # noqa: E402

linux_proc = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")


def _result(ids, starts, ttfts, lats):
    return {"request_ids": ids, "start_times": starts, "ttfts": ttfts, "latencies": lats}


def test_streams_cover_long_prompts():
    ids = ["req-stream-0", "req-stream-1", "req-long-0", "req-long-1"]
    # streams end at 10 s and 12 s; long prompts get their first token at 3 s and 7 s
    assert ps.streams_cover_long_prompts(_result(ids, [0, 0, 2, 4], [0.1, 0.1, 1, 3], [10, 12, 1.1, 3.1])) is True
    # one stream ends at 5 s, before the second long prompt's first token (7 s)
    assert ps.streams_cover_long_prompts(_result(ids, [0, 0, 2, 4], [0.1, 0.1, 1, 3], [5, 12, 1.1, 3.1])) is False
    assert ps.streams_cover_long_prompts({"request_ids": ids}) is None


def test_extract_metrics_keeps_the_compared_figures():
    result = {
        "completed": 7, "failed": 0, "num_requests": 7, "output_throughput": 123.4, "median_ttft_ms": 50.0,
        "p99_itl_ms": 80.0, "itls": [[1, 2, 3]], "ttfts": [0.1] * 7,
        "interference": {"long_prompts": [{"ttft_ms": 300.0, "max_stream_gap_ms": 250.0},
                                          {"ttft_ms": None, "max_stream_gap_ms": None}]},
        "groups": {"stream": {"p99_itl_ms": 90.0}, "long": {"median_ttft_ms": 310.0}},
        "server_metrics_diff": {"counters": {"vllm:prefix_cache_hits_total": 0.0, "vllm:num_preemptions_total": 0.0}},
    }
    m = ps.extract_metrics(result)
    assert m["output_throughput"] == 123.4 and m["median_ttft_ms"] == 50.0 and m["p99_itl_ms"] == 80.0
    assert "itls" not in m and "ttfts" not in m  # raw per-request lists stay in the raw result file
    assert m["long_ttft_ms"] == [300.0]
    assert m["max_stream_gap_during_long_prefill_ms"] == 250.0
    assert m["stream_p99_itl_ms"] == 90.0 and m["long_median_ttft_ms"] == 310.0
    assert m["server_cache_counters"] == {"vllm:prefix_cache_hits_total": 0.0}


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
            if ps.read_status_kib(kid).get("VmRSS", 0) > 30 * 1024:
                break
            time.sleep(0.1)
        assert set(ps.process_tree(parent.pid)) == {parent.pid, kid}
        sampler = ps.TreeMemorySampler(parent.pid, interval_s=0.05).start()
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
        for pid in ps.process_tree(parent.pid)[::-1]:  # only the processes this test started
            os.kill(pid, 9)
        parent.wait()
    assert ps.read_status_kib(parent.pid) == {}
    assert ps.process_tree(parent.pid) == []


@linux_proc
def test_loadavg_and_port_helpers():
    assert len(ps.loadavg()) == 3
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ps.port_in_use(port)
    assert ps.wait_port_free(port, timeout_s=5)


_SPINNER = r"""
import select, sys, time
while True:                       # spin in 20 ms slices; asked (a line on stdin), report this process's CPU clock
    t = time.monotonic()
    while time.monotonic() - t < 0.02:
        pass
    if select.select([sys.stdin], [], [], 0)[0]:
        sys.stdin.readline()
        print(time.process_time(), flush=True)
"""


def _ask(proc) -> float:
    proc.stdin.write("?\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


@linux_proc
def test_cpu_share_attributes_a_busy_child_to_the_server():
    # truth: the child's own CPU clock (clock_gettime(CLOCK_PROCESS_CPUTIME_ID)), not /proc's jiffies;
    # whatever share of the cores a loaded machine gives it, CpuShare must count the same CPU time
    busy = subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _ask(busy)
        p0 = _ask(busy)
        share = ps.CpuShare(busy.pid)
        t0 = time.monotonic()
        time.sleep(2.0)
        r = share.result()
        wall = time.monotonic() - t0
        p1 = _ask(busy)  # answered within one 20 ms slice after result()
        own = (p1 - p0) / wall
        # two 20 ms slices at the ends and 10 ms jiffies, over 2 s: 0.05 cores at most
        assert r["server_cores"] == pytest.approx(own, abs=0.05)
        assert r["machine_busy_cores"] >= r["server_cores"] - 0.05
        # the rest of the machine's busy time is what the server did not use (never below zero)
        assert r["other_cores_incl_client"] == pytest.approx(max(0.0, r["machine_busy_cores"] - r["server_cores"]))
    finally:
        busy.kill()
        busy.wait()
    assert ps.process_cpu_jiffies(busy.pid) == 0


# -- the protocol ---------------------------------------------------------------------------------


def test_round_order_differs_every_round_and_covers_every_server():
    keys = ["phaselab", "vllm", "llamacpp-q4_1", "phaselab-16bit", "llamacpp-bf16"]
    for wi in range(3):
        orders = [tuple(svp.round_order(keys, r, wi)) for r in range(3)]
        assert all(sorted(o) == sorted(keys) for o in orders)  # each server once per workload
        assert len(set(orders)) == 3  # a different order every round
        assert len({o[0] for o in orders}) == 3  # and a different server first
    assert svp.round_order(["a", "b", "c"], 0, 0) == ["a", "b", "c"]
    assert svp.round_order(["a", "b", "c"], 1, 0) == ["b", "a", "c"]  # from the next one, backwards


def test_each_family_grid_is_documented_and_ends_with_its_documented_best():
    for fam, cands in svp.GRID.items():
        assert len({c.name for c in cands}) == len(cands) >= 2
        assert all(c.why for c in cands)
    # ggml spins at its barriers: llama.cpp must be offered the OpenMP default and a bounded spin, not
    # only PASSIVE (issue 35: PASSIVE cost it 3x in its own benchmark)
    llama = {c.name: c.env for c in svp.GRID["llamacpp"]}
    assert llama["t2 OpenMP default"]["OMP_WAIT_POLICY"] is None
    assert llama["t2 spin 10000"]["GOMP_SPINCOUNT"] == "10000"
    assert llama["t2 PASSIVE"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert {c.env.get("VLLM_CPU_OMP_THREADS_BIND") for c in svp.GRID["vllm"]} == {"auto", "0-1"}


def test_geomean_needs_every_figure():
    assert svp.geomean([4.0, 9.0]) == pytest.approx(6.0)
    assert svp.geomean([4.0, None]) is None and svp.geomean([4.0, 0.0]) is None and svp.geomean([]) is None


def _rounds(*tputs, itl=10.0):
    return [{"round": i + 1, "output_throughput": t, "median_ttft_ms": 100.0 * (i + 1), "median_itl_ms": itl,
             "p99_itl_ms": 2 * itl, "completed": 16, "num_requests": 16, "idle_servers_cores": 0.001 * i}
            for i, t in enumerate(tputs)]


def _doc(**workloads_by_server):
    return {"date": "2026-12-05T12:00:00", "machine": {"cpu": "test cpu", "cores": 2, "mem_gib": 23.0},
            "settings": {"rounds": 3}, "read_bandwidth": {"before_Bps": 20e9, "after_Bps": 24e9},
            "servers": {k: {"settings": {"candidate": "c"}, "step_bytes": 96_000_000 if k == "phaselab" else None,
                            "workloads": v} for k, v in workloads_by_server.items()}}


def test_ratios_pair_rounds_and_take_the_median():
    doc = _doc(phaselab={"random-c1": _rounds(90.0, 80.0, 100.0)},
               vllm={"random-c1": _rounds(30.0, 40.0, 20.0)},
               **{"llamacpp-q4_1": {"random-c1": _rounds(45.0, None, 50.0)}})
    r = pt.ratio_table(doc)
    # paired by round: 90/30, 80/40, 100/20 -- not the ratio of the medians (90/30 = 3.0)
    assert r["phaselab / vllm @ random-c1"]["per_round"] == pytest.approx([3.0, 2.0, 5.0])
    assert r["phaselab / vllm @ random-c1"]["median"] == pytest.approx(3.0)
    assert (r["phaselab / vllm @ random-c1"]["min"], r["phaselab / vllm @ random-c1"]["max"]) == (2.0, 5.0)
    assert r["phaselab / llamacpp-q4_1 @ random-c1"]["per_round"] == pytest.approx([2.0, 2.0])  # round 2 missing
    s = pt.summary(doc, "phaselab", "random-c1")
    assert s["output_throughput"] == (90.0, 80.0, 100.0) and s["completed"] == 48 and s["rounds"] == 3
    assert s["idle_servers_cores_max"] == pytest.approx(0.002)


def test_render_shows_floor_ratios_rounds_and_reproduction():
    doc = _doc(phaselab={"random-c1": _rounds(90.0, 80.0, 100.0, itl=8.0)},
               vllm={"random-c1": _rounds(30.0, 40.0, 20.0)})
    doc["rounds"] = [{"round": 1, "order": {"random-c1": ["phaselab", "vllm"]}}]
    doc["reproduce"] = {"file": "old.json", "date": "2026-12-04", "ratios": {
        "phaselab / vllm @ random-c1": {"median": 2.4}}}
    md = pt.render_markdown(doc)
    assert "test cpu" in md and "20.0 / 24.0 GB/s" in md
    # floor = 96 MB / 24 GB/s (the higher reading) = 4.00 ms; c1 ITL p50 8 ms = 2.00x the floor
    assert "| 4.00 | 2.00x |" in md
    assert "| phaselab / vLLM (bf16) | random-c1 | 3.00, 2.00, 5.00 | **3.00x** [2.00-5.00] |" in md
    assert "| phaselab / vllm @ random-c1 | 2.40 | 3.00 | +25% | **no** |" in md  # over the 20% tolerance
    assert "round 1: random-c1 phaselab > vLLM (bf16)" in md


def test_step_bytes_from_a_gguf_and_a_safetensors_dir_match_an_independent_count(tmp_path):
    import numpy as np
    import gguf
    from safetensors.numpy import save_file

    # tied (no output.weight): the embedding is the head, read whole; plus one f16 and one f32 tensor
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float16))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(32, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert svp.gguf_step_bytes(str(tmp_path / "m.gguf")) == 64 * 32 * 2 + 32 * 32 * 2 + 32 * 4
    w = gguf.GGUFWriter(str(tmp_path / "u.gguf"), "llama")  # untied: the lookup reads one row only
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float16))
    w.add_tensor("output.weight", np.zeros((64, 32), dtype=np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert svp.gguf_step_bytes(str(tmp_path / "u.gguf")) == 64 * 32 * 2

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((64, 32), np.float32),
               "model.layers.0.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}, str(d / "model.safetensors"))
    assert svp.safetensors_step_bytes(str(d)) == (64 * 32 + 32 * 32) * 2  # served in bf16, tied
    save_file({"lm_head.weight": np.zeros((64, 32), np.float32)}, str(d / "model-2.safetensors"))
    assert svp.safetensors_step_bytes(str(d)) == (64 * 32 + 32 * 32) * 2  # untied: the table is gathered


def test_phaselab_ready_line_gives_the_bytes_a_step_reads():
    ready = ("SmolLM2 (gguf, torch.bfloat16, dtype bfloat16 (auto: ...), linear path q4 ...; 96.5 MB of weights "
             "per decode step), 100 KV blocks x 16 tokens")
    assert ps.phaselab_ready_desc(ready)["step_bytes"] == 96_500_000
