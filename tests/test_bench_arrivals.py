"""Arrival processes (rate and CV of Poisson and gamma gaps, seeded) and the request driver."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from phaselab.bench.sender import drive
from phaselab.workload.arrivals import ArrivalPlan, arrival_offsets, gamma_intervals
from phaselab.bench.client import RequestRecord, RequestSpec
from phaselab.bench.bench_run import plan_from

N = 20_000  # draws per check


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 0.5, 4.0])
@pytest.mark.parametrize("rate", [2.0, 50.0])
def test_gaps_match_rate_and_cv(rate, burstiness):
    gaps = gamma_intervals(N, rate, burstiness, np.random.default_rng(1234))
    cv = 1 / math.sqrt(burstiness)
    mean = gaps.mean()
    # the sample mean's standard error is cv/(rate*sqrt(N)); allow 4 of them
    assert abs(mean - 1 / rate) < 4 * cv / (rate * math.sqrt(N))
    # realized rate over the whole span
    assert N / gaps.sum() == pytest.approx(rate, rel=4 * cv / math.sqrt(N))
    # sample CV: the gamma's CV within 5% (the SE of the CV is ~ cv*sqrt((1+2cv^2)/(2N)) < 2.5% here)
    assert gaps.std() / mean == pytest.approx(cv, rel=0.05)
    assert (gaps > 0).all()


def test_poisson_counts_have_unit_dispersion():
    # a Poisson process: counts in fixed windows have variance == mean
    offsets = np.array(arrival_offsets(N, 10.0, 1.0, np.random.default_rng(7)))
    counts = np.bincount((offsets // 1.0).astype(int))[:-1]  # 1 s windows, last one partial
    assert counts.mean() == pytest.approx(10.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


def test_seeded_and_edge_cases():
    a = arrival_offsets(100, 5.0, 0.5, np.random.default_rng(3))
    b = arrival_offsets(100, 5.0, 0.5, np.random.default_rng(3))
    c = arrival_offsets(100, 5.0, 0.5, np.random.default_rng(4))
    assert a == b and a != c
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert arrival_offsets(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    assert arrival_offsets(3, 4.0, math.inf, np.random.default_rng(0)) == [0.0, 0.25, 0.5]
    assert arrival_offsets(0, 4.0, 1.0, np.random.default_rng(0)) == []
    with pytest.raises(ValueError):
        gamma_intervals(3, 1.0, 0.0, np.random.default_rng(0))


def test_plan_validation_and_description():
    assert plan_from(4, math.inf, 1.0, None, False).describe() == "closed loop, concurrency 4"
    assert "Poisson" in plan_from(None, 3.0, 1.0, 2, False).describe()
    assert "gamma (burstiness 0.5)" in plan_from(None, 3.0, 0.5, None, False).describe()
    with pytest.raises(ValueError):
        plan_from(4, 2.0, 1.0, None, False)
    with pytest.raises(ValueError):
        plan_from(2, math.inf, 1.0, None, True)
    with pytest.raises(ValueError):
        plan_from(0, math.inf, 1.0, None, False)


# How late a request may be sent after its scheduled time, as the sender stamped it (an
# asyncio.sleep's wake-up plus a task switch). Measured here (2 cores shared with other jobs; 40
# runs of the self-timed test below, 160 sends, twice): at load average 3.0 lateness p50 0.60 ms,
# p99 3.6 ms, the worst 4.2 ms; at 0.6 p50 0.66, p99 2.3, the worst 4.2 ms. The closed loop's
# release-to-send wait: at most 0.03 ms. 10 ms leaves a margin for a slower CI machine.
SEND_LATE_S = 0.010
ATTEMPTS = 3  # a run on a machine too busy to meet the bound is repeated, each run judged alone


def _judged(attempt) -> None:  # type: ignore[no-untyped-def]
    """Runs `attempt` (returns (errors, figures)) up to ATTEMPTS times and passes at the first
    attempt without errors; every attempt's figures are printed, and all of them on failure."""
    seen = []
    for k in range(ATTEMPTS):
        errors, figures = attempt()
        seen.append(f"attempt {k + 1}: {figures}" + (f"; off: {'; '.join(errors)}" if errors else ""))
        print(seen[-1])
        if not errors:
            return
    pytest.fail("timing off in every attempt:\n" + "\n".join(seen))


