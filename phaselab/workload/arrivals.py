"""When each request of a run is released: closed loop, open loop (Poisson or gamma), or the
workload's own times. One description for the bench (over HTTP), the simulator (virtual clock) and
the offline driver (phaselab.workload.driver).

    closed loop   concurrency N          N users; each sends its next request when the last one ends
    open loop     request_rate R         renewal process: gaps ~ Gamma(shape=b, scale=1/(R*b)),
                  burstiness b            mean 1/R, coefficient of variation 1/sqrt(b)
                                          (b=1: Poisson; b<1 burstier; b=inf: evenly spaced)
    self-timed    trace, interference    each request carries its offset from the start
    any open/self-timed mode             max_concurrency C caps the requests in flight (the bench)

Every random draw comes from a `numpy.random.Generator` seeded by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalPlan:
    """How the requests of a run are released. Exactly one mode applies (see `mode`)."""

    concurrency: int | None = None  # closed loop when set
    request_rate: float = math.inf  # open loop, requests/s (inf: all at once)
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    max_concurrency: int | None = None  # cap on requests in flight (open loop and self-timed; the bench)
    self_timed: bool = False  # use each request's own arrival offset (trace, interference)
    time_scale: float = 1.0  # self-timed: multiply every offset (0.5 = replay twice as fast)

    @property
    def mode(self) -> str:
        if self.self_timed:
            return "self-timed"
        return "closed" if self.concurrency is not None else "open"

    def describe(self) -> str:
        if self.mode == "closed":
            return f"closed loop, concurrency {self.concurrency}"
        cap = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        if self.mode == "self-timed":
            scale = f" x{self.time_scale:g}" if self.time_scale != 1.0 else ""
            return f"the workload's own arrival times{scale}{cap}"
        if math.isinf(self.request_rate):
            return f"open loop, all requests at once{cap}"
        dist = "Poisson" if self.burstiness == 1.0 else f"gamma (burstiness {self.burstiness:g})"
        return f"open loop, {self.request_rate:g} req/s, {dist}{cap}"


def gamma_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """`n` inter-arrival gaps in seconds with mean 1/rate and CV 1/sqrt(burstiness).

    Unlike vLLM's `get_request`, the drawn gaps are not rescaled to make the total exactly
    n/rate: rescaling would couple every gap to every other one, and the process would no longer
    be the renewal process the parameters describe.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate ({rate}) and burstiness ({burstiness}) must be positive")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send times (s from the start) of `n` open-loop requests; the first goes at 0."""
    if n <= 0:
        return []
    gaps = gamma_intervals(n - 1, rate, burstiness, rng)
    return [0.0, *np.cumsum(gaps).tolist()]


def workload_seeds(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """The two generators of a run, as `phaselab bench` spawns them: [0] the workload (lengths,
    prompt text), [1] the open-loop arrival gaps. The simulator uses the same split, so a seed gives
    the bench's lengths and send times."""
    s = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(s[0]), np.random.default_rng(s[1])
