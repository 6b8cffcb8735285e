"""The SLO-aware prefill budget: how many prefill tokens an iteration may carry so that its
predicted duration stays under a time-between-tokens (TBT) target.

    coefficients (plain data, fitted by the engine: core/online_cost.py)
        time(plan) = overhead
                   + prefill_token  x  prefill tokens
                   + prefill_context x  sum over chunks of the keys its queries attend
                                        (n s + n (n + 1) / 2 for n tokens after a prefix of s:
                                        the attention re-read of the prefix a chunk pays)
                   + decode_seq      x  decodes
                   + decode_context  x  sum over decodes of their context (s + 1 keys each)
                   + wide            x  [rows > wide_rows]   (rows = prefill tokens + decodes)

      `wide_rows` is data, not fitted: the engine's max_native_rows. Up to it every linear layer
      runs the one-row-at-a-time kernel, above it the batched GEMM, whose iteration costs a fixed
      amount more (the weights widened for it, the GEMM's own set-up) and each row less; without
      the term the fit splits the difference, and the decode-only iterations (native, batch 4:
      28 ms) taught it an intercept 10 ms under that of the mixed ones it plans (measured 1.16x
      the prediction at p50, 1.41x at p90, on the interference workload at a 133 ms target)

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phaselab.errors import ConfigError

if TYPE_CHECKING:  # outputs imports this module (SchedulerOutput carries a BudgetDecision)
    from phaselab.core.outputs import ScheduledRequest, SchedulerOutput

COEFFICIENT_NAMES = ("overhead_s", "prefill_token_s", "prefill_context_s", "decode_seq_s", "decode_context_s",
                     "wide_s")


def chunk_keys(num_tokens: int, start: int) -> int:
    """Keys the queries of a chunk of `num_tokens` after `start` cached tokens attend (causal)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class IterationCostCoefficients:
    """The online cost model of one iteration (module docstring). All in seconds per unit, all >= 0."""

    overhead_s: float = 0.0  # per iteration (schedule, launch, sampling set-up)
    prefill_token_s: float = 0.0  # per prefill token (weights' GEMMs, K/V write)
    prefill_context_s: float = 0.0  # per (prefill query x key attended): the re-read of the prefix
    decode_seq_s: float = 0.0  # per decode in the iteration
    decode_context_s: float = 0.0  # per key a decode attends (its K/V read)
    wide_s: float = 0.0  # per iteration of more than wide_rows rows (the batched GEMM's regime)
    wide_rows: int = 0  # data, not fitted: the engine's max_native_rows (0: one regime)

    def __post_init__(self) -> None:
        if self.wide_rows < 0:
            raise ConfigError(f"wide_rows={self.wide_rows} must be >= 0")
        for name in COEFFICIENT_NAMES:
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ConfigError(f"cost coefficient {name}={value!r} must be finite and >= 0; "
                                  "fit it again or give a calibration file with non-negative terms")

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, n) for n in COEFFICIENT_NAMES)

    @classmethod
    def from_tuple(cls, values: Iterable[float], wide_rows: int = 0) -> IterationCostCoefficients:
        """From the coefficients in COEFFICIENT_NAMES order (as_tuple), and the threshold."""
        v = list(values)
        if len(v) != len(COEFFICIENT_NAMES):
            raise ConfigError(f"{len(v)} cost coefficients given; want {len(COEFFICIENT_NAMES)}: {COEFFICIENT_NAMES}")
        return cls(overhead_s=v[0], prefill_token_s=v[1], prefill_context_s=v[2], decode_seq_s=v[3],
                   decode_context_s=v[4], wide_s=v[5], wide_rows=wide_rows)

    def to_json(self) -> dict[str, float]:
        return {**{n: getattr(self, n) for n in COEFFICIENT_NAMES}, "wide_rows": self.wide_rows}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IterationCostCoefficients:
        unknown = set(d) - set(COEFFICIENT_NAMES) - {"wide_rows"}
        if unknown:
            raise ConfigError(f"unknown cost coefficient(s) {sorted(unknown)}; known: {list(COEFFICIENT_NAMES)}")
        return cls(**{k: float(v) for k, v in d.items() if k != "wide_rows"}, wide_rows=int(d.get("wide_rows", 0)))

    def predict_features(self, features: Sequence[float]) -> float:
        return sum(c * x for c, x in zip(self.as_tuple(), features, strict=True))

    def predict(self, prefill_chunks: Iterable[tuple[int, int]], decode_contexts: Iterable[int]) -> float:
        """Seconds for an iteration of prefill chunks (num_tokens, start) and decodes (context keys)."""
        return self.predict_features(iteration_features(prefill_chunks, decode_contexts, self.wide_rows))


