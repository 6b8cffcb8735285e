"""The adaptive prefill budget (issue 17): property tests on the pure policy and on the scheduler.

Truth comes from outside core/adaptive_budget.py: an iteration's time is recounted query by query (each
prefill token at position p attends p + 1 keys, each decode its whole context), and the best
budget is found by trying every budget in turn instead of the bisection under test. The
"perfect cost model" runs price each plan the scheduler emits with the same coefficients the
scheduler planned with, as the simulator does with its own cost model.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from phaselab.core.adaptive_budget import BudgetDecision, choose_prefill_budget
from phaselab.cost.iteration_cost import IterationCostCoefficients
from phaselab.errors import ConfigError
from tests.test_scheduler import Harness

coefficients = st.builds(
    IterationCostCoefficients,
    overhead_s=st.floats(0, 0.05),
    prefill_token_s=st.floats(0, 1e-3),
    prefill_context_s=st.floats(0, 1e-5),
    decode_seq_s=st.floats(0, 5e-3),
    decode_context_s=st.floats(0, 1e-5),
    wide_s=st.floats(0, 0.05),
    wide_rows=st.sampled_from([0, 1, 4, 8, 16]),
)


def reference_time(c: IterationCostCoefficients, prefill: list[tuple[int, int]], decodes: list[int]) -> float:
    """Seconds of an iteration counted query by query: prefill = [(num_tokens, start)], decodes = contexts."""
    if not prefill and not decodes:
        return 0.0
    t = c.overhead_s
    for n, start in prefill:
        for i in range(n):
            t += c.prefill_token_s + c.prefill_context_s * (start + i + 1)
    for context in decodes:
        t += c.decode_seq_s + c.decode_context_s * context
    rows = sum(n for n, _ in prefill) + len(decodes)
    if c.wide_rows and rows > c.wide_rows:  # the batched GEMM's regime, counted row by row
        t += c.wide_s
    return t


def greedy(segments: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    chunks, left = [], budget
    for start, available in segments:
        n = min(available, left)
        if n > 0:
            chunks.append((n, start))
            left -= n
    return chunks


@settings(max_examples=400, deadline=None)
@given(coeffs=coefficients,
       decodes=st.lists(st.integers(1, 4000), max_size=40),
       segments=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 600)), max_size=5),
       target_ms=st.floats(1, 400), margin=st.sampled_from([0.0, 0.1, 0.3]),
       min_chunk=st.integers(1, 64), max_budget=st.integers(1, 1024))
def test_budget_bounds_and_optimality(coeffs, decodes, segments, target_ms, margin, min_chunk, max_budget):
    min_chunk = min(min_chunk, max_budget)
    d = choose_prefill_budget(coeffs, decodes, segments, target_ms / 1e3, margin, min_chunk, max_budget)
    room = max(0, max_budget - len(decodes))
    limit = target_ms / 1e3 * (1 - margin)
    assert d.prefill_budget <= max_budget and d.prefill_budget <= room  # never above the maximum
    pending = sum(n for _, n in segments)
    if not decodes or not pending:
        assert d.prefill_budget == room  # nothing to protect or nothing to chunk: the maximum
        return
    assert d.prefill_budget >= min(min_chunk, room)  # never below min_chunk while prefill waits
    time = reference_time(coeffs, greedy(segments, d.prefill_budget), decodes)
    assert d.predicted_s == pytest.approx(time, rel=1e-9, abs=1e-15)
    lo = min(min_chunk, room)
    feasible = reference_time(coeffs, greedy(segments, lo), decodes) <= limit * (1 + 1e-9)
    # (the reference sums token by token: its rounding differs from the closed form by ~1e-12 relative)
    assert d.feasible == feasible or abs(reference_time(coeffs, greedy(segments, lo), decodes) - limit) <= 1e-9 * limit
    if d.feasible:
        assert time <= limit * (1 + 1e-9)
        # the largest such budget: one more token placed (if any is left to place) misses the limit
        placed = sum(n for n, _ in greedy(segments, d.prefill_budget))
        if placed < min(pending, room):
            assert reference_time(coeffs, greedy(segments, placed + 1), decodes) >= limit * (1 - 1e-9)
    else:
        assert d.prefill_budget == lo and d.reason == "infeasible"


def test_no_decode_means_maximum_and_infeasible_is_reported():
    c = IterationCostCoefficients(overhead_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3)
    d = choose_prefill_budget(c, [], [(0, 5000)], 0.02, 0.0, 16, 2048)
    assert (d.prefill_budget, d.reason, d.feasible) == (2048, "no-decode", True)
    # 8 decodes: 0.01 + 0.008 = 18 ms, 2.05 ms left at 0.1 ms a token: 20 tokens
    d = choose_prefill_budget(c, [10] * 8, [(0, 5000)], 0.02005, 0.0, 16, 2048)
    assert (d.prefill_budget, d.reason) == (20, "target")
    # 15 decodes alone take 25 ms > 20 ms: min_chunk, marked infeasible
    d = choose_prefill_budget(c, [10] * 15, [(0, 5000)], 0.02, 0.0, 16, 2048)
    assert (d.prefill_budget, d.reason, d.feasible) == (16, "infeasible", False)
    with pytest.raises(ConfigError, match="must be finite and >= 0"):
        IterationCostCoefficients(prefill_token_s=-1.0)


@st.composite
def slo_runs(draw: st.DrawFn, small_cache: bool):
    budget = draw(st.integers(4, 96))
    block_size = draw(st.sampled_from([1, 4, 8]))
    capacity = draw(st.integers(90, 200)) if small_cache else 4096  # tokens; a prompt has at most 84
    config = dict(budget=budget, block_size=block_size, num_blocks=-(-capacity // block_size),
                  max_num_seqs=draw(st.integers(2, 8)), max_model_len=160,
                  enable_prefix_caching=draw(st.booleans()),
                  long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5, 16])))
    config["max_num_partial_prefills"] = config["max_num_seqs"]  # the budget, not this limit, caps prefill
    target_ms = draw(st.floats(1, 60))
    slo = dict(slo_tbt_ms=target_ms, slo_margin=draw(st.sampled_from([0.0, 0.1])),
               slo_min_chunk=draw(st.integers(1, max(1, budget // 4))))
    # coefficients on the target's scale, so that the budget often lands strictly inside its range
    t = target_ms / 1e3
    coeffs = IterationCostCoefficients(
        overhead_s=draw(st.floats(0, 0.6)) * t, prefill_token_s=draw(st.floats(0, 4)) * t / budget,
        prefill_context_s=draw(st.floats(0, 1)) * t / (budget * 64), decode_seq_s=draw(st.floats(0, 0.2)) * t,
        decode_context_s=draw(st.floats(0, 1)) * t / 1000, wide_s=draw(st.floats(0, 0.5)) * t,
        wide_rows=draw(st.sampled_from([0, 4, 8])))
    prefixes = [[1, 2, 3, 4] * 6, [5, 6, 7] * 5]
    requests = []
    for _ in range(draw(st.integers(2, 10))):
        p = draw(st.sampled_from(prefixes))[: draw(st.integers(0, 24))] + draw(st.lists(st.integers(1, 9), max_size=60))
        requests.append((draw(st.integers(0, 30)), p or [1], draw(st.integers(4, 48))))
    return config, slo, coeffs, requests


def _drive(config, slo, coeffs, requests):
    h = Harness(**config)
    cfg = h.sched.scheduler_config
    from dataclasses import replace
    h.sched.scheduler_config = replace(cfg, **slo)
    h.sched.set_cost_coefficients(coeffs)
    limit = slo["slo_tbt_ms"] / 1e3 * (1 - slo["slo_margin"])
    step = 0
    while step < 2000:
        for i, (arrival, p, max_tokens) in enumerate(requests):
            if arrival == step:
                h.add(str(i), p, max_tokens=max_tokens, ignore_eos=True)
        if step > max(a for a, _, _ in requests) and not h.sched.has_unfinished_requests():
            return
        sched = h.sched
        decoding = {r.request_id for r in sched.running if not r.is_prefill}
        plan, _ = h.step()
        step += 1
        if plan.is_empty:
            continue
        d = plan.budget
        assert isinstance(d, BudgetDecision)
        event(f"decision: {d.reason}")
        if plan.preempted_request_ids:
            event("a plan preempted")
        scheduled = {s.request_id for s in plan.scheduled}
        # decodes are never left out (only a preemption, for blocks, takes one out)
        assert decoding <= scheduled | set(plan.preempted_request_ids)
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert d.prefill_budget <= cfg.max_num_batched_tokens
        assert plan.num_prefill_tokens <= d.prefill_budget
        decodes = [s.context_len for s in plan.scheduled if not s.is_prefill]
        chunks = [(s.num_tokens, s.start_position) for s in plan.scheduled if s.is_prefill]
        if decoding and d.reason != "no-prefill":
            assert d.prefill_budget >= min(slo["slo_min_chunk"], cfg.max_num_batched_tokens - len(decoding))
        if decodes and d.feasible and not plan.preempted_request_ids:
            # perfect cost model: the plan's time, recounted, holds the target
            assert reference_time(coeffs, chunks, decodes) <= limit * (1 + 1e-9) + 1e-15, (d, decoding, plan)
    raise AssertionError("not finished after 2000 steps")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=slo_runs(small_cache=False))
def test_scheduler_holds_target_with_perfect_cost_model(run):
    _drive(*run)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=slo_runs(small_cache=True))
def test_scheduler_budget_bounds_with_preemption(run):
    _drive(*run)


def test_config_errors_say_what_to_do():
    from phaselab.core.config import SchedulerConfig
    with pytest.raises(ConfigError, match="use --policy chunked"):
        SchedulerConfig(policy="prefill-first", max_num_batched_tokens=8192, slo_tbt_ms=50)
    with pytest.raises(ConfigError, match="lower --slo-min-chunk"):
        SchedulerConfig(max_num_batched_tokens=16, slo_tbt_ms=50, slo_min_chunk=32)
    assert SchedulerConfig(max_num_batched_tokens=16).slo_min_chunk == 32  # only checked when adaptive
