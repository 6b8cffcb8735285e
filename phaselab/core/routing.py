"""Placement of disaggregated requests: which prefill worker computes a prompt, which decode
worker continues it. Pure Python (no clock, no global random source): the router of
`phaselab/disagg/` applies a policy to the live loads it tracks, the simulator to simulated ones.

    request ──pick(prefill loads, prompt tokens)──▶ prefill worker ── first token sampled
                                                        │
            ◀── decode worker ◀──pick(decode loads, context tokens)──┘

A load is counted in requests and in tokens of outstanding work, the unit that decides each
role's cost:

- prefill: prompt tokens routed to the worker and not yet prefilled (compute-bound: time grows
  with the tokens to compute);
- decode: tokens of context (KV) the worker holds or is about to receive for its requests
  (bandwidth- and memory-bound: every step reads all of it, and it is what fills the cache).

Policies are small classes with one method, chosen by name (`make_routing_policy`); a caller may
pass any object with the same `pick`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from phaselab.errors import ConfigError


@dataclass
class WorkerLoad:
    """What the router knows about one worker's outstanding work."""

    name: str
    role: str  # "prefill" | "decode"
    num_requests: int = 0  # requests routed to it and not done there
    num_tokens: int = 0  # outstanding work in tokens (see the module docstring)
    alive: bool = True

    def add(self, num_tokens: int) -> None:
        self.num_requests += 1
        self.num_tokens += num_tokens

    def remove(self, num_tokens: int) -> None:
        self.num_requests -= 1
        self.num_tokens -= num_tokens
        assert self.num_requests >= 0 and self.num_tokens >= 0, f"negative load on {self.name}: {self}"


class RoutingPolicy(ABC):
    """Picks one worker among candidates of one role; None when none is alive."""

    name: ClassVar[str]

    @abstractmethod
    def pick(self, candidates: Sequence[WorkerLoad], num_tokens: int) -> str | None:
        """`num_tokens`: the work this request brings (prompt tokens for a prefill worker,
        context tokens for a decode worker)."""


class LeastOutstandingWork(RoutingPolicy):
    """The live worker with the fewest outstanding tokens; ties go to fewer requests, then to
    the earlier worker in the list (deterministic)."""

    name = "least-outstanding"

    def pick(self, candidates: Sequence[WorkerLoad], num_tokens: int) -> str | None:
        live = [(w.num_tokens, w.num_requests, i, w.name) for i, w in enumerate(candidates) if w.alive]
        return min(live)[3] if live else None


class RoundRobin(RoutingPolicy):
    """Live workers in turn, whatever their load (a baseline)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[WorkerLoad], num_tokens: int) -> str | None:
        n = len(candidates)
        for k in range(n):
            w = candidates[(self._next + k) % n]
            if w.alive:
                self._next = (self._next + k + 1) % n
                return w.name
        return None


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (LeastOutstandingWork, RoundRobin)}


def make_routing_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ConfigError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
