"""Request placement for the disaggregated router: the routed-request record and the workers it is on.

`RoutedRequest` is the router's state of one request. `Placement` puts requests on workers and
takes them off: `pick` chooses a prefill or decode worker with a routing policy (core/routing) over
the workers' loads (WorkerLoad: the tokens each worker was given, a dead worker never picked);
`to_prefill` / `to_decode` number the routing with a new attempt, count its load and send the
message that starts it there (WorkerRequest, TransferSpec); `release` leaves no state of a request
on any worker (its KV lease freed, aborted where it runs, its loads dropped). What happens when no
worker is left or one dies (fail, re-prefill, re-route) is the router's (router.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phaselab.core.outputs import TokenLogprobs
from phaselab.core.routing import RoutingPolicy, WorkerLoad
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import RequestMetrics
from phaselab.disagg.connector import KVSource
from phaselab.disagg.messages import TransferSpec, WorkerRequest
from phaselab.disagg.process import WorkerHandle


@dataclass
class RoutedRequest:
    """The router's state of one request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    metrics: RequestMetrics
    deadline_ns: int | None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    phase: str = "prefill"  # "prefill" | "decode" | "finished"
    prefill_worker: str | None = None
    decode_worker: str | None = None
    kv: KVSource | None = None  # its KV, leased on a prefill worker, until a decode worker acked it
    loads: dict[str, int] = field(default_factory=dict)  # worker -> tokens counted in its WorkerLoad
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    dirty: bool = False
    num_reprefills: int = 0
    num_reroutes: int = 0
    attempt: int = 0  # a new one at every routing (Placement.next_attempt); workers tag their events with it
    sampler_state: bytes | None = None  # random generator after the prefill's draw (travels with the KV)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def is_current(self, w: WorkerHandle, attempt: int) -> bool:
        """An event of worker `w` about the request's current routing (not a stale one from an earlier attempt)."""
        where = (self.prefill_worker if self.phase == "prefill"
                 else self.decode_worker if self.phase == "decode" else None)
        return attempt == self.attempt and where == w.name and self.phase == w.role


class Placement:
    """Which worker holds each request, over the router's workers (the same dict: deaths show)."""

    def __init__(self, workers: dict[str, WorkerHandle]) -> None:
        self.workers = workers
        self.loads = {name: WorkerLoad(name, w.role) for name, w in workers.items()}
        self._attempt_seq = 0

    def pick(self, policy: RoutingPolicy, role: str, r: RoutedRequest) -> str | None:
        """A worker of `role` for the request by `policy`, or None when none of them is alive."""
        return policy.pick([self.loads[n] for n, w in self.workers.items() if w.role == role], r.num_tokens)

    def to_prefill(self, r: RoutedRequest, name: str) -> None:
        r.phase, r.prefill_worker, r.decode_worker, r.kv = "prefill", name, None, None
        r.attempt = self.next_attempt()
        self.load(r, name, r.num_tokens)
        w = self.workers[name]
        w.actor.add_request.remote(WorkerRequest(
            r.request_id, r.prompt_token_ids, r.params, r.metrics.arrived_ns + w.clock_offset_ns,
            list(r.output_token_ids), r.attempt))

    def to_decode(self, r: RoutedRequest, name: str) -> None:
        assert r.kv is not None
        r.phase, r.decode_worker = "decode", name
        r.attempt = self.next_attempt()
        self.load(r, name, r.num_tokens)
        w = self.workers[name]
        w.actor.admit.remote(TransferSpec(
            r.request_id, r.prompt_token_ids, list(r.output_token_ids), r.params, r.kv,
            r.metrics.arrived_ns + w.clock_offset_ns, r.attempt, r.sampler_state))

    def next_attempt(self) -> int:
        """Attempt numbers increase over the router's life (not per request): a worker can tell a
        stale message from a new one even when a request id is reused."""
        self._attempt_seq += 1
        return self._attempt_seq

    def load(self, r: RoutedRequest, worker: str, num_tokens: int) -> None:
        self.loads[worker].add(num_tokens)
        r.loads[worker] = num_tokens

    def unload(self, r: RoutedRequest, worker: str | None) -> None:
        if worker is not None and worker in r.loads:
            self.loads[worker].remove(r.loads.pop(worker))

    def release(self, r: RoutedRequest) -> None:
        """Leave no state on any worker: free a lease, abort where it runs, drop its loads."""
        if r.kv is not None:
            src = self.workers.get(r.kv.worker)
            if src is not None and src.alive:
                src.actor.release_kv.remote(r.request_id, "released", r.kv.attempt)
            r.kv = None
        if r.phase == "prefill":
            self.abort_on(r, r.prefill_worker)
        elif r.phase == "decode":
            self.abort_on(r, r.decode_worker)
        for worker in list(r.loads):
            self.unload(r, worker)

    def abort_on(self, r: RoutedRequest, worker: str | None) -> None:
        w = self.workers.get(worker) if worker else None
        if w is not None and w.alive:
            w.actor.abort.remote([r.request_id], r.attempt)

    def deaths(self, role: str) -> str:
        """The dead workers of a role and why (for the messages of requests that found none alive)."""
        dead = [f"{w.name} ({w.death})" for w in self.workers.values() if w.role == role and not w.alive]
        total = sum(1 for w in self.workers.values() if w.role == role)
        return f"{len(dead)} of {total} {role} workers are dead: " + "; ".join(dead) if dead else f"{total} configured"
