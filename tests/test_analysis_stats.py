"""The diagnosis's fits claim only what the data support: a slope's 95% interval covers the slope
the data were drawn with about 95% of the time, a bend is claimed for a curve that bends and not for
noise over a narrow range, and a burst of arrivals is reported as a burst, not as a rate. The truth
is the generating process here, not the fit."""

from __future__ import annotations

import numpy as np
import pytest

from phaselab.analysis.measures import arrival_rate_or_burst
from phaselab.analysis.stats import linear_fit, upward_bend


def test_slope_interval_covers_the_true_slope_at_its_level():
    rng = np.random.default_rng(0)
    x = np.linspace(100, 2000, 12)
    covered = 0
    trials = 400
    for _ in range(trials):
        y = 0.02 + 1e-4 * x + rng.normal(scale=0.01, size=len(x))
        f = linear_fit(x, y)
        assert f is not None
        covered += abs(f.slope - 1e-4) <= f.slope_ci
    assert 0.92 <= covered / trials <= 0.98


def test_no_slope_claimed_without_spread_and_no_negative_intercept_claimed():
    rng = np.random.default_rng(1)
    x = rng.uniform(1800, 2200, 10)
    y = 0.05 + 1e-5 * x + rng.normal(scale=0.02, size=10)  # the length explains little of the noise
    f = linear_fit(x, y)
    assert f is not None and not f.slope_significant
    # far outside the measured x the intercept's interval is wide: it reaches 0 or above
    assert f.intercept_plausible


def test_bend_only_when_the_curve_bends():
    rng = np.random.default_rng(2)
    narrow = np.repeat(np.linspace(1800, 2200, 8), 2)
    noise_only = upward_bend(narrow, 0.3 + 1e-4 * narrow + rng.normal(scale=0.03, size=len(narrow)))
    assert noise_only is not None and not noise_only.bends_upward
    wide = np.repeat(np.linspace(128, 4096, 8), 2)
    quadratic = 0.01 + 5e-5 * wide + 2e-8 * wide**2  # attention's square term dominates at the top
    bent = upward_bend(wide, quadratic * (1 + rng.normal(scale=0.01, size=len(wide))))
    assert bent is not None and bent.bends_upward and bent.significant


def test_a_burst_is_a_burst_and_a_steady_stream_a_rate():
    ms = 1_000_000
    burst = [i * 100_000 for i in range(8)]  # 8 requests within 0.7 ms, the run lasts 2 s
    assert arrival_rate_or_burst(burst, 2000 * ms) == (None, (8, pytest.approx(0.0007)))
    steady = [i * 100 * ms for i in range(21)]  # one every 100 ms for 2 s
    rate, b = arrival_rate_or_burst(steady, 2500 * ms)
    assert b is None and rate == pytest.approx(10.0)
