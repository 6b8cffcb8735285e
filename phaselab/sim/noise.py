"""A noisy machine for the simulator: iteration times that vary as measured ones do.

The cost model gives one time per plan; a real CPU (or a shared GPU host) runs the same shape
1.3-1.6x apart from one iteration to the next, errs differently by shape (the last chunks of a
long prompt, attending to everything before them, overrun more than decodes do), and has slow
periods (another job on the cores). `IterationNoise` multiplies each simulated iteration's time by

    factor = bias[c] x exp(sigma[c] x z)    x  the factor of every slow period covering its start

where c is the iteration's shape class (`shape_class`), z a standard normal draw from a seeded
generator per worker (a run is reproducible), bias the class's median error and sigma its log
standard deviation (the lognormal's). The classes:

    decode            decodes only
    prefill           prefill chunks only
    mixed             prefill chunks beside decodes
    ...+prefix        the same, with a chunk after at least `long_prefix` cached tokens

A class without an entry uses the "*" entry, else no noise. The warm-up (sim_worker.py) is timed
with the same noise at its start: a loaded machine teaches the fitter what it measures.

What it is for: testing a plan against what a real machine does to it (the SLO budget's closed
loop, issue 37) on the virtual clock, where the truth (every gap) is counted exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from phaselab.cost.pricing import IterationCost
from phaselab.cost.shapes import Plan, RecordedIteration
from phaselab.errors import ConfigError

SHAPE_CLASSES = ("decode", "prefill", "mixed", "decode+prefix", "prefill+prefix", "mixed+prefix")


@dataclass(frozen=True)
class SlowPeriod:
    """From start_s for duration_s of virtual time (since the simulation's start), every iteration
    that starts inside runs `factor` times slower."""

    start_s: float
    duration_s: float
    factor: float

    def __post_init__(self) -> None:
        if self.start_s < 0 or self.duration_s <= 0 or not 0 < self.factor < math.inf:
            raise ConfigError(f"slow period {self}: want start_s >= 0, duration_s > 0 and a finite factor > 0")

    def covers(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.start_s + self.duration_s


@dataclass(frozen=True)
class IterationNoise:
    """Multiplicative noise on simulated iteration times (module docstring)."""

    sigma: dict[str, float] = field(default_factory=dict)  # shape class (or "*") -> log standard deviation
    bias: dict[str, float] = field(default_factory=dict)  # shape class (or "*") -> median factor
    slow: tuple[SlowPeriod, ...] = ()
    long_prefix: int = 1024  # cached tokens before a chunk that make its iteration a "+prefix" class
    seed: int = 0

    def __post_init__(self) -> None:
        for name, table in (("sigma", self.sigma), ("bias", self.bias)):
            unknown = set(table) - set(SHAPE_CLASSES) - {"*"}
            if unknown:
                raise ConfigError(f"noise {name}: unknown shape class(es) {sorted(unknown)}; use "
                                  f"{', '.join(SHAPE_CLASSES)} or '*'")
        if any(not 0 <= s < math.inf for s in self.sigma.values()):
            raise ConfigError(f"noise sigma {self.sigma}: each must be finite and >= 0")
        if any(not 0 < b < math.inf for b in self.bias.values()):
            raise ConfigError(f"noise bias {self.bias}: each must be finite and > 0")
        if self.long_prefix < 1:
            raise ConfigError(f"noise long_prefix={self.long_prefix} must be >= 1")

    def shape_class(self, plan: Plan) -> str:
        prefill = decode = prefix = False
        for e in plan.scheduled:
            if len(e.token_ids) > 1 or e.is_prefill:
                prefill = True
                prefix = prefix or e.start_position >= self.long_prefix
            else:
                decode = True
        base = "mixed" if prefill and decode else "prefill" if prefill else "decode"
        return base + "+prefix" if prefix else base

    def _lookup(self, table: dict[str, float], cls: str, default: float) -> float:
        for key in (cls, cls.split("+")[0] if cls.endswith("+prefix") else cls, "*"):
            if key in table:
                return table[key]
        return default

    def slow_factor(self, t_s: float) -> float:
        f = 1.0
        for p in self.slow:
            if p.covers(t_s):
                f *= p.factor
        return f

    def generator(self, worker: str) -> random.Random:
        """The draws of one worker: seeded by the noise's seed and the worker's name (reproducible,
        independent of how the other workers' iterations interleave)."""
        return random.Random(f"{self.seed}:{worker}")

    def factor(self, plan: Plan, t_s: float, rng: random.Random) -> float:
        """The multiplier of one iteration of `plan` starting at t_s (virtual seconds since the start).
        A ".+prefix" class without an entry of its own falls back to its base class, then to "*"."""
        cls = self.shape_class(plan)
        sigma = self._lookup(self.sigma, cls, 0.0)
        z = rng.gauss(0.0, 1.0)  # drawn every iteration, so one class's entry does not shift another's draws
        return self._lookup(self.bias, cls, 1.0) * math.exp(sigma * z) * self.slow_factor(t_s)


def record_class(rec: RecordedIteration, long_prefix: int = 1024) -> str:
    """`IterationNoise.shape_class` of a recorded iteration (its chunks: a chunk's first position is
    its context after the step less its tokens)."""
    prefill = decode = prefix = False
    for c in rec.chunks:
        if c.num_tokens > 1 or c.is_prefill:
            prefill = True
            prefix = prefix or c.context_len - c.num_tokens >= long_prefix
        else:
            decode = True
    base = "mixed" if prefill and decode else "prefill" if prefill else "decode"
    return base + "+prefix" if prefix else base


MIN_CLASS_ITERATIONS = 5  # a shape class with fewer measured iterations takes the run's overall error


def fitted_noise(iterations: Sequence[RecordedIteration], measured_s: Sequence[float], predicted_s: Sequence[float],
                 seed: int = 0, long_prefix: int = 1024) -> IterationNoise:
    """The noise a run's own iterations show against a cost model: per shape class, the median of
    log(measured / predicted) as its bias and their standard deviation as its sigma (a lognormal);
    classes with fewer than MIN_CLASS_ITERATIONS iterations use the run's whole ("*")."""
    by: dict[str, list[float]] = {}
    for rec, m, p in zip(iterations, measured_s, predicted_s):
        if m > 0 and p > 0:
            by.setdefault(record_class(rec, long_prefix), []).append(math.log(m / p))
    every = [x for v in by.values() for x in v]
    sigma: dict[str, float] = {}
    bias: dict[str, float] = {}
    for cls, logs in [("*", every)] + sorted(by.items()):
        if len(logs) < (2 if cls == "*" else MIN_CLASS_ITERATIONS):
            continue
        logs = sorted(logs)
        mid = logs[len(logs) // 2] if len(logs) % 2 else (logs[len(logs) // 2 - 1] + logs[len(logs) // 2]) / 2
        mean = sum(logs) / len(logs)
        sigma[cls] = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
        bias[cls] = math.exp(mid)
    return IterationNoise(sigma=sigma, bias=bias, long_prefix=long_prefix, seed=seed)


def scaled(cost: IterationCost, factor: float) -> IterationCost:
    """The cost with every time in it multiplied by factor (the modeled counts unchanged)."""
    if factor == 1.0:
        return cost
    return replace(cost, duration_ns=round(cost.duration_ns * factor) if cost.duration_ns else 0, overhead_s=cost.overhead_s * factor,
                   linear_s=cost.linear_s * factor, attention_s=cost.attention_s * factor,
                   allreduce_s=cost.allreduce_s * factor, elementwise_s=cost.elementwise_s * factor)