class FakeSender:
    """Stands in for StreamingClient.send: sleeps, counts requests in flight, logs send times."""

    def __init__(self, service_s: float = 0.02) -> None:
        self.service_s = service_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.sent_at: dict[str, int] = {}

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        rec.sent_ns = time.monotonic_ns()
        self.sent_at[spec.request_id] = rec.sent_ns
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        rec.end_ns = time.monotonic_ns()
        return rec


def specs(n: int, arrivals: list[float] | None = None) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", "p", 4, arrival_s=None if arrivals is None else arrivals[i]) for i in range(n)]


def test_closed_loop_keeps_exactly_n_in_flight():
    def attempt():  # type: ignore[no-untyped-def]
        sender, done = FakeSender(), []
        recs = asyncio.run(drive(specs(12), sender.send, ArrivalPlan(concurrency=3), on_done=done.append))
        assert [r.request_id for r in recs] == [f"r{i}" for i in range(12)]
        assert sender.max_in_flight == 3 and len(done) == 12
        waits = [(r.sent_ns - r.scheduled_ns) / 1e9 for r in recs]  # closed loop: no client queue
        errors = [f"{r.request_id} waited {w * 1e3:.1f} ms" for r, w in zip(recs, waits) if not 0 <= w < SEND_LATE_S]
        return errors, f"longest wait between release and send {max(waits) * 1e3:.2f} ms"

    _judged(attempt)


def test_open_loop_cap_records_the_wait_for_a_slot():
    def attempt():  # type: ignore[no-untyped-def]
        sender = FakeSender(service_s=0.05)
        plan = ArrivalPlan(request_rate=math.inf, max_concurrency=2)
        recs = asyncio.run(drive(specs(6), sender.send, plan, offsets=[0.0] * 6))
        assert sender.max_in_flight == 2
        waits = sorted((r.sent_ns - r.scheduled_ns) / 1e9 for r in recs)
        assert waits[-1] > 0.09, waits  # the last pair waited for two rounds of 50 ms (only longer when busy)
        errors = [f"the first pair waited {w * 1e3:.1f} ms for a free slot" for w in waits[:2] if not w < SEND_LATE_S]
        return errors, "waits " + ", ".join(f"{w * 1e3:.1f}" for w in waits) + " ms"

    _judged(attempt)


def test_self_timed_offsets_are_kept():
    """The truth is the sender's own stamp of each send and a clock read just before the drive
    starts: each request is sent at its offset from that moment, never before, and at most
    SEND_LATE_S after."""
    offsets = [0.0, 0.15, 0.05, 0.30]

    def attempt():  # type: ignore[no-untyped-def]
        sender = FakeSender(service_s=0.01)
        started: list[RequestRecord] = []

        async def run() -> tuple[int, list[RequestRecord]]:
            t0 = time.monotonic_ns()
            return t0, await drive(specs(4, offsets), sender.send, ArrivalPlan(self_timed=True), started=started)

        t0, recs = asyncio.run(run())
        assert [r.request_id for r in started] == ["r0", "r2", "r1", "r3"]  # released in arrival order
        late = [(sender.sent_at[f"r{i}"] - t0) / 1e9 - off for i, off in enumerate(offsets)]
        errors = [f"r{i} sent {x * 1e3:+.2f} ms from its offset" for i, x in enumerate(late)
                  if not 0 <= x <= SEND_LATE_S]
        # the record's own stamps are the sender's, and its schedule is the offset from one start
        assert [r.sent_ns for r in recs] == [sender.sent_at[f"r{i}"] for i in range(4)]
        start = recs[0].scheduled_ns
        assert [r.scheduled_ns - start for r in recs] == [int(off * 1e9) for off in offsets]
        return errors, "sent after offset " + ", ".join(f"{x * 1e3:.2f}" for x in late) + " ms"

    _judged(attempt)
