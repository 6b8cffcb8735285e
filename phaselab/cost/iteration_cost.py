"""The online cost model of one iteration: six coefficients over the plan's shape, what the
SLO-aware prefill budget (core/adaptive_budget.py) predicts with and the online fitter
(cost/online_fit.py) learns.

    time(plan) = overhead
               + prefill_token   x  prefill tokens
               + prefill_context x  sum over chunks of the keys its queries attend
                                    (n s + n (n + 1) / 2 for n tokens after a prefix of s:
                                    the attention re-read of the prefix a chunk pays)
               + decode_seq      x  decodes
               + decode_context  x  sum over decodes of their context (s + 1 keys each)
               + wide            x  [rows > wide_rows]   (rows = prefill tokens + decodes)

`wide_rows` is data, not fitted: the engine's max_native_rows. Up to it every linear layer runs
the one-row-at-a-time kernel, above it the batched GEMM, whose iteration costs a fixed amount more
(the weights widened for it, the GEMM's own set-up) and each row less; without the term the fit
splits the difference, and the decode-only iterations (native, batch 4: 28 ms) taught it an
intercept 10 ms under that of the mixed ones it plans (measured 1.16x the prediction at p50, 1.41x
at p90, on the interference workload at a 133 ms target).

Pure Python over numbers (no torch): the scheduler calls it with its counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from phaselab.cost.formulas import keys_attended
from phaselab.cost.shapes import PlanEntry
from phaselab.errors import ConfigError

COEFFICIENT_NAMES = ("overhead_s", "prefill_token_s", "prefill_context_s", "decode_seq_s", "decode_context_s",
                     "wide_s")


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
        p_keys += keys_attended(n, start)
    contexts = list(decode_contexts)
    if not p_tokens and not contexts:
        return (0.0,) * len(COEFFICIENT_NAMES)
    wide = 1.0 if wide_rows and p_tokens + len(contexts) > wide_rows else 0.0
    return (1.0, float(p_tokens), float(p_keys), float(len(contexts)), float(sum(contexts)), wide)


def plan_features(scheduled: Iterable[PlanEntry], wide_rows: int = 0) -> tuple[float, ...]:
    """iteration_features of a plan's entries (core.outputs.ScheduledRequest)."""
    chunks, decodes = [], []
    for s in scheduled:
        if s.is_prefill:
            chunks.append((len(s.token_ids), s.start_position))
        else:
            decodes.append(s.start_position + len(s.token_ids))
    return iteration_features(chunks, decodes, wide_rows)


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
        keys += keys_attended(n, start)
        left -= n
    return coeffs.prefill_token_s * tokens + coeffs.prefill_context_s * keys, tokens


def chunk_cost(coeffs: IterationCostCoefficients, num_tokens: int, start: int) -> float:
    """The prefill terms of one chunk of `num_tokens` after `start` cached tokens."""
    return coeffs.prefill_token_s * num_tokens + coeffs.prefill_context_s * keys_attended(num_tokens, start)


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
