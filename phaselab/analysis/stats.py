"""Small statistics for the diagnosis: percentiles, least-squares fits, and the upward bend of a
curve. numpy only (analysis/ never imports torch)."""

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


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x by least squares."""

    slope: float
    intercept: float
    r2: float
    n: int

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> LinearFit | None:
    """None with fewer than 3 points or no spread in x."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return LinearFit(float(slope), float(intercept), r_squared(y, intercept + slope * x), len(x))


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
    extrapolated to the largest x, against the mean y measured there."""

    lower_slope: float
    upper_slope: float
    ratio: float  # measured / extrapolated at the largest x
    bends_upward: bool


BEND_THRESHOLD = 1.15  # 15% above the lower half's line at the longest inputs


def upward_bend(xs: Sequence[float], ys: Sequence[float], threshold: float = BEND_THRESHOLD) -> Bend | None:
    """None unless there are at least two distinct x in each half."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    distinct = np.unique(x)
    if len(distinct) < 4:
        return None
    cut = distinct[len(distinct) // 2 - 1]  # lower half: x <= cut
    lo, hi = x <= cut, x > cut
    if len(np.unique(x[lo])) < 2 or len(np.unique(x[hi])) < 2:
        return None
    s_lo, i_lo = np.polyfit(x[lo], y[lo], 1)
    s_hi, _ = np.polyfit(x[hi], y[hi], 1)
    x_max = distinct[-1]
    predicted = i_lo + s_lo * x_max
    measured = float(y[x == x_max].mean())
    ratio = measured / predicted if predicted > 0 else math.inf
    return Bend(float(s_lo), float(s_hi), float(ratio), bool(ratio > threshold))
