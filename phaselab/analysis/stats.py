"""Small statistics for the diagnosis: percentiles, least-squares fits with their 95% confidence
intervals, and the upward bend of a curve, claimed only when it exceeds the noise. numpy only
(analysis/ never imports torch)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def percentile(values: Sequence[float], p: float) -> float | None:
    """numpy's linear interpolation (vLLM's and `phaselab bench`'s convention); None when empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), p))


def nearest_rank_index(sorted_values: Sequence[float], p: float) -> int:
    """Index of the nearest-rank p-th percentile in an ascending list (a real element, not an
    interpolation: the TTFT breakdown at p99 is that of a request that happened)."""
    n = len(sorted_values)
    assert n > 0
    return min(n - 1, max(0, math.ceil(p / 100 * n) - 1))


def median(values: Sequence[float]) -> float | None:
    """numpy's 50th percentile (the mean of the two middle values), without numpy's per-call cost:
    the accounting takes one per request."""
    if len(values) == 0:
        return None
    return float(statistics.median(values))


# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; 1.96 beyond the table
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x by least squares, with 95% confidence half-widths."""

    slope: float
    intercept: float
    r2: float
    n: int
    slope_ci: float = math.inf  # half-width: the slope is slope +- slope_ci (95%)
    intercept_ci: float = math.inf

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x

    @property
    def slope_significant(self) -> bool:
        """The slope's 95% interval excludes 0."""
        return abs(self.slope) > self.slope_ci

    @property
    def intercept_plausible(self) -> bool:
        """A negative time at x = 0 is an extrapolation artefact unless its interval reaches 0."""
        return self.intercept + self.intercept_ci >= 0

    def slope_text(self, scale: float, unit: str) -> str:
        ci = f" +- {self.slope_ci * scale:.3g}" if math.isfinite(self.slope_ci) else ""
        return f"{self.slope * scale:.3g}{ci} {unit} (95%)"


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> LinearFit | None:
    """None with fewer than 3 points or no spread in x."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    df = len(x) - 2
    sxx = float(np.sum((x - x.mean()) ** 2))
    sigma = math.sqrt(float(np.sum(resid**2)) / df)
    t = t975(df)
    slope_ci = t * sigma / math.sqrt(sxx)
    intercept_ci = t * sigma * math.sqrt(1 / len(x) + float(x.mean()) ** 2 / sxx)
    return LinearFit(float(slope), float(intercept), r_squared(y, intercept + slope * x), len(x), slope_ci, intercept_ci)


def r_squared(y: np.ndarray, predicted: np.ndarray) -> float:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0:
        return 1.0
    return 1.0 - float(np.sum((y - predicted) ** 2)) / ss_tot


@dataclass(frozen=True)
class MultiFit:
    """y = intercept + sum(coef[k] * x_k) by least squares."""

    coefs: tuple[float, ...]
    intercept: float
    r2: float
    n: int


def multi_fit(columns: Sequence[Sequence[float]], ys: Sequence[float]) -> MultiFit | None:
    """None when there are fewer points than unknowns + 2 or a column is constant."""
    y = np.asarray(ys, dtype=float)
    xs = [np.asarray(c, dtype=float) for c in columns]
    if len(y) < len(xs) + 3 or any(np.ptp(c) == 0 for c in xs):
        return None
    a = np.column_stack([np.ones_like(y), *xs])
    sol, *_ = np.linalg.lstsq(a, y, rcond=None)
    return MultiFit(tuple(float(c) for c in sol[1:]), float(sol[0]), r_squared(y, a @ sol), len(y))


@dataclass(frozen=True)
class Bend:
    """Does y(x) bend upward at large x? The line through the lower half of the x range,
    extrapolated to the largest x, against the mean y measured there. An upward bend is claimed
    only when it is both large (ratio above the threshold) and significant: the excess exceeds the
    95% prediction interval of the lower line at the largest x (its own scatter and its slope's
    uncertainty), so noise over a narrow range of x is never called a bend."""

    lower_slope: float
    upper_slope: float
    ratio: float  # measured / extrapolated at the largest x
    bends_upward: bool
    significant: bool = False  # the excess is outside the lower line's 95% prediction interval


BEND_THRESHOLD = 1.15  # 15% above the lower half's line at the longest inputs


def upward_bend(xs: Sequence[float], ys: Sequence[float], threshold: float = BEND_THRESHOLD) -> Bend | None:
    """None unless there are at least two distinct x in each half (three points in the lower)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    distinct = np.unique(x)
    if len(distinct) < 4:
        return None
    cut = distinct[len(distinct) // 2 - 1]  # lower half: x <= cut
    lo, hi = x <= cut, x > cut
    if len(np.unique(x[lo])) < 2 or len(np.unique(x[hi])) < 2 or lo.sum() < 3:
        return None
    s_lo, i_lo = np.polyfit(x[lo], y[lo], 1)
    s_hi, _ = np.polyfit(x[hi], y[hi], 1)
    x_max = distinct[-1]
    predicted = i_lo + s_lo * x_max
    at_max = y[x == x_max]
    measured = float(at_max.mean())
    ratio = measured / predicted if predicted > 0 else math.inf
    xl, yl = x[lo], y[lo]
    df = len(xl) - 2
    sigma = math.sqrt(float(np.sum((yl - (i_lo + s_lo * xl)) ** 2)) / df) if df > 0 else math.inf
    sxx = float(np.sum((xl - xl.mean()) ** 2))
    # prediction interval of the mean of the points at x_max under the lower line
    se = sigma * math.sqrt(1 / len(at_max) + 1 / len(xl) + (x_max - xl.mean()) ** 2 / sxx)
    significant = measured - predicted > t975(max(df, 1)) * se
    return Bend(float(s_lo), float(s_hi), float(ratio), bool(ratio > threshold and significant), bool(significant))
