"""The adaptive budget in the simulator (issue 17): the same scheduler and the same online fitter,
learning from the cost model's times instead of measured ones.

With a perfect cost model (the simulator's times come from fixed coefficients of the very form the
fitter learns) the fitter recovers those coefficients from the warm-up alone, and no iteration
carrying decodes exceeds the target when the policy found it feasible: the acceptance property,
end to end. With the roofline model (not of that form) it is an approximation that keeps learning.
"""

from __future__ import annotations

import dataclasses

import pytest

from phaselab.workload.interference import InterferenceParams
from phaselab.cost.iteration_cost import IterationCostCoefficients, plan_features
from phaselab.cost.catalog import get_hardware, get_model
from phaselab.cost.pricing import IterationCost
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.core.scheduler import Scheduler
from phaselab.sim.loop import simulate
from phaselab.sim.sim_worker import CostModelExecutor, warm_up_learner
from phaselab.sim.workload import interference_requests, random_requests

H100 = get_hardware("h100")
LLAMA8 = get_model("llama-3-8b")
TRUTH = IterationCostCoefficients(overhead_s=4e-3, prefill_token_s=5e-5, prefill_context_s=2e-9,
                                  decode_seq_s=2e-4, decode_context_s=1e-8)


class LinearCostModel:
    """Times of exactly the fitter's form, from TRUTH."""

    def predict(self, plan):  # type: ignore[no-untyped-def]
        return IterationCost(max(1, round(TRUTH.predict_features(plan_features(plan.scheduled)) * 1e9)))


def _interference():
    return interference_requests(InterferenceParams(num_streams=8, stream_input_len=256, stream_output_len=200,
                                                    num_long_prompts=3, long_input_len=6000, long_output_len=8,
                                                    long_start_s=0.3, long_interval_s=0.6))


@pytest.mark.parametrize("target_ms", [12.0, 20.0])
def test_perfect_cost_model_holds_the_target(target_ms):
    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, slo_tbt_ms=target_ms,
                                                      slo_min_chunk=16))
    result = simulate(d, _interference(), cost_model_factory=lambda *_: LinearCostModel(), check_invariants=True)
    with_decodes = [r for r in result.iterations if r.num_decode_tokens]
    mixed = [r for r in with_decodes if r.num_prefill_tokens]
    assert mixed and any(r.budget_reason == "target" for r in mixed)  # the target actually bound
    for r in with_decodes:
        if r.slo_feasible:
            assert r.duration_s <= target_ms / 1e3
        # forgetting fades what long decode-only stretches do not re-teach: the prefill terms drift
        # towards the prior by a fraction of a percent (the margin covers it)
        assert r.predicted_ns == pytest.approx(r.end_ns - r.start_ns, rel=1e-2)
    # a fixed budget that large breaks the target while the long prompts prefill
    fixed = simulate(dataclasses.replace(d, colocated=RoleConfig(max_num_batched_tokens=4096)), _interference(),
                     cost_model_factory=lambda *_: LinearCostModel())
    assert max(r.duration_s for r in fixed.iterations if r.num_decode_tokens) > target_ms / 1e3


def test_warm_up_recovers_a_perfect_cost_model():
    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, slo_tbt_ms=20.0))
    sched = Scheduler(d.scheduler_config(d.colocated), d.cache_config(d.colocated))
    learner = warm_up_learner(sched, CostModelExecutor(LinearCostModel(), {}))
    assert learner.coefficients.to_json() == pytest.approx(TRUTH.to_json(), rel=1e-4)
    assert sched.cost_coefficients == learner.coefficients


def test_unreachable_target_is_reported_not_hidden():
    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=2048, slo_tbt_ms=1.0, slo_min_chunk=64))
    result = simulate(d, _interference(), cost_model_factory=lambda *_: LinearCostModel())
    mixed = [r for r in result.iterations if r.num_decode_tokens and r.num_prefill_tokens]
    assert mixed and all(r.slo_feasible is False and r.prefill_budget == 64 for r in mixed)
    assert all(r.num_prefill_tokens <= 64 for r in mixed)  # prefill still moves, by min_chunk


