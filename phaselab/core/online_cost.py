"""The online fit of the iteration cost coefficients (core/slo.py) from measured iterations.

    seed (calibration file or a short warm-up)  ──▶  theta_0, P_0 = diag(prior std^2) / noise^2
    every measured iteration:  x = features(plan) (1, prefill tokens, prefill keys, decodes, decode keys)
                               y = its measured seconds
        recursive least squares with forgetting factor lam (old iterations fade: the machine drifts)
            k     = P x / (lam + x' P x)
            theta = theta + k (y - x' theta)
            P     = (P - k x' P) / lam
        then theta is projected onto its bounds: lower <= theta <= upper, lower >= 0
        (a physical floor, e.g. FLOPs over peak, may raise `lower`: no efficiency above 1),
        and P is kept no larger than P_0 (no wind-up while one regressor does not vary)

Features are scaled to comparable magnitudes internally (a prefill key costs ~1e6 times less
than an iteration's overhead), so the filter stays well conditioned in plain Python floats.
Pure: no clock, no random, no torch; the engine (or the simulator) passes the numbers in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phaselab.core.slo import COEFFICIENT_NAMES, IterationCostCoefficients
from phaselab.errors import ConfigError

# nominal size of each regressor in one busy iteration: its coefficient in scaled units is "seconds
# per nominal iteration's worth", of the same order for all five
FEATURE_SCALES = (1.0, 1e3, 1e6, 1e2, 1e5)
N = len(COEFFICIENT_NAMES)


@dataclass(frozen=True)
class FitterConfig:
    forgetting: float = 0.98  # lam: the weight of an observation halves after ~35 iterations
    noise_s: float = 2e-3  # typical measurement noise of one iteration's time
    prior_relative_std: float = 1.0  # how far from the seed each coefficient may plausibly be (x seed)
    prior_floor_s: float = 1e-3  # prior std (scaled units) of a coefficient seeded at 0

    def __post_init__(self) -> None:
        if not 0.5 <= self.forgetting <= 1.0:
            raise ConfigError(f"forgetting={self.forgetting} must be in [0.5, 1]")
        if not (self.noise_s > 0 and self.prior_relative_std > 0 and self.prior_floor_s > 0):
            raise ConfigError("noise_s, prior_relative_std and prior_floor_s must be > 0")


class OnlineCostFitter:
    """Recursive least squares with forgetting and bounds (module docstring)."""

    def __init__(self, seed: IterationCostCoefficients, config: FitterConfig | None = None,
                 lower: IterationCostCoefficients | None = None,
                 upper: IterationCostCoefficients | None = None) -> None:
        self.config = cfg = config or FitterConfig()
        self._lower = [v * s for v, s in zip((lower or IterationCostCoefficients()).as_tuple(), FEATURE_SCALES)]
        self._upper = [v * s if upper is not None else float("inf")
                       for v, s in zip((upper or IterationCostCoefficients()).as_tuple(), FEATURE_SCALES)]
        for lo, hi, name in zip(self._lower, self._upper, COEFFICIENT_NAMES):
            if lo > hi:
                raise ConfigError(f"cost coefficient {name}: lower bound above upper bound; check the bounds given")
        self.theta = self._project([v * s for v, s in zip(seed.as_tuple(), FEATURE_SCALES)])
        prior = [(cfg.prior_relative_std * abs(t) + cfg.prior_floor_s) / cfg.noise_s for t in self.theta]
        self._p0_diag = [p * p for p in prior]
        self.P = [[self._p0_diag[i] if i == j else 0.0 for j in range(N)] for i in range(N)]
        self.num_updates = 0
        self.last_error_s = 0.0  # measured - predicted of the last update (before it)

    # -- the model as data ------------------------------------------------------------------------
    @property
    def coefficients(self) -> IterationCostCoefficients:
        return IterationCostCoefficients.from_tuple(t / s for t, s in zip(self.theta, FEATURE_SCALES))

    def predict(self, features: Sequence[float]) -> float:
        return sum(t * x / s for t, x, s in zip(self.theta, features, FEATURE_SCALES, strict=True))

    # -- learning ----------------------------------------------------------------------------------
    def update(self, features: Sequence[float], measured_s: float) -> None:
        """One measured iteration: its features (core.slo.plan_features) and its duration."""
        if not features[0]:
            return  # an empty iteration carries no information
        if not measured_s >= 0:
            raise ValueError(f"measured iteration time {measured_s!r} must be >= 0")
        lam = self.config.forgetting
        x = [f / s for f, s in zip(features, FEATURE_SCALES, strict=True)]
        px = [sum(self.P[i][j] * x[j] for j in range(N)) for i in range(N)]
        denom = lam + sum(x[i] * px[i] for i in range(N))
        k = [v / denom for v in px]
        error = measured_s - sum(t * v for t, v in zip(self.theta, x))
        self.last_error_s = error
        self.theta = self._project([t + ki * error for t, ki in zip(self.theta, k)])
        # P = (P - k (P x)') / lam; P is symmetric, so x' P = (P x)'
        P = [[(self.P[i][j] - k[i] * px[j]) / lam for j in range(N)] for i in range(N)]
        for i in range(N):  # keep it symmetric against rounding
            for j in range(i + 1, N):
                P[i][j] = P[j][i] = 0.5 * (P[i][j] + P[j][i])
        # bound the covariance by the prior: with forgetting and a regressor that never varies
        # (no decodes in a warm-up, say) its variance would otherwise grow without limit
        worst = max(P[i][i] / self._p0_diag[i] for i in range(N))
        if worst > 1.0:
            P = [[v / worst for v in row] for row in P]
        self.P = P
        self.num_updates += 1

    def _project(self, theta: list[float]) -> list[float]:
        return [min(max(t, lo), hi) for t, lo, hi in zip(theta, self._lower, self._upper)]

    def to_json(self) -> dict:
        return {"coefficients": self.coefficients.to_json(), "num_updates": self.num_updates,
                "last_error_s": self.last_error_s, "forgetting": self.config.forgetting}
