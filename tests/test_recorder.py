"""One phase recorder for every loop that runs the scheduler (core/recorder.py).

The policy tests drive PhaseRecorder with hand-made plans. The acceptance tests run one workload
through the real engine (a tiny random model), the simulator replaying that run, the
disaggregated router (1P1D on Ray) and the simulator's disaggregated deployment, and check that
each pair yields records with the same phase stamps, the same prefill chunks and token iterations
where the plans are the same, and durations that agree with each other.
"""

from __future__ import annotations

import dataclasses

import pytest

from phaselab.core.outputs import RequestDelta, ScheduledRequest, SchedulerOutput
from phaselab.core.recorder import PhaseRecorder
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import RequestMetrics
from phaselab.cost.formulas import ModeledCost


# -- the policy -------------------------------------------------------------------------------------------
def _plan(iteration_id: int, rid: str, num_tokens: int, is_prefill: bool, start: int = 0) -> SchedulerOutput:
    s = ScheduledRequest(rid, list(range(num_tokens)), start, [0], [], True, is_prefill, SamplingParams())
    return SchedulerOutput(iteration_id, [s])


def _run_one(rec: PhaseRecorder, rid: str, deliver_at: int | None) -> RequestMetrics:
    rec.open(rid, 4, arrived_ns=100, tokenized_ns=110, queued_ns=120)
    rec.stamp_step(_plan(0, rid, 4, True), [RequestDelta(rid, [9])], 200, 300)
    rec.iteration(_plan(0, rid, 4, True), start_ns=200, end_ns=300, prepare_ns=1, forward_ns=2, sample_ns=3,
                  num_running=1, num_waiting=0, modeled=ModeledCost())
    rec.stamp_step(_plan(1, rid, 1, False, 4), [RequestDelta(rid, [9], "length")], 300, 400)
    m = rec.get(rid)
    assert m is not None
    PhaseRecorder.stamp_sent(m, 410)
    rec.finish(rid, "length", 2, deliver_at)
    return m


def test_keep_policy_keeps_closed_records_and_iterations_and_observes_them():
    observed: list[str] = []
    rec = PhaseRecorder("w", "colocated", keep=True, on_finished=lambda m: observed.append(m.request_id))
    m = _run_one(rec, "a", 405)
    assert rec.requests == [m] and len(rec.iterations) == 1 and observed == ["a"]
    # the record's stamps: queue ends at the first schedule; a chunk spans its iteration
    assert (m.first_scheduled_ns, m.first_token_sampled_ns, m.token_sampled_ns) == (200, 300, [300, 400])
    assert [(c.iteration_id, c.start_ns, c.end_ns, c.num_tokens) for c in m.prefill_chunks] == [(0, 200, 300, 4)]
    assert m.token_sent_ns == [410, 410] and m.finished_ns == 410  # never closed before its last send
    assert rec.stats() == {"num_open": 0, "num_awaiting_delivery": 0, "num_kept_requests": 1,
                           "num_kept_iterations": 1}


def test_observe_policy_drops_what_it_observed():
    observed: list[str] = []
    seen_iterations: list[int] = []
    rec = PhaseRecorder("w", "colocated", keep=False, on_finished=lambda m: observed.append(m.request_id),
                        on_iteration=lambda r: seen_iterations.append(r.iteration_id))
    for k in range(50):
        _run_one(rec, f"r{k}", 500)
    assert len(observed) == 50 and len(seen_iterations) == 50
    assert rec.stats() == {"num_open": 0, "num_awaiting_delivery": 0, "num_kept_requests": 0,
                           "num_kept_iterations": 0}


def test_a_delivered_record_closes_when_marked_and_a_worker_record_never_closes_here():
    rec = PhaseRecorder("w", "colocated")
    m = _run_one(rec, "a", None)  # a server delivers: the record waits for the last write
    assert m.finished_ns is None and rec.stats()["num_awaiting_delivery"] == 1 and not rec.requests
    rec.mark_delivered("a", 450)
    assert m.finished_ns == 450 and rec.requests == [m]
    worker = PhaseRecorder("prefill-0", "prefill", closes=False, on_finished=lambda m: pytest.fail("observed"))
    m = _run_one(worker, "b", 500)
    assert m.finished_ns == 500 and not worker.requests and worker.stats()["num_open"] == 0


# -- the same plan, the same record: engine vs simulator, router vs simulator ----------------------------------
STAMPS = [f.name for f in dataclasses.fields(RequestMetrics)
          if f.name.endswith("_ns") or f.name in ("prefill_chunks", "recompute_chunks", "token_iteration_ids")]


def stamped(m: RequestMetrics) -> frozenset[str]:
    """The phase stamps a record carries (set, non-empty)."""
    return frozenset(n for n in STAMPS if getattr(m, n) not in (None, []))


