"""The online fit of the iteration cost coefficients (core/adaptive_budget.py) from measured iterations.

    seed theta_0 (a calibration file, or a short warm-up's fit)
    every measured iteration: x = features(plan) = (1, prefill tokens, prefill keys, decodes, decode keys),
                              y = its measured seconds
        R = lam R + x x',  r = lam r + x y                 (exponentially weighted: the machine drifts,
                                                             an observation's weight halves in ~35 iterations)
        theta = argmin  sum_k lam^(n-k) (x_k' theta - y_k)^2 / noise^2 + sum_i (theta_i - theta_0,i)^2 / std_i^2
                 over lower <= theta <= upper, lower >= 0   (bounded least squares, by coordinate descent
                                                             warm-started from the previous theta)

After the warm-up, a quarter of its information is kept without decay (`anchor`): a budget held
small by the target stops producing the large chunks that measure a chunk's cost, and without the
anchor that direction of the fit would be left to noise. The prior term keeps a coefficient whose
regressor never varied (no decodes in a warm-up, say)
at its seed instead of letting it drift; std_i is prior_relative_std x the seed, or prior_floor_s
for an unseeded (zero) coefficient, which data then move freely. `lower` may carry a physical
floor (FLOPs over peak: no efficiency above 1). Solving the bounded problem each time, instead of
clamping a recursive-least-squares estimate, keeps the fit stable when a bound is active: a clamped
RLS estimate loses the compensation between correlated coefficients and diverges.

Features are scaled to comparable magnitudes internally (a prefill key costs ~1e6 times less
than an iteration's overhead), so the problem is well conditioned in plain Python floats.
Pure: no clock, no random, no torch; the engine (or the simulator) passes the numbers in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phaselab.cost.shapes import Plan
from phaselab.cost.iteration_cost import COEFFICIENT_NAMES, IterationCostCoefficients, plan_features
from phaselab.errors import ConfigError

# nominal size of each regressor in one busy iteration: its coefficient in scaled units is "seconds
# per nominal iteration's worth", of the same order for all five
FEATURE_SCALES = (1.0, 1e3, 1e6, 1e2, 1e5, 1.0)
N = len(COEFFICIENT_NAMES)


@dataclass(frozen=True)
class FitterConfig:
    forgetting: float = 0.98  # lam
    noise_s: float = 1e-4  # measurement noise of one iteration's time: weighs data against the prior
    prior_relative_std: float = 1.0  # how far from its seed a seeded coefficient plausibly is (x seed)
    prior_floor_s: float = 1.0  # prior std (scaled units) of a coefficient seeded at 0: learn it from data
    max_sweeps: int = 200  # coordinate-descent sweeps per update (warm-started: usually a few)

    def __post_init__(self) -> None:
        if not 0.5 <= self.forgetting <= 1.0:
            raise ConfigError(f"forgetting={self.forgetting} must be in [0.5, 1]")
        if not (self.noise_s > 0 and self.prior_relative_std > 0 and self.prior_floor_s > 0):
            raise ConfigError("noise_s, prior_relative_std and prior_floor_s must be > 0")


class OnlineCostFitter:
    """Exponentially weighted, bounded least squares (module docstring)."""

    def __init__(self, seed: IterationCostCoefficients, config: FitterConfig | None = None,
                 lower: IterationCostCoefficients | None = None,
                 upper: IterationCostCoefficients | None = None, wide_rows: int | None = None) -> None:
        """wide_rows: the engine's max_native_rows (core/adaptive_budget.py; None: the seed's)."""
        self.config = cfg = config or FitterConfig()
        self.wide_rows = seed.wide_rows if wide_rows is None else wide_rows
        self._lower = [v * s for v, s in zip((lower or IterationCostCoefficients()).as_tuple(), FEATURE_SCALES)]
        self._upper = [v * s if upper is not None else float("inf")
                       for v, s in zip((upper or IterationCostCoefficients()).as_tuple(), FEATURE_SCALES)]
        for lo, hi, name in zip(self._lower, self._upper, COEFFICIENT_NAMES):
            if lo > hi:
                raise ConfigError(f"cost coefficient {name}: lower bound above upper bound; check the bounds given")
        self.theta0 = [min(max(v * s, lo), hi) for v, s, lo, hi in
                       zip(seed.as_tuple(), FEATURE_SCALES, self._lower, self._upper)]
        self.theta = list(self.theta0)
        std = [cfg.prior_relative_std * t if t > 0 else cfg.prior_floor_s for t in self.theta0]
        self._prior_precision = [1.0 / (v * v) for v in std]
        self.R = [[0.0] * N for _ in range(N)]  # decayed sum of x x' (scaled features)
        self.r = [0.0] * N  # decayed sum of x y
        # the warm-up's information, kept without decay (anchor()): the directions that serving stops
        # exciting (large chunks while the budget is held small) keep what the warm-up measured
        self.R_anchor = [[0.0] * N for _ in range(N)]
        self.r_anchor = [0.0] * N
        self.num_updates = 0
        self.last_error_s = 0.0  # measured - predicted of the last update (before it)

    # -- the model as data ------------------------------------------------------------------------
    @property
    def coefficients(self) -> IterationCostCoefficients:
        return IterationCostCoefficients.from_tuple((t / s for t, s in zip(self.theta, FEATURE_SCALES)), self.wide_rows)

    def predict(self, features: Sequence[float]) -> float:
        return sum(t * x / s for t, x, s in zip(self.theta, features, FEATURE_SCALES, strict=True))

    # -- learning ----------------------------------------------------------------------------------
    def update(self, features: Sequence[float], measured_s: float) -> None:
        """One measured iteration: its features (core.slo.plan_features with this fitter's wide_rows)
        and its duration."""
        if not features[0]:
            return  # an empty iteration carries no information
        if not measured_s >= 0:
            raise ValueError(f"measured iteration time {measured_s!r} must be >= 0")
        lam = self.config.forgetting
        x = [f / s for f, s in zip(features, FEATURE_SCALES, strict=True)]
        self.last_error_s = measured_s - sum(t * v for t, v in zip(self.theta, x))
        for i in range(N):
            row = self.R[i]
            for j in range(N):
                row[j] = lam * row[j] + x[i] * x[j]
            self.r[i] = lam * self.r[i] + x[i] * measured_s
        self._solve()
        self.num_updates += 1

    def anchor(self, weight: float = 0.25) -> None:
        """Keep `weight` x what has been learned so far (the warm-up) forever: forgetting then only
        fades what later iterations taught. Without it, a budget held small stops producing the
        large chunks that measure a chunk's cost, their information fades, and the fit of those
        directions is left to noise (the policy cannot learn what it no longer tries)."""
        self.R_anchor = [[weight * v for v in row] for row in self.R]
        self.r_anchor = [weight * v for v in self.r]

    def _solve(self) -> None:
        """The bounded quadratic by active sets: solve for the free coefficients with the others at
        their bounds; clamp a free one that leaves its box, release a bound one whose gradient
        points inside; a handful of 5x5 solves. Coordinate descent finishes it if that cycles."""
        w = 1.0 / self.config.noise_s ** 2
        H = [[w * (v + a) for v, a in zip(row, arow)] for row, arow in zip(self.R, self.R_anchor)]
        b = [w * (v + a) for v, a in zip(self.r, self.r_anchor)]
        for i in range(N):
            H[i][i] += self._prior_precision[i]
            b[i] += self._prior_precision[i] * self.theta0[i]
        lo, hi = self._lower, self._upper
        theta = [min(max(t, lo[i]), hi[i]) for i, t in enumerate(self.theta)]
        # start from the coefficients held at a bound that the gradient pushes against it
        bound = {i for i in range(N) if (theta[i] == lo[i] and self._gradient(H, b, theta, i) > 0)
                 or (theta[i] == hi[i] and self._gradient(H, b, theta, i) < 0)}
        for _ in range(4 * N):
            free = [i for i in range(N) if i not in bound]
            rhs = [b[i] - sum(H[i][j] * theta[j] for j in bound) for i in free]
            sol = _solve_linear([[H[i][j] for j in free] for i in free], rhs)
            if sol is None or not all(math.isfinite(v) for v in sol):
                break  # (near-)singular: coordinate descent below, which only ever divides by H[i][i] > 0
            outside = [(max(lo[i] - v, v - hi[i]), i, v) for i, v in zip(free, sol) if not lo[i] <= v <= hi[i]]
            if outside:
                # step from theta toward the solution until the first free coefficient hits its bound
                step, first = 1.0, None
                for i, v in zip(free, sol):
                    if v < lo[i] and theta[i] - v > 0:
                        a = (theta[i] - lo[i]) / (theta[i] - v)
                    elif v > hi[i] and v - theta[i] > 0:
                        a = (hi[i] - theta[i]) / (v - theta[i])
                    else:
                        continue
                    if a < step:
                        step, first = a, i
                for i, v in zip(free, sol):
                    theta[i] = min(max(theta[i] + step * (v - theta[i]), lo[i]), hi[i])
                if first is None:
                    first = max(outside)[1]
                theta[first] = lo[first] if sol[free.index(first)] < lo[first] else hi[first]
                bound.add(first)
                continue
            for i, v in zip(free, sol):
                theta[i] = v
            # KKT: a coefficient held at a bound must have its gradient pushing it out of the box
            release = [(abs(g), i) for i in bound if (g := self._gradient(H, b, theta, i)) != 0
                       and ((theta[i] == lo[i] and g < 0) or (theta[i] == hi[i] and g > 0))]
            if not release:
                self.theta = theta
                return
            bound.discard(max(release)[1])
        for _ in range(self.config.max_sweeps):  # fallback: coordinate descent from where it got
            moved = 0.0
            for i in range(N):
                rest = b[i] - sum(H[i][j] * theta[j] for j in range(N) if j != i)
                new = min(max(rest / H[i][i], lo[i]), hi[i])
                moved = max(moved, abs(new - theta[i]) / (abs(new) + 1e-12))
                theta[i] = new
            if moved < 1e-9:
                break
        self.theta = theta

    @staticmethod
    def _gradient(H: list[list[float]], b: list[float], theta: list[float], i: int) -> float:
        return sum(H[i][j] * theta[j] for j in range(N)) - b[i]

    def to_json(self) -> dict[str, Any]:
        return {"coefficients": self.coefficients.to_json(), "num_updates": self.num_updates,
                "last_error_s": self.last_error_s, "forgetting": self.config.forgetting}


class BudgetLearner:
    """What an engine loop (real or simulated) keeps for the adaptive budget: the fitter, fed with
    each executed plan and its measured seconds, and the recent prediction error; the scheduler
    reads `planning_coefficients` before the next plan.

    The planning model is the fit scaled by `error_factor`: a quantile of measured / predicted over
    the last `error_window` iterations that carried prefill beside decodes (the only ones a budget is
    chosen for; decode-only ones were measured to err differently). Which quantile follows from the
    target's attainment (`attainment`, 0.99: the p99 of token gaps) and from the share of recent
    token gaps that fell in such iterations (`mixed_gap_share`, over the last `share_window`
    iterations with decodes): for at most 1 - attainment of all gaps to exceed the target, a
    mixed iteration may exceed it with probability (1 - attainment) / share, so the plan takes the
    1 - (1 - attainment) / share quantile of the error, at least `error_quantile` (the median: the
    fit's bias, corrected where mixed gaps are too rare to reach the tail) and at most
    MAX_QUANTILE. On the interference workload, where ~15% of gaps are mixed, that is the p93:
    prefill chunks sized at the median left the p99 of gaps at 1.17-1.4x a 74 or 149 ms target on
    a noisy machine (the same chunk measured 1.3-1.6x apart from one iteration to the next); on a
    Poisson mix where a long prompt's chunks carry ~1% of the gaps it stays the median, and a high
    quantile there only shrinks every chunk (docs/slo.md). 1 until `MIN_ERROR_SAMPLES` are seen;
    within [0.5, 4]."""

    MIN_ERROR_SAMPLES = 8
    MAX_QUANTILE = 0.95  # the error quantile never plans for the window's few worst (of 64: the 61st)

    def __init__(self, fitter: OnlineCostFitter, seed_source: str, error_window: int = 64,
                 error_quantile: float = 0.5, attainment: float = 0.99, share_window: int = 512) -> None:
        if error_window < 1 or share_window < 1 or not 0 < error_quantile <= 1 or not 0 < attainment < 1:
            raise ConfigError("error_window and share_window must be >= 1, error_quantile in (0, 1] and "
                              "attainment in (0, 1)")
        self.fitter = fitter
        self.seed_source = seed_source  # where the starting coefficients came from (recorded with the run)
        self.error_quantile = error_quantile
        self.attainment = attainment
        self._ratios: deque[float] = deque(maxlen=error_window)  # measured / predicted, recent iterations
        # (token gaps, of them in a mixed iteration) of the recent iterations with decodes
        self._gaps: deque[tuple[int, int]] = deque(maxlen=share_window)

    @property
    def coefficients(self) -> IterationCostCoefficients:
        """The fitted model (what `observe` returns predictions of)."""
        return self.fitter.coefficients

    @property
    def mixed_gap_share(self) -> float:
        """Of the token gaps of the recent iterations with decodes, the share in iterations that
        also carried prefill (a decode's gap is the iteration it ran in)."""
        total = sum(n for n, _ in self._gaps)
        return sum(m for _, m in self._gaps) / total if total else 0.0

    @property
    def planning_quantile(self) -> float:
        """The quantile of the error the plan is scaled by (class docstring)."""
        share = self.mixed_gap_share
        need = 1.0 - (1.0 - self.attainment) / share if share > 0 else 0.0
        return min(self.MAX_QUANTILE, max(self.error_quantile, need))

    @property
    def error_factor(self) -> float:
        if len(self._ratios) < self.MIN_ERROR_SAMPLES:
            return 1.0
        ranked = sorted(self._ratios)
        q = ranked[min(len(ranked) - 1, math.ceil(self.planning_quantile * len(ranked)) - 1)]
        return min(max(q, 0.5), 4.0)

    @property
    def planning_coefficients(self) -> IterationCostCoefficients:
        """The fit scaled by the recent error quantile: what the budget is planned with."""
        f = self.error_factor
        return IterationCostCoefficients.from_tuple((c * f for c in self.coefficients.as_tuple()),
                                                    self.fitter.wide_rows)

    def features(self, plan: Plan) -> tuple[float, ...]:
        return plan_features(plan.scheduled, self.fitter.wide_rows)

    def predict(self, plan: Plan) -> float:
        return self.coefficients.predict_features(self.features(plan))

    def observe(self, plan: Plan, measured_s: float) -> float:
        """Learn from one executed plan; returns what the fitted model predicted for it beforehand."""
        features = self.features(plan)
        predicted = self.coefficients.predict_features(features)
        mixed = bool(features[1] and features[3])  # where the budget binds: prefill beside decodes
        if predicted > 0 and mixed:
            self._ratios.append(measured_s / predicted)
        if features[3]:
            self._gaps.append((int(features[3]), int(features[3]) if mixed else 0))
        self.fitter.update(features, measured_s)
        return predicted

    def to_json(self) -> dict[str, Any]:
        return {**self.fitter.to_json(), "seed_source": self.seed_source, "error_factor": self.error_factor,
                "error_quantile": self.planning_quantile, "error_quantile_min": self.error_quantile,
                "attainment": self.attainment, "mixed_gap_share": self.mixed_gap_share,
                "error_window": self._ratios.maxlen}


def _solve_linear(A: list[list[float]], y: list[float]) -> list[float] | None:
    """A x = y by Gaussian elimination with partial pivoting (A small, symmetric positive definite
    here); None if it is singular."""
    n = len(y)
    M = [row[:] + [v] for row, v in zip(A, y)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        if abs(M[p][c]) < 1e-300:
            return None
        M[c], M[p] = M[p], M[c]
        for r in range(c + 1, n):
            f = M[r][c] / M[c][c]
            if f:
                for k in range(c, n + 1):
                    M[r][k] -= f * M[c][k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (M[c][n] - sum(M[c][k] * x[k] for k in range(c + 1, n))) / M[c][c]
    return x


# -- the warm-up: a few synthetic iterations that vary every regressor --------------------------------
def warm_up_shapes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, capacity_tokens: int
                   ) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """(prefill chunks [(num_tokens, start)], decode contexts) of the warm-up iterations: prefill
    alone at three sizes and two prefix lengths, decodes alone at three batch sizes and contexts,
    and two mixes, all within the budget, the seats, the context and half the KV capacity."""
    budget, seats, ctx = max_num_batched_tokens, max_num_seqs, max_model_len - 1
    room = max(2, capacity_tokens // 2)

    def chunk(n: int, start: int) -> tuple[int, int]:
        n = max(2, min(n, budget, ctx))
        return n, max(0, min(start, ctx - n, room - n))

    def decodes(k: int, context: int) -> list[int]:
        k = max(1, min(k, seats, budget))
        return [max(1, min(context, ctx, room // k))] * k

    shapes = [
        ([chunk(64, 0)], []), ([chunk(256, 0)], []), ([chunk(512, 0)], []),
        ([chunk(128, 512)], []), ([chunk(256, 1024)], []),
        ([], decodes(1, 128)), ([], decodes(8, 256)), ([], decodes(32, 512)), ([], decodes(8, 1024)),
        # small mixes on either side of an engine's max_native_rows (8 here): the wide term's contrast
        ([chunk(4, 0)], decodes(2, 128)), ([chunk(32, 256)], decodes(4, 256)),
        ([chunk(128, 256)], decodes(8, 256)), ([chunk(256, 0)], decodes(16, 512)),
    ]
    return [shape for shape in shapes if sum(n for n, _ in shape[0]) + len(shape[1]) <= budget]