def test_roofline_model_learns_online():
    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, slo_tbt_ms=30.0))
    result = simulate(d, random_requests(60, "uniform:64:4000", "uniform:16:256", seed=3), check_invariants=True)
    recs = [r for r in result.iterations if r.predicted_ns]
    assert result.config["slo"]["replica-0"]["cost_model"]["num_updates"] >= len(recs)
    # the fit approximates a model of another form: its error stays a fraction of the time
    errors = sorted(abs(r.predicted_ns - (r.end_ns - r.start_ns)) / (r.end_ns - r.start_ns) for r in recs)
    assert errors[len(errors) // 2] < 0.2


def test_trace_shows_the_budget_over_time():
    from phaselab.obs.perfetto import build_trace, validate_trace

    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, slo_tbt_ms=12.0, slo_min_chunk=16))
    result = simulate(d, _interference(), cost_model_factory=lambda *_: LinearCostModel())
    trace = build_trace(result.requests, result.iterations)
    assert validate_trace(trace) == []
    budget = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "prefill budget (tokens)"]
    assert [e["args"]["budget"] for e in budget] == [r.prefill_budget for r in result.iterations]
    times = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"].startswith("iteration time vs")]
    assert all(e["args"]["target"] == 12.0 for e in times)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "iteration"]
    assert all("prefill_budget" in e["args"] and "predicted_ms" in e["args"] for e in slices)


class SpikyCostModel(LinearCostModel):
    """The perfect model, except that every 37th iteration takes three times as long (another
    process took the machine): the misses the diagnosis must attribute to the prediction."""

    def predict(self, plan):  # type: ignore[no-untyped-def]
        cost = super().predict(plan)
        if plan.iteration_id % 37 == 0:
            cost = IterationCost(cost.duration_ns * 3)
        return cost


def test_diagnose_judges_the_adaptive_policy(tmp_path):
    from phaselab.analysis.diagnose import diagnose
    from phaselab.analysis.doc import render_text

    target = 12e-3
    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, max_num_seqs=64,
                                                      slo_tbt_ms=target * 1e3, slo_min_chunk=16))
    reqs = _interference() + random_requests(40, "uniform:200:3000", "uniform:50:300", seed=5)
    result = simulate(d, reqs, cost_model_factory=lambda *_: SpikyCostModel())
    result.write(str(tmp_path / "run"))
    j = diagnose(tmp_path / "run").slo
    assert j is not None and j.target_s == pytest.approx(target)
    decode_iters = [r for r in result.iterations if r.num_decode_tokens]
    over = {r.iteration_id for r in decode_iters if r.duration_s > target}
    assert j.num_decode_iterations == len(decode_iters) and j.num_held == len(decode_iters) - len(over)
    assert {m.iteration_id for m in j.misses} == over
    under = {m.iteration_id for m in j.misses if m.cause == "under-predicted"}
    assert under and all(i % 37 == 0 for i in under)  # exactly the injected slow iterations
    infeasible = {r.iteration_id for r in decode_iters if r.slo_feasible is False and r.duration_s > target}
    assert {m.iteration_id for m in j.misses if m.cause == "infeasible"} == infeasible
    text = render_text(diagnose(tmp_path / "run").to_doc())
    assert "The TBT target (adaptive budget)" in text and "under-predicted" in text