def check_durations(m: RequestMetrics) -> None:
    """The derived durations agree with each other and with the stamps they come from."""
    ttft_ns = m.first_token_sent_ns - m.arrived_ns
    assert sum(m.ttft_components_ns().values()) == ttft_ns
    assert m.prefill_compute_s <= m.prefill_span_s + 1e-12
    assert len(m.token_sampled_ns) == len(m.token_iteration_ids) == len(m.token_sent_ns) == m.num_output_tokens
    assert all(a <= b for a, b in zip(m.token_sampled_ns, m.token_sent_ns))
    assert m.finished_ns >= m.token_sent_ns[-1] >= m.first_token_sampled_ns >= m.prefill_chunks[-1].end_ns
    assert m.e2e_s >= m.ttft_s >= 0
    if m.num_output_tokens > 1:
        assert m.tpot_s == pytest.approx((m.e2e_s - m.ttft_s) / (m.num_output_tokens - 1))
    if m.kv_transfer_end_ns is not None:
        assert m.first_token_sampled_ns <= m.kv_transfer_end_ns <= m.decode_admitted_ns
        assert m.kv_transfer_bytes > 0


PROMPT_LENS = [(21, 4), (7, 1), (33, 6), (12, 3)]  # (prompt tokens, output tokens)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    cfg = tiny_hf_config()
    return write_hf_dir(str(tmp_path_factory.mktemp("tiny")), cfg, random_weights(cfg))


def _run(engine, out_dir: str) -> list[RequestMetrics]:
    for k, (n, out) in enumerate(PROMPT_LENS):
        engine.add_request([5 + (k + j) % 50 for j in range(n)],
                           SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), request_id=f"r{k}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.write_record(out_dir)
    return sorted(engine.finished_requests, key=lambda m: m.request_id)


def test_engine_and_simulator_make_the_same_record_from_the_same_plan(tiny_model, tmp_path):
    from phaselab.engine_args import EngineArgs
    from phaselab.serving_engine import make_engine
    from phaselab.sim.replay import replay

    # a budget of 16 tokens: prompts are chunked, decodes and chunks share iterations
    engine = make_engine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="2MiB",
                                    max_num_batched_tokens=16, enable_prefix_caching=False))
    real = _run(engine, str(tmp_path))
    r = replay(str(tmp_path))
    assert r.identical, r.describe()
    sim = sorted(r.result.requests, key=lambda m: m.request_id)
    assert [m.request_id for m in real] == [m.request_id for m in sim] == [f"r{k}" for k in range(4)]
    for a, b in zip(real, sim):
        assert stamped(a) == stamped(b), (a.request_id, stamped(a) ^ stamped(b))
        assert [(c.iteration_id, c.num_tokens) for c in a.prefill_chunks] == \
            [(c.iteration_id, c.num_tokens) for c in b.prefill_chunks]
        assert a.token_iteration_ids == b.token_iteration_ids
        assert (a.num_prompt_tokens, a.num_output_tokens, a.finish_reason, a.num_preemptions) == \
            (b.num_prompt_tokens, b.num_output_tokens, b.finish_reason, b.num_preemptions)
        assert sum(c.num_tokens for c in a.prefill_chunks) == a.num_prompt_tokens  # independent count
        check_durations(a)
        check_durations(b)


@pytest.mark.slow
def test_router_and_simulator_make_the_same_disaggregated_record(tiny_model, tmp_path):
    from phaselab.engine_args import EngineArgs
    from phaselab.obs.rundir import read_run_dir
    from phaselab.serving_engine import make_engine
    from phaselab.sim.loop import Simulator
    from phaselab.sim.replay import replay_inputs
    from phaselab.workload.arrivals import ArrivalPlan

    colocated = make_engine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="2MiB",
                                       enable_prefix_caching=False))
    _run(colocated, str(tmp_path / "colocated"))
    router = make_engine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="2MiB", mode="disagg",
                                    prefill_workers=1, decode_workers=1, prefill_threads=1, decode_threads=1,
                                    enable_prefix_caching=False))
    try:
        real = _run(router, str(tmp_path / "disagg"))
    finally:
        router.shutdown()
    deployment, requests, _, _ = replay_inputs(read_run_dir(str(tmp_path / "colocated")))
    rc = deployment.colocated
    disagg = dataclasses.replace(deployment, mode="disagg", prefill=rc, decode=rc)
    sim = sorted(Simulator(disagg, requests, ArrivalPlan(self_timed=True)).run().requests,
                 key=lambda m: m.request_id)
    assert [m.request_id for m in real] == [m.request_id for m in sim]
    for a, b in zip(real, sim):
        assert stamped(a) == stamped(b), (a.request_id, stamped(a) ^ stamped(b))
        assert (a.num_output_tokens, a.finish_reason, a.worker, a.decode_worker) == \
            (b.num_output_tokens, b.finish_reason, b.worker, b.decode_worker)
        # a request of one output token finishes on the prefill worker: no transfer, no decode worker
        assert (a.kv_transfer_end_ns is None) == (a.num_output_tokens == 1)
        check_durations(a)
        check_durations(b)
