"""The TTFT order (SchedulerConfig.slo_ttft_ms, core/adaptive_budget.py's prefill_rank): measured on the
scheduler with the fake executor of test_scheduler (one step = one second of its clock), each
against the same arrivals served FCFS."""

from __future__ import annotations

from phaselab.core.adaptive_budget import TTFT_URGENT_FRACTION
from tests.test_scheduler import Harness

LONG = list(range(1, 41))  # 40 tokens: three chunks of 16
SHORT = [7, 8, 9, 10, 11, 12]


def first_token_step(h: Harness, rid: str) -> int:
    return next(k for k, plan in enumerate(h.plans) for s in plan.scheduled if s.request_id == rid and s.sample)


def long_then_short(ttft_ms: float) -> Harness:
    """A long prompt starts its chunks; a short one arrives one step later."""
    h = Harness(budget=16, slo_ttft_ms=ttft_ms)
    h.add("long", LONG, max_tokens=4)
    h.step()
    h.add("short", SHORT, max_tokens=4)
    h.run()
    return h


def test_a_short_prompt_passes_a_long_ones_chunks() -> None:
    fcfs, ordered = long_then_short(0.0), long_then_short(100_000.0)
    # FCFS: the short prompt waits until the long one's last chunk (step 2) leaves it room
    assert first_token_step(fcfs, "long") == first_token_step(fcfs, "short") == 2
    assert [s.request_id for s in fcfs.plans[1].scheduled] == ["long"]
    # ordered: it prefills in the step it arrived in, the long prompt's chunk taking what is left
    assert first_token_step(ordered, "short") == 1
    step1 = {s.request_id: s.num_tokens for s in ordered.plans[1].scheduled}
    assert step1 == {"short": len(SHORT), "long": 16 - len(SHORT)}
    # same outputs, every block back
    for h in (fcfs, ordered):
        assert h.outputs["long"] == h.expected("long") and h.outputs["short"] == h.expected("short")
        h.assert_all_blocks_free()


def test_waiting_queue_shortest_first_then_fcfs() -> None:
    """Three prompts queued behind a busy seat: shortest first with a target, arrival order without."""
    orders = {}
    for ttft_ms in (0.0, 100_000.0):
        h = Harness(budget=64, max_num_seqs=1, slo_ttft_ms=ttft_ms)
        h.add("busy", [1, 2], max_tokens=6)
        h.step()
        for rid, n in (("a", 30), ("b", 5), ("c", 12)):
            h.add(rid, list(range(1, n + 1)), max_tokens=2)
        h.run()
        orders[ttft_ms] = sorted("abc", key=lambda r: first_token_step(h, r))
    assert orders[0.0] == ["a", "b", "c"]
    assert orders[100_000.0] == ["b", "c", "a"]


def test_a_long_prompt_is_not_starved_by_short_ones() -> None:
    """A short prompt arrives every step, each enough to fill the budget: with the order, the long
    prompt is passed only until it has waited half its target, then served first; it starts by then."""
    ttft_steps = 10
    h = Harness(budget=8, max_num_seqs=64, num_blocks=4096, max_model_len=128, enable_prefix_caching=False,
                slo_ttft_ms=ttft_steps * 1000.0)
    h.add("short-0", [5] * 8, max_tokens=1)
    h.step()
    h.add("long", list(range(1, 41)), max_tokens=2)
    for k in range(1, 40):
        h.add(f"short-{k}", [5] * 7 + [k % 4 + 1], max_tokens=1)
        h.step()
    h.run()
    first_chunk = next(k for k, plan in enumerate(h.plans) for s in plan.scheduled if s.request_id == "long")
    assert first_chunk > 1, "shorter prompts went first while the long one had time"
    assert first_chunk <= 1 + TTFT_URGENT_FRACTION * ttft_steps, first_chunk
    assert h.outputs["long"] == h.expected("long")
    h.assert_all_blocks_free()


def test_without_the_clock_the_order_is_fcfs() -> None:
    """A caller that passes no `now` (an old one) gets FCFS even with a target set."""
    h = Harness(budget=16, slo_ttft_ms=100_000.0)
    h.add("long", LONG, max_tokens=2)
    h.sched.update(plan := h.sched.schedule(), h.execute(plan))
    h.add("short", SHORT, max_tokens=2)
    plan = h.sched.schedule()
    assert [s.request_id for s in plan.scheduled] == ["long"]


def test_prefills_yielding_to_a_head_that_does_not_fit_still_get_blocks() -> None:
    """Hypothesis found this deadlock (test_scheduler_properties): a 17-token and a 10-token prompt
    mid-prefill hold all three 8-token blocks, each needs one more, and a preempted 10-token prompt
    heads the waiting queue. Both running prefills yield to it, it cannot be admitted, and they used
    to wait for a block that nobody freed: empty plans forever. Now, with nothing else scheduled, the
    most recently admitted one is preempted, and every request finishes with the output it has alone."""
    h = Harness(block_size=8, num_blocks=3, budget=3, max_num_seqs=3, max_model_len=18, enable_prefix_caching=False,
                long_prefill_token_threshold=1, max_num_partial_prefills=3, slo_ttft_ms=2000.0)
    h.add("r0", [1] * 17)
    h.step()
    h.add("r1", [1] * 10)
    h.add("r2", [1] * 10)
    h.run(max_steps=200)
    assert not any(not plan.scheduled and not plan.preempted_request_ids for plan in h.plans), "an idle iteration"
    assert h.sched.num_preemptions_total >= 2  # r2 when r0 and r1 grew, then one of these for r0
    for rid in ("r0", "r1", "r2"):
        assert h.outputs[rid] == h.expected(rid)
    h.assert_all_blocks_free()
