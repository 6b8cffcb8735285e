"""The discrete-event simulation: core's own scheduler and router, the run directory of a real run,
the bench's workloads, and disaggregated serving with KV transfers that share their links."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import phaselab.core.routing
import phaselab.core.scheduler
from phaselab.core.kv_cache_manager import cdiv
from phaselab.obs.rundir import read_run_dir
from phaselab.obs.perfetto import validate_trace
from phaselab.sim import loop
from phaselab.cost.catalog import get_hardware, get_model
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.events import EventQueue
from phaselab.sim.loop import simulate
from phaselab.sim.summary import summarize
from phaselab.sim.transfer import Network
from phaselab.sim.workload import (
    SimRequest, interference_requests, random_requests, shared_prefix_requests,
)
from phaselab.workload.arrivals import ArrivalPlan
from phaselab.workload.interference import InterferenceParams

H100 = get_hardware("h100")
LLAMA8 = get_model("llama-3-8b")


def test_the_simulator_drives_cores_classes_not_copies():
    assert loop.Scheduler is phaselab.core.scheduler.Scheduler
    assert loop.make_routing_policy is phaselab.core.routing.make_routing_policy
    assert loop.WorkerLoad is phaselab.core.routing.WorkerLoad


def test_the_simulator_never_imports_torch():
    code = (
        "import sys\n"
        "import phaselab.sim.simulate_cli, phaselab.sim.loop, phaselab.sim.replay, phaselab.sim.calibrate, phaselab.sim.search\n"
        "from phaselab.cost.catalog import get_model, get_hardware\n"
        "from phaselab.sim.deployment import Deployment\n"
        "from phaselab.sim.workload import random_requests\n"
        "r = phaselab.sim.loop.simulate(Deployment(get_model('llama-3-8b'), get_hardware('h100')),"
        " random_requests(5, '64', '4'))\n"
        "assert len(r.requests) == 5\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m == 'torch' or m.startswith('torch.') or m == 'phaselab.engine' or m.startswith('phaselab.engine.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_random_workload_has_the_benchs_lengths_and_arrival_times():
    from phaselab.workload.arrivals import arrival_offsets
    from phaselab.workload.prompts import RandomParams, random_workload

    class CountOnly:  # the bench's builder draws prompt words after the lengths; none needed here
        def build(self, rng, n, prefix=None):
            return "x" * n

    seed, n = 7, 50
    seeds = np.random.SeedSequence(seed).spawn(2)  # as phaselab bench's cli and runner
    specs = random_workload(RandomParams(n, "uniform:10:500", "normal:64:16"), CountOnly(),
                            np.random.default_rng(seeds[0]))
    offsets = arrival_offsets(n, 3.0, 0.5, np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1]))
    sim = random_requests(n, "uniform:10:500", "normal:64:16", seed, ArrivalPlan(request_rate=3.0, burstiness=0.5))
    assert [s.num_prompt_tokens for s in specs] == [r.num_prompt_tokens for r in sim]
    assert [s.max_tokens for s in specs] == [r.max_tokens for r in sim]
    assert [r.arrival_s for r in sim] == offsets
    assert [s.request_id for s in specs] == [r.request_id for r in sim]


def _small(**kw) -> Deployment:
    return Deployment(LLAMA8, H100, **kw)


def test_simulated_run_directory_is_a_run_directory(tmp_path):
    reqs = random_requests(40, "uniform:16:700", "uniform:1:40", seed=1, arrivals=ArrivalPlan(request_rate=50))
    d = _small(colocated=RoleConfig(max_num_batched_tokens=256, max_num_seqs=8, num_blocks=120))
    result = simulate(d, reqs, check_invariants=True)
    result.write(str(tmp_path))
    data = read_run_dir(str(tmp_path))
    assert data.config["simulated"] is True and data.config["format"] == "phaselab-run"
    assert data.config["scheduler"]["max_num_batched_tokens"] == 256
    assert len(data.requests) == 40 and len(data.iterations) == len(result.iterations)
    assert not validate_trace(json.loads((tmp_path / "trace.json").read_text()))
    by_id = {r.request_id: r for r in reqs}
    assert sum(m.num_preemptions for m in data.requests) > 0  # 120 blocks are too few: preemption happened
    for m in data.requests:
        assert m.finish_reason == "length" and m.num_output_tokens == by_id[m.request_id].max_tokens
        assert len(m.token_sent_ns) == len(m.token_sampled_ns) == m.num_output_tokens
        if not any(t < m.first_token_sampled_ns for t in m.preempted_ns):  # else a recompute counts again
            assert sum(c.num_tokens for c in m.prefill_chunks) + m.num_cached_tokens == m.num_prompt_tokens
        assert sum(m.ttft_components_ns().values()) == m.ttft_s * 1e9 or abs(
            sum(m.ttft_components().values()) - m.ttft_s) < 1e-9
        chain = [m.arrived_ns, m.first_scheduled_ns, m.first_token_sampled_ns, *m.token_sampled_ns, m.finished_ns]
        assert chain == sorted(chain)
    for rec in data.iterations:
        assert rec.num_prefill_tokens + rec.num_decode_tokens <= 256
        assert rec.modeled.weight_bytes > 0 and rec.end_ns > rec.start_ns
    starts = [rec.start_ns for rec in data.iterations]
    assert starts == sorted(starts)  # one worker: its iterations never overlap
    assert all(a.end_ns <= b.start_ns for a, b in zip(data.iterations, data.iterations[1:]))


def test_output_length_and_eos_are_the_workloads():
    reqs = [SimRequest("a", 100, max_tokens=50, output_len=7), SimRequest("b", 30, max_tokens=5, index=1)]
    result = simulate(_small(), reqs)
    got = {m.request_id: (m.finish_reason, m.num_output_tokens) for m in result.requests}
    assert got == {"a": ("stop", 7), "b": ("length", 5)}


def test_chunked_prefill_keeps_streams_flowing_where_prefill_first_stalls_them():
    # the bench's interference workload, timed for an H100 (the bench's defaults are for this CPU)
    reqs = interference_requests(InterferenceParams(num_streams=8, stream_output_len=400, num_long_prompts=3,
                                                    long_input_len=2048, long_start_s=0.3, long_interval_s=0.5))
    results = {}
    for policy in ("chunked", "prefill-first"):
        budget = 256 if policy == "chunked" else None
        d = _small(colocated=RoleConfig(policy=policy, max_num_batched_tokens=budget), max_model_len=4096)
        results[policy] = simulate(d, reqs)
    worst_gap = {p: max(max(m.itl_s) for m in r.requests if m.request_id.startswith("req-stream"))
                 for p, r in results.items()}
    long_ttft = {p: max(m.ttft_s for m in r.requests if m.request_id.startswith("req-long"))
                 for p, r in results.items()}
    assert worst_gap["prefill-first"] > 1.5 * worst_gap["chunked"]  # a 1024-token prompt in one iteration
    assert long_ttft["chunked"] > long_ttft["prefill-first"]  # the price: the long prompt's TTFT grows


def test_prefix_groups_share_cached_blocks():
    reqs = shared_prefix_requests(24, num_groups=3, prefix_len=256, suffix_len="32", output_len="4", seed=0,
                                  arrivals=ArrivalPlan(request_rate=20))
    result = simulate(_small(), reqs)
    hits = sorted(m.num_cached_tokens for m in result.requests)
    assert hits[:3] == [0, 0, 0] and hits[-1] == 256  # each group's first request misses, later ones hit


def test_closed_loop_keeps_at_most_concurrency_requests_in_flight():
    reqs = random_requests(30, "200", "20", seed=0)
    result = simulate(_small(), reqs, ArrivalPlan(concurrency=3))
    events = sorted([(m.arrived_ns, 1) for m in result.requests] + [(m.finished_ns, -1) for m in result.requests],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    assert peak == 3 and len(result.requests) == 30


def test_replicas_share_the_load():
    reqs = random_requests(200, "uniform:64:512", "32", seed=3, arrivals=ArrivalPlan(request_rate=200))
    result = simulate(_small(num_replicas=4), reqs)
    per_worker = [w["num_iterations"] for w in result.worker_stats]
    assert len(per_worker) == 4 and min(per_worker) > 0.5 * max(per_worker)
    assert {m.worker for m in result.requests} == {"replica-0", "replica-1", "replica-2", "replica-3"}


# -- disaggregation ------------------------------------------------------------------------------------
def _disagg(link: str, **kw) -> Deployment:
    return Deployment(LLAMA8, H100, "disagg", num_prefill=2, num_decode=2, transfer_link=link, **kw)


def test_disaggregated_requests_move_their_kv_and_free_every_block():
    reqs = random_requests(60, "uniform:20:900", "uniform:2:30", seed=2, arrivals=ArrivalPlan(request_rate=30))
    d = _disagg("nvlink4", decode=RoleConfig(num_blocks=200))
    sim = loop.Simulator(d, reqs, check_invariants=True)
    result = sim.run()
    kv = LLAMA8.kv_bytes_per_token(2)
    for m in result.requests:
        assert m.worker.startswith("prefill-") and m.decode_worker.startswith("decode-")
        # the connector's rule: whole blocks of the prompt's K/V
        assert m.kv_transfer_bytes == cdiv(m.num_prompt_tokens, 16) * 16 * kv
        assert m.first_token_sampled_ns <= m.kv_transfer_start_ns < m.kv_transfer_end_ns <= m.decode_admitted_ns
        assert m.token_iteration_ids and len(m.token_sampled_ns) == m.num_output_tokens
    for pool in sim.workers.values():
        for w in pool:
            assert w.scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
            assert not w.scheduler.has_unfinished_requests()
    roles = {rec.role for rec in result.iterations}
    assert roles == {"prefill", "decode"}
    assert all(rec.num_decode_tokens == 0 for rec in result.iterations if rec.role == "prefill")


def test_transfer_share_of_ttft_rises_from_negligible_on_nvlink_to_dominant_on_25gbe():
    """The same disaggregated workload; the first token reaches the client from the decode side,
    once the KV has arrived (a proxy in front of the decode instance), so TTFT contains the transfer."""
    reqs = random_requests(200, "uniform:512:2048", "uniform:16:64", seed=4, arrivals=ArrivalPlan(request_rate=8))
    shares = {}
    for link in ("nvlink4", "25gbe"):
        result = simulate(_disagg(link, first_token_from="decode"), reqs)
        s = summarize(result.requests)
        shares[link] = s["transfer_share_of_ttft"]["p50"]
    assert shares["nvlink4"] < 0.02, shares  # microseconds next to a prefill of tens of ms
    assert shares["25gbe"] > 0.5, shares  # 64-256 MiB per request at 3.1 GB/s


def test_with_the_first_token_from_prefill_the_transfer_delays_the_second_token():
    reqs = random_requests(50, "1024", "8", seed=5, arrivals=ArrivalPlan(request_rate=5))
    first_gap = {}
    for link in ("nvlink4", "25gbe"):
        result = simulate(_disagg(link), reqs)
        assert summarize(result.requests)["transfer_share_of_ttft"]["max"] == 0  # TTFT ends before the transfer
        first_gap[link] = float(np.median([m.itl_s[0] for m in result.requests]))
    # 1024 tokens x 128 KiB = 128 MiB: ~43 ms over 25 GbE, ~0.3 ms over NVLink
    assert first_gap["25gbe"] - first_gap["nvlink4"] > 0.035


def test_layer_by_layer_transfer_overlaps_the_prefill():
    reqs = random_requests(40, "2048", "4", seed=6, arrivals=ArrivalPlan(request_rate=2))
    after = simulate(_disagg("100gbe", first_token_from="decode"), reqs)
    layered = simulate(_disagg("100gbe", first_token_from="decode", transfer_mode="layer-by-layer"), reqs)
    tail = {name: float(np.median([m.kv_transfer_end_ns - m.first_token_sampled_ns for m in r.requests]))
            for name, r in (("after", after), ("layered", layered))}
    # 2048 x 128 KiB = 256 MiB at 12.5 GB/s = 21 ms after the prefill, vs only what the prefill
    # could not send while it ran (its ~45 ms is longer than the transfer)
    assert tail["after"] > 0.018e9 and tail["layered"] < 0.25 * tail["after"]
    for m in layered.requests:
        assert m.kv_transfer_bytes == cdiv(m.num_prompt_tokens, 16) * 16 * LLAMA8.kv_bytes_per_token(2)
        assert m.kv_transfer_start_ns <= m.first_token_sampled_ns


def test_concurrent_flows_share_a_port_fairly_and_respect_caps():
    events = EventQueue(0)
    net = Network(events)
    for p in ("tx:a", "tx:b", "rx:c", "rx:d"):
        net.add_port(p, 1e9)  # 1 GB/s
    done = {}
    net.start("tx:a", "rx:c", 10**9, lambda f: done.__setitem__("ac", f.done_ns))
    net.start("tx:b", "rx:c", 10**9, lambda f: done.__setitem__("bc", f.done_ns))  # shares rx:c
    net.start("tx:b", "rx:d", 10**9, lambda f: done.__setitem__("bd", f.done_ns), cap=0.25e9)  # capped
    events.run()
    # bd is held at 0.25 GB/s by its cap; ac and bc split rx:c (0.5 each) until both finish at 2 s
    assert done["ac"] == pytest.approx(2e9, rel=1e-6) and done["bc"] == pytest.approx(2e9, rel=1e-6)
    assert done["bd"] == pytest.approx(4e9, rel=1e-6)
