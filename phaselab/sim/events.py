"""The virtual clock: a heap of timed callbacks, run in time order.

    push(t, priority, fn, *args) ─▶ heap ordered by (t, priority, insertion) ─▶ run(): now = t; fn(*args)

Time is an int in nanoseconds, like the engine's `time.monotonic_ns()` stamps, so a simulated
run's records have the same types and units as a real one. At equal times the priority decides:
arrivals and finished transfers are seen before a worker's iteration boundary at that instant, so
an iteration that starts at t schedules everything that reached its worker by t (the real engine
admits what arrived before it calls schedule()).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

# Priorities at equal times (lower first).
ARRIVAL = 0
TRANSFER = 1
STEP_END = 2
STEP_START = 3


class EventQueue:
    def __init__(self, start_ns: int = 0) -> None:
        self.now = start_ns
        self._heap: list[tuple[int, int, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.num_events = 0

    def push(self, time_ns: int, priority: int, fn: Callable[..., Any], *args: Any) -> None:
        assert time_ns >= self.now, f"event at {time_ns} is in the past (now {self.now})"
        self._seq += 1
        heapq.heappush(self._heap, (time_ns, priority, self._seq, fn, args))

    def run(self, until_ns: int | None = None) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap:
            if until_ns is not None and heap[0][0] > until_ns:
                return
            t, _, _, fn, args = pop(heap)
            self.now = t
            self.num_events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)
