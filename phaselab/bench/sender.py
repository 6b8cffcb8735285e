"""Sending a workload's requests over HTTP as an ArrivalPlan says (phaselab/workload/arrivals.py
describes the modes: closed loop, open loop, self-timed; --max-concurrency caps the requests in
flight, and the wait for a slot is recorded (scheduled -> sent) and is not in TTFT).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from phaselab.bench.client import RequestRecord, RequestSpec, new_record
from phaselab.workload.arrivals import ArrivalPlan


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