def iteration_features(prefill_chunks: Iterable[tuple[int, int]], decode_contexts: Iterable[int],
                       wide_rows: int = 0) -> tuple[float, ...]:
    """The regressors of the cost model: (1, prefill tokens, prefill keys, decodes, decode keys,
    [rows > wide_rows]); all zero for an empty iteration (it costs nothing: nothing runs)."""
    p_tokens = p_keys = 0
    for n, start in prefill_chunks:
        p_tokens += n
        p_keys += chunk_keys(n, start)
    contexts = list(decode_contexts)
    if not p_tokens and not contexts:
        return (0.0,) * len(COEFFICIENT_NAMES)
    wide = 1.0 if wide_rows and p_tokens + len(contexts) > wide_rows else 0.0
    return (1.0, float(p_tokens), float(p_keys), float(len(contexts)), float(sum(contexts)), wide)


def plan_features(scheduled: Iterable[ScheduledRequest], wide_rows: int = 0) -> tuple[float, ...]:
    """iteration_features of a SchedulerOutput's entries (core.outputs.ScheduledRequest)."""
    chunks, decodes = [], []
    for s in scheduled:
        if s.is_prefill:
            chunks.append((len(s.token_ids), s.start_position))
        else:
            decodes.append(s.start_position + len(s.token_ids))
    return iteration_features(chunks, decodes, wide_rows)


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


def prefill_cost(coeffs: IterationCostCoefficients, segments: Sequence[tuple[int, int]], budget: int
                 ) -> tuple[float, int]:
    """(prefill_token + prefill_context terms, tokens placed) of `budget` tokens handed out greedily
    over `segments` = [(start, tokens available)] in the scheduler's order."""
    left, tokens, keys = budget, 0, 0
    for start, available in segments:
        if left <= 0:
            break
        n = min(available, left)
        if n <= 0:
            continue
        tokens += n
        keys += chunk_keys(n, start)
        left -= n
    return coeffs.prefill_token_s * tokens + coeffs.prefill_context_s * keys, tokens


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


def chunk_cost(coeffs: IterationCostCoefficients, num_tokens: int, start: int) -> float:
    """The prefill terms of one chunk of `num_tokens` after `start` cached tokens."""
    return coeffs.prefill_token_s * num_tokens + coeffs.prefill_context_s * chunk_keys(num_tokens, start)


def largest_chunk_within(coeffs: IterationCostCoefficients, start: int, max_tokens: int, seconds: float) -> int:
    """The most tokens (<= max_tokens) a chunk after `start` cached tokens may carry for its
    prefill terms to cost at most `seconds` (0 when not even one token fits)."""
    if max_tokens <= 0 or chunk_cost(coeffs, 1, start) > seconds:
        return 0
    good, bad = 1, max_tokens + 1
    if chunk_cost(coeffs, max_tokens, start) <= seconds:
        return max_tokens
    while bad - good > 1:
        mid = (good + bad) // 2
        if chunk_cost(coeffs, mid, start) <= seconds:
            good = mid
        else:
            bad = mid
    return good


def budget_fields(plan: SchedulerOutput, predicted_s: float | None) -> dict[str, Any]:
    """The IterationRecord fields of the adaptive budget for one executed plan (empty when the
    budget is fixed): one place for the engine, the simulator and the router to stamp them."""
    d = plan.budget
    if d is None:
        return {}
    return {"prefill_budget": d.prefill_budget, "budget_reason": d.reason, "slo_tbt_s": d.target_s,
            "slo_feasible": d.feasible,
            "predicted_ns": None if predicted_s is None else round(predicted_s * 1e9)}