def test_timeline_carries_the_budget_and_the_target(tmp_path):
    from phaselab.analysis.timeline import load_timeline, render_png, render_timeline_page

    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, slo_tbt_ms=12.0, slo_min_chunk=16))
    simulate(d, _interference(), cost_model_factory=lambda *_: SpikyCostModel()).write(str(tmp_path / "run"))
    t = load_timeline(tmp_path / "run")
    assert t["slo_tbt_s"] == 0.012 and t["max_budget"] == 4096
    assert "adaptive budget, TBT target 12 ms" in t["title"]
    iters = t["workers"][0]["iters"]
    assert all(it[6] is not None and it[7] is not None for it in iters)
    assert any(it[3] and it[1] - it[0] > 0.012 for it in iters)  # the injected slow iterations, outlined
    assert render_png([t], tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert '"slo_tbt_s":0.012' in render_timeline_page([t]).replace(' ', '')


class LoadedWarmUpCostModel(LinearCostModel):
    """The perfect model, except that the warm-up (its synthetic plans carry negative iteration
    ids) ran while another process held the machine: twice as slow as serving. The fit starts
    100% too high and keeps a quarter of the warm-up without decay (the anchor)."""

    def predict(self, plan):  # type: ignore[no-untyped-def]
        cost = super().predict(plan)
        return IterationCost(cost.duration_ns * 2) if plan.iteration_id < 0 else cost


def test_planning_corrects_a_fit_biased_by_a_loaded_warm_up():
    """The budget is planned with the fit scaled by the recent median of measured / predicted: a fit
    left too high by a loaded warm-up would hold prefill to a fraction of what fits; the scaled
    plan fills the iterations up to the limit and still holds the target (truth: the cost model's
    own times, which the fitter only sees through the iterations)."""
    target = 12e-3
    d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=4096, slo_tbt_ms=target * 1e3,
                                                      slo_min_chunk=16))
    result = simulate(d, _interference(), cost_model_factory=lambda *_: LoadedWarmUpCostModel())
    bound = [r for r in result.iterations if r.num_decode_tokens and r.budget_reason == "target"]
    assert len(bound) >= 20
    late = bound[len(bound) // 4:]  # once the error window has filled
    # the fit itself still over-predicts (the anchor keeps part of the warm-up) ...
    assert sorted(r.predicted_ns / (r.end_ns - r.start_ns) for r in late)[len(late) // 2] > 1.05
    # ... but the plan uses the time: the median bound iteration reaches the limit (0.92 of it with
    # the fit alone). A median plans to the typical iteration: the margin keeps most under T (here
    # 13% pass it, while the fit still moves), none by more than the benchmark's +15%
    limit = target * (1 - d.colocated.slo_margin)
    assert sorted(r.duration_s for r in late)[len(late) // 2] > 0.95 * limit
    with_decodes = [r.duration_s for r in result.iterations if r.num_decode_tokens]
    assert sum(t > target for t in with_decodes) <= 0.15 * len(with_decodes)
    assert max(with_decodes) <= 1.15 * target


def test_the_simulator_orders_prefills_by_the_ttft_target():
    """The simulator hands the scheduler its clock: with a TTFT target the short prompts that arrive
    during a long prompt's chunks are prefilled before its last chunk (they waited for all of them
    in FCFS order), and the long prompt still starts at once and finishes."""
    from phaselab.sim.workload import SimRequest

    reqs = [SimRequest("long", 6000, 4, arrival_s=0.0)]
    reqs += [SimRequest(f"short-{k}", 200, 4, arrival_s=0.005 + 0.005 * k, index=k + 1) for k in range(8)]

    def run(ttft_ms: float):
        d = Deployment(LLAMA8, H100, colocated=RoleConfig(max_num_batched_tokens=1024, slo_ttft_ms=ttft_ms))
        return {m.request_id: m for m in simulate(d, [dataclasses.replace(r) for r in reqs],
                                                  check_invariants=True).requests}

    fcfs, ordered = run(0.0), run(60_000.0)
    long_first = {k: v["long"].first_token_sampled_ns for k, v in (("fcfs", fcfs), ("ordered", ordered))}
    for k in range(8):
        rid = f"short-{k}"
        assert fcfs[rid].first_token_sampled_ns > long_first["fcfs"]  # behind every chunk of the long prompt
        assert ordered[rid].first_token_sampled_ns < long_first["ordered"]  # passed it
        # simulated seconds (the cost model's clock, deterministic), not the wall clock
        assert ordered[rid].ttft_s < fcfs[rid].ttft_s / 2
    assert ordered["long"].num_output_tokens == fcfs["long"].num_output_tokens == 4
