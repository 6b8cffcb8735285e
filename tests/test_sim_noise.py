"""The simulator's noisy machine (sim/noise.py): iteration times multiplied by a per-shape lognormal
factor and by slow periods of the virtual clock, reproducibly.

Truth comes from outside the noise model: a constant cost model (every iteration the same base
time), so each simulated iteration's factor is its recorded duration over that base, and the
lognormal's median and log-spread are read off the durations themselves.
"""

from __future__ import annotations

import math
import statistics

import pytest

from phaselab.cost.catalog import get_hardware, get_model
from phaselab.cost.pricing import IterationCost
from phaselab.errors import ConfigError
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.loop import simulate
from phaselab.sim.noise import IterationNoise, SlowPeriod
from phaselab.sim.workload import random_requests

BASE_NS = 10_000_000  # every iteration of the constant model: 10 ms
DEPLOYMENT = Deployment(get_model("llama-3-8b"), get_hardware("h100"), colocated=RoleConfig(max_num_batched_tokens=512))


class ConstantCostModel:
    def predict(self, plan):  # type: ignore[no-untyped-def]
        return IterationCost(BASE_NS, overhead_s=1e-3)


def _run(noise, n=24, output_len=400):  # type: ignore[no-untyped-def]
    requests = random_requests(n, input_len="64", output_len=str(output_len), seed=3)
    return simulate(DEPLOYMENT, requests, cost_model_factory=lambda *_: ConstantCostModel(), noise=noise)


def _factors(result, kind=None):  # type: ignore[no-untyped-def]
    out = []
    for r in result.iterations:
        mixed = r.num_prefill_tokens and r.num_decode_tokens
        cls = "mixed" if mixed else "prefill" if r.num_prefill_tokens else "decode"
        if kind is None or cls == kind:
            out.append((r.start_ns, (r.end_ns - r.start_ns) / BASE_NS))
    return out


def test_no_noise_and_zero_noise_give_the_same_run():
    plain = _run(None)
    zero = _run(IterationNoise(sigma={"*": 0.0}))
    assert [(r.start_ns, r.end_ns) for r in plain.iterations] == [(r.start_ns, r.end_ns) for r in zero.iterations]
    assert {(r.end_ns - r.start_ns) for r in plain.iterations} == {BASE_NS}


def test_decode_factors_are_lognormal_with_the_given_median_and_spread():
    noise = IterationNoise(sigma={"decode": 0.25}, bias={"decode": 1.2}, seed=7)
    decode = [f for _, f in _factors(_run(noise, n=8, output_len=600), "decode")]
    assert len(decode) > 500
    logs = [math.log(f) for f in decode]
    # the sample median and standard deviation of ~600 normal draws: within 0.05 of the truth
    # (their standard errors are about 0.013 and 0.007; the seed fixes the draws)
    assert statistics.median(logs) == pytest.approx(math.log(1.2), abs=0.05)
    assert statistics.stdev(logs) == pytest.approx(0.25, abs=0.05)


def test_each_shape_class_has_its_own_noise():
    """Noise on mixed iterations only: every decode-only iteration keeps the base time."""
    result = _run(IterationNoise(sigma={"mixed": 0.5}, bias={"mixed": 2.0}, seed=1))
    decode, mixed = _factors(result, "decode"), _factors(result, "mixed")
    assert decode and mixed
    assert {f for _, f in decode} == {1.0}
    assert statistics.median(f for _, f in mixed) > 1.3


def test_a_slow_period_slows_exactly_the_iterations_that_start_inside_it():
    plain = _run(None)
    start = plain.iterations[0].start_ns
    span_s = (plain.iterations[-1].end_ns - start) / 1e9
    period = SlowPeriod(start_s=span_s / 3, duration_s=span_s / 4, factor=1.5)
    result = _run(IterationNoise(slow=(period,)))
    for t_ns, f in _factors(result):
        inside = period.covers((t_ns - start) / 1e9)
        assert f == pytest.approx(1.5 if inside else 1.0, abs=1e-9)
    assert sum(period.covers((t - start) / 1e9) for t, _ in _factors(result)) > 20


def test_a_run_is_reproducible_and_the_seed_changes_it():
    noise = IterationNoise(sigma={"*": 0.3}, seed=5)
    a, b = _run(noise), _run(noise)
    c = _run(IterationNoise(sigma={"*": 0.3}, seed=6))
    durations = [[r.end_ns - r.start_ns for r in x.iterations] for x in (a, b, c)]
    assert durations[0] == durations[1] != durations[2]


def test_a_long_prefix_class_falls_back_to_its_base_class():
    noise = IterationNoise(sigma={"mixed": 0.0}, bias={"mixed": 1.5, "mixed+prefix": 3.0}, long_prefix=1024)

    class E:
        def __init__(self, n, start):  # type: ignore[no-untyped-def]
            self.token_ids, self.start_position, self.is_prefill, self.block_ids, self.sample = \
                [1] * n, start, n > 1, [], True

    class P:
        def __init__(self, *entries):  # type: ignore[no-untyped-def]
            self.scheduled, self.block_size = list(entries), 16

    import random
    rng = random.Random(0)
    assert noise.shape_class(P(E(64, 0), E(1, 10))) == "mixed"
    assert noise.shape_class(P(E(64, 2048), E(1, 10))) == "mixed+prefix"
    assert noise.shape_class(P(E(1, 5000))) == "decode"  # a decode's context is not a chunk's prefix
    assert noise.factor(P(E(64, 0), E(1, 10)), 0.0, rng) == 1.5
    assert noise.factor(P(E(64, 2048), E(1, 10)), 0.0, rng) == 3.0
    assert noise.factor(P(E(64, 2048)), 0.0, rng) == 1.0  # prefill+prefix -> prefill -> "*" -> none


@pytest.mark.parametrize("kwargs, words", [
    ({"sigma": {"mixd": 0.1}}, "unknown shape class"),
    ({"sigma": {"*": -0.1}}, "sigma"),
    ({"bias": {"*": 0.0}}, "bias"),
    ({"long_prefix": 0}, "long_prefix"),
])
def test_bad_noise_is_refused_with_what_to_use(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        IterationNoise(**kwargs)


def test_bad_slow_period_is_refused():
    with pytest.raises(ConfigError, match="slow period"):
        SlowPeriod(start_s=0, duration_s=0, factor=1.5)
