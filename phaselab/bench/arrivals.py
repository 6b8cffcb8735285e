"""When each request is sent: closed loop, open loop (Poisson or gamma), or the workload's own times.

    closed loop   --concurrency N        N users; each sends its next request when the last one ends
    open loop     --request-rate R       renewal process: gaps ~ Gamma(shape=b, scale=1/(R*b)),
                  --burstiness b          mean 1/R, coefficient of variation 1/sqrt(b)
                                          (b=1: Poisson; b<1 burstier; b=inf: evenly spaced)
    self-timed    trace, interference    each request carries its offset from the start
    any open/self-timed mode             --max-concurrency C caps the requests in flight; the wait for
                                          a slot is recorded (scheduled -> sent) and is not in TTFT

Every random draw comes from a `numpy.random.Generator` seeded by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from phaselab.bench.client import RequestRecord, RequestSpec, new_record


@dataclass(frozen=True)
class ArrivalPlan:
    """How the requests of a run are released. Exactly one mode applies (see `mode`)."""

    concurrency: int | None = None  # closed loop when set
    request_rate: float = math.inf  # open loop, requests/s (inf: all at once)
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    max_concurrency: int | None = None  # cap on requests in flight (open loop and self-timed)
    self_timed: bool = False  # use RequestSpec.arrival_s (trace, interference)
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
            return f"workload's own arrival times x{self.time_scale:g}{cap}"
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


SendFn = Callable[[RequestSpec, RequestRecord], Awaitable[RequestRecord]]
DoneFn = Callable[[RequestRecord], None]


async def drive(
    specs: Sequence[RequestSpec],
    send: SendFn,
    plan: ArrivalPlan,
    offsets: Sequence[float] | None = None,
    on_done: DoneFn | None = None,
    started: list[RequestRecord] | None = None,
) -> list[RequestRecord]:
    """Send `specs` as the plan says; returns one record per released spec, in spec order.

    Each record is also appended to `started` when its request is released, before any await,
    so the caller keeps what was started if the run is cancelled (Ctrl-C).
    """
    records: list[RequestRecord | None] = [None] * len(specs)
    clock = time.monotonic_ns

    async def run_one(i: int, spec: RequestSpec, scheduled_ns: int, slot: contextlib.AbstractAsyncContextManager[object]) -> None:
        rec = new_record(spec, scheduled_ns)
        records[i] = rec
        if started is not None:
            started.append(rec)
        async with slot:
            await send(spec, rec)
        if on_done is not None:
            on_done(rec)

    if plan.mode == "closed":
        assert plan.concurrency is not None and plan.concurrency >= 1, "concurrency must be >= 1"
        next_index = iter(range(len(specs)))

        async def user() -> None:
            for i in next_index:  # shared iterator: each user takes the next unsent request
                await run_one(i, specs[i], clock(), contextlib.nullcontext())

        await asyncio.gather(*(user() for _ in range(min(plan.concurrency, len(specs)))))
    else:
        if offsets is None:
            if plan.mode == "self-timed":
                offsets = [(s.arrival_s or 0.0) * plan.time_scale for s in specs]
            else:
                raise ValueError("an open-loop plan needs the arrival offsets (arrival_offsets())")
        order = sorted(range(len(specs)), key=lambda i: offsets[i])
        sem: contextlib.AbstractAsyncContextManager[object] = (
            asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else contextlib.nullcontext()
        )
        start_ns = clock()
        tasks: list[asyncio.Task[None]] = []
        try:
            for i in order:
                scheduled_ns = start_ns + int(offsets[i] * 1e9)
                delay_ns = scheduled_ns - clock()
                if delay_ns > 0:
                    await asyncio.sleep(delay_ns / 1e9)
                tasks.append(asyncio.create_task(run_one(i, specs[i], scheduled_ns, sem)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
    return [r for r in records if r is not None]
