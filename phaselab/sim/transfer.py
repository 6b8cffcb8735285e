"""KV transfers as flows on links: bandwidth, latency, and fair sharing between concurrent flows.

    prefill worker P ──tx:P──▶ (link) ──rx:D──▶ decode worker D

Every worker has a transmit and a receive port (full duplex), each with the capacity of its link:
`bandwidth x tp` for links with one port per GPU (NVLink, PCIe, GPUDirect InfiniBand: each GPU
sends its own shard of the KV heads), `bandwidth` for one NIC per instance (Ethernet). A flow
crosses the sender's tx port and the receiver's rx port; concurrent flows share ports max-min
fairly (progressive filling: the most constrained port is split evenly first, and what its flows
cannot use goes to the others). A flow may also carry its own rate cap: a layer-by-layer transfer
cannot send K/V faster than the prefill produces them (see loop.py). Rates are recomputed whenever a
flow starts, ends or changes its cap; a flow's bytes are done when its remaining bytes reach 0, and
its data has arrived `latency` later.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from phaselab.sim.events import TRANSFER, EventQueue

NS = 1_000_000_000


@dataclass(eq=False)
class Flow:
    flow_id: int
    src: str  # tx port
    dst: str  # rx port
    num_bytes: int
    on_done: Callable[[Flow], None]
    latency_ns: int = 0
    cap: float | None = None  # bytes/s this flow may not exceed (None: none)
    remaining: float = 0.0
    rate: float = 0.0
    start_ns: int = 0
    done_ns: int | None = None  # last byte arrived (latency included)
    version: int = 0  # completion events of older rate assignments are stale
    tag: object = field(default=None, repr=False)


class Network:
    def __init__(self, events: EventQueue) -> None:
        self.events = events
        self.capacity: dict[str, float] = {}
        self.flows: dict[int, Flow] = {}
        self._next_id = 0
        self._last_ns = events.now
        self.bytes_moved = 0

    def add_port(self, name: str, bandwidth: float) -> None:
        assert bandwidth > 0, f"port {name}: bandwidth must be > 0"
        self.capacity[name] = bandwidth

    def start(self, src: str, dst: str, num_bytes: int, on_done: Callable[[Flow], None], latency_s: float = 0.0,
              cap: float | None = None, tag: object = None) -> Flow:
        now = self.events.now
        self._advance(now)
        self._next_id += 1
        flow = Flow(self._next_id, src, dst, num_bytes, on_done, round(latency_s * NS), cap, float(num_bytes),
                    start_ns=now, tag=tag)
        if num_bytes <= 0:
            self.events.push(now + flow.latency_ns, TRANSFER, self._on_arrived, flow)
            return flow
        self.flows[flow.flow_id] = flow
        self._reallocate()
        return flow

    def set_cap(self, flow: Flow, cap: float | None) -> None:
        if flow.flow_id not in self.flows or flow.cap == cap:
            return
        self._advance(self.events.now)
        flow.cap = cap
        self._reallocate()

    # -- internals -------------------------------------------------------------------------------
    def _advance(self, now: int) -> None:
        dt = (now - self._last_ns) / NS
        if dt > 0:
            for f in self.flows.values():
                f.remaining = max(0.0, f.remaining - f.rate * dt)
        self._last_ns = now

    def _reallocate(self) -> None:
        """Max-min fair rates by progressive filling, then (re)schedule every completion."""
        active = [f for f in self.flows.values() if f.remaining > 0]
        left = dict(self.capacity)
        users: dict[str, int] = {}
        for f in active:
            users[f.src] = users.get(f.src, 0) + 1
            users[f.dst] = users.get(f.dst, 0) + 1
        unfixed = set(range(len(active)))
        while unfixed:
            share = min(left[p] / n for p, n in users.items() if n > 0)
            capped = [i for i in unfixed
                      if active[i].cap is not None and active[i].cap <= share]  # type: ignore[operator]
            if capped:
                fixed = capped  # a flow limited by its own cap takes less than the fair share
            else:
                bottlenecks = {p for p, n in users.items() if n > 0 and left[p] / n <= share * (1 + 1e-12)}
                fixed = [i for i in unfixed if active[i].src in bottlenecks or active[i].dst in bottlenecks]
            for i in fixed:
                f = active[i]
                f.rate = f.cap if capped else share  # type: ignore[assignment]
                for p in (f.src, f.dst):
                    left[p] = max(0.0, left[p] - f.rate)
                    users[p] -= 1
                unfixed.discard(i)
        now = self.events.now
        for f in active:
            f.version += 1
            eta = now + max(1, math.ceil(f.remaining / f.rate * NS)) if f.rate > 0 else None
            if eta is not None:
                self.events.push(eta, TRANSFER, self._on_bytes_done, f, f.version)

    def _on_bytes_done(self, flow: Flow, version: int) -> None:
        if version != flow.version or flow.flow_id not in self.flows:
            return  # a later reallocation replaced this estimate
        self._advance(self.events.now)
        flow.remaining = 0.0
        del self.flows[flow.flow_id]
        self.bytes_moved += flow.num_bytes
        self._reallocate()
        arrival = self.events.now + flow.latency_ns
        self.events.push(arrival, TRANSFER, self._on_arrived, flow)

    def _on_arrived(self, flow: Flow) -> None:
        flow.done_ns = self.events.now
        flow.on_done(flow)
