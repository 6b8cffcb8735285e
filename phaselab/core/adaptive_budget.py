"""The SLO-aware prefill budget: how many prefill tokens an iteration may carry so that its
predicted duration stays under a time-between-tokens (TBT) target.

    coefficients (plain data, cost/iteration_cost.py; fitted by the engine: cost/online_fit.py)

    choose_prefill_budget(coefficients, decodes in the iteration, pending prefill segments,
                          target, margin, min_chunk, max_num_batched_tokens)
        no decode running            -> the maximum: nothing to protect, no reason to chunk
        else the largest budget P in [min_chunk, max - decodes] whose predicted time, with the
             decodes and P prefill tokens handed out as the scheduler hands them (partial prefills
             in running order, then waiting requests in FCFS order, each capped as a chunk is)
             stays under target x (1 - margin)
        even min_chunk misses it     -> min_chunk (prefill must progress), marked infeasible:
                                        an SLO this hardware cannot hold is reported, not hidden

Everything here is pure Python over numbers: the scheduler calls it with its counters, the
simulator drives the same scheduler, and the engine (which owns the clock) feeds the measured
iteration times to the online fitter whose coefficients come back here as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phaselab.cost.iteration_cost import IterationCostCoefficients, prefill_cost

if TYPE_CHECKING:  # outputs imports this module (SchedulerOutput carries a BudgetDecision)
    from phaselab.core.outputs import SchedulerOutput

@dataclass(frozen=True)
class BudgetDecision:
    """What the adaptive policy chose for one iteration, and why (carried by the plan and the record)."""

    prefill_budget: int  # prefill tokens allowed in this iteration
    target_s: float  # the TBT target
    limit_s: float  # target x (1 - margin): what the prediction must stay under
    predicted_s: float  # predicted duration: the decodes + the budget's prefill as the scheduler hands it out
    feasible: bool  # False: even min_chunk (or the decodes alone) is predicted over the limit
    reason: str  # "no-decode" | "no-prefill" | "all-prefill-fits" | "target" | "infeasible"

    def to_json(self) -> dict[str, Any]:
        return {"prefill_budget": self.prefill_budget, "target_s": self.target_s, "limit_s": self.limit_s,
                "predicted_s": self.predicted_s, "feasible": self.feasible, "reason": self.reason}


def choose_prefill_budget(
    coeffs: IterationCostCoefficients,
    decode_contexts: Sequence[int],
    segments: Sequence[tuple[int, int]],
    target_s: float,
    margin: float,
    min_chunk: int,
    max_num_batched_tokens: int,
) -> BudgetDecision:
    """The largest prefill budget whose predicted iteration stays under target x (1 - margin)
    (module docstring). `decode_contexts`: keys each decode of the iteration attends;
    `segments`: (start, tokens available) of each pending prefill in scheduling order."""
    num_decodes = len(decode_contexts)
    room = max(0, max_num_batched_tokens - num_decodes)  # the decodes are served first
    limit = target_s * (1.0 - margin)
    decode_s = coeffs.decode_seq_s * num_decodes + coeffs.decode_context_s * sum(decode_contexts)
    wide_rows = coeffs.wide_rows

    def wide(rows: int) -> float:  # the batched GEMM's regime above wide_rows rows
        return coeffs.wide_s if wide_rows and rows > wide_rows else 0.0

    base = coeffs.overhead_s + decode_s + wide(num_decodes) if num_decodes else 0.0
    pending = sum(max(0, a) for _, a in segments)

    def predicted(budget: int) -> float:
        p, placed = prefill_cost(coeffs, segments, budget)
        if placed == 0:
            return base
        return coeffs.overhead_s + decode_s + p + wide(num_decodes + placed)

    if pending == 0:
        return BudgetDecision(room, target_s, limit, base, base <= limit, "no-prefill")
    if num_decodes == 0:
        return BudgetDecision(room, target_s, limit, predicted(room), True, "no-decode")
    lo = min(min_chunk, room)
    if predicted(lo) > limit:
        return BudgetDecision(lo, target_s, limit, predicted(lo), False, "infeasible")
    useful = min(room, pending)  # beyond what is pending the prediction is flat
    if predicted(useful) <= limit:
        return BudgetDecision(room, target_s, limit, predicted(room), True, "all-prefill-fits")
    good, bad = lo, useful  # predicted(good) <= limit < predicted(bad); the cost grows with the budget
    while bad - good > 1:
        mid = (good + bad) // 2
        if predicted(mid) <= limit:
            good = mid
        else:
            bad = mid
    return BudgetDecision(good, target_s, limit, predicted(good), True, "target")


# A request that has waited this fraction of its TTFT target is served in arrival order, ahead of
# every request that has not: shorter prompts may pass it only while it keeps at least half its
# target for its own prefill (prefill_rank).
TTFT_URGENT_FRACTION = 0.5


def prefill_rank(arrival_s: float, remaining_tokens: int, now_s: float, ttft_s: float,
                 resume_position: int | None = None) -> tuple[int, float, float]:
    """Where a request's prefill goes in the order the scheduler hands out prefill tokens, when a
    TTFT target is set (smaller first):

        resuming after a preemption   (0, its place at the queue's front)     it was admitted before
        waited >= TTFT_URGENT_FRACTION x target
                                      (1, arrival)                           first come, first served
        otherwise                     (2, remaining prefill tokens, arrival) shortest first

    Shortest-remaining-first minimises the mean time to first token (a short prompt no longer
    waits behind a long one's chunks); the urgent class bounds what that costs a long prompt: once
    it has waited half its target nobody new passes it, so no request starves and each keeps half
    its target for its own prefill. With one target for every request the urgent class is the
    FCFS order of earliest-deadline-first."""
    if resume_position is not None:
        return (0, float(resume_position), 0.0)
    if now_s - arrival_s >= TTFT_URGENT_FRACTION * ttft_s:
        return (1, arrival_s, 0.0)
    return (2, float(remaining_tokens), arrival_s)


def budget_fields(plan: SchedulerOutput, predicted_s: float | None) -> dict[str, Any]:
    """The IterationRecord fields of the adaptive budget for one executed plan (empty when the
    budget is fixed): one place for the engine, the simulator and the router to stamp them."""
    d = plan.budget
    if d is None:
        return {}
    return {"prefill_budget": d.prefill_budget, "budget_reason": d.reason, "slo_tbt_s": d.target_s,
            "slo_feasible": d.feasible,
            "predicted_ns": None if predicted_s is None else round(predicted_s * 1e9)}
