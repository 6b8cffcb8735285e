"""The phase recorder: the one place that applies the time vocabulary (core/timing.py) to a loop.

Every loop that runs the scheduler (LLMEngine.step, the disaggregated router, the simulator)
drives one PhaseRecorder; the same plan therefore yields the same record fields whichever loop
ran it. The recorder never reads a clock: every stamp is passed in by the loop (the engine's
`time.monotonic_ns()`, the simulator's virtual clock).

    open(request)  ─▶  stamp_step(plan, deltas, start, end)  (per iteration: preempted, scheduled
         │              chunks, tokens sampled)  ─▶  stamp_sent(record, sent)  (delivery)
         │          ─▶  finish(id, reason, finished_ns)  ─┬─ finished_ns given: close now
         │                                                └─ None: await mark_delivered(id, sent)
         ├─ admit(record, request, admitted): decode admission of a request prefilled elsewhere
         └─ drop(id): forgotten without a record (a parked request whose KV left, or a resumed copy)
    iteration(plan, ..., predicted_s) ─▶ IterationRecord (+ the adaptive budget's decision, core/adaptive_budget.py)
    add_iteration(rec): one built elsewhere (a worker's)

Closing a record sets `finished_ns` (never before its last token was sent) and then applies the
policy chosen at construction:

    keep=True     closed records and iterations are kept (`requests`, `iterations`) for a run
                  directory, and observed (Prometheus)
    keep=False    observed, then dropped: a long-running server without --record holds only the
                  records of requests in flight
    closes=False  records are stamped but never observed nor kept (a disaggregated worker: the
                  router assembles and closes the one record of each request)
    enabled=False no iteration records, no observation, nothing kept (to measure what recording costs)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from phaselab.core.outputs import RequestDelta, SchedulerOutput
from phaselab.core.adaptive_budget import budget_fields
from phaselab.core.timing import IterationRecord, RequestMetrics, ScheduledChunk, with_split
from phaselab.cost.formulas import ModeledCost


class HasCachedTokens(Protocol):
    @property
    def num_cached_tokens(self) -> int: ...

    @property
    def num_repeat_tokens(self) -> int: ...


@dataclass
class _Open:
    metrics: RequestMetrics
    request: HasCachedTokens | None  # the scheduler's Request: its prefix-cache hits at first schedule


class PhaseRecorder:
    def __init__(self, worker: str, role: str, *, keep: bool = True, closes: bool = True,
                 on_finished: Callable[[RequestMetrics], None] | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None) -> None:
        self.worker, self.role = worker, role
        self.keep = keep
        self.closes = closes
        self.enabled = True
        self.on_finished = on_finished
        self.on_iteration = on_iteration
        self.requests: list[RequestMetrics] = []  # closed records (keep=True)
        self.iterations: list[IterationRecord] = []  # (keep=True)
        self._open: dict[str, _Open] = {}
        self._awaiting_delivery: dict[str, RequestMetrics] = {}

    # -- requests in -----------------------------------------------------------------------------
    def open(self, request_id: str, num_prompt_tokens: int, *, arrived_ns: int, tokenized_ns: int | None,
             queued_ns: int | None, request: HasCachedTokens | None = None, worker: str | None = None
             ) -> RequestMetrics:
        """A new record: arrived, tokenized (None: not tokenized here), queued (None: not queued here)."""
        m = RequestMetrics(arrived_ns=arrived_ns, tokenized_ns=tokenized_ns, queued_ns=queued_ns,
                           request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                           worker=self.worker if worker is None else worker)
        self._open[request_id] = _Open(m, request)
        return m

    def adopt(self, m: RequestMetrics, request: HasCachedTokens | None = None) -> RequestMetrics:
        """A record begun elsewhere (e.g. a decode worker's, pre-stamped with its KV transfer)."""
        self._open[m.request_id] = _Open(m, request)
        return m

    def admit(self, m: RequestMetrics, request: HasCachedTokens | None, admitted_ns: int) -> RequestMetrics:
        """A request whose prefill ran elsewhere is admitted for decode (disaggregated serving):
        decode admitted now; its first schedule and first token happened no later (a decode
        worker's own record has neither: they are set to now, so its first step is neither queue
        nor prefill, and a preemption's recomputation counts as such)."""
        m.decode_admitted_ns = admitted_ns
        if m.first_scheduled_ns is None:
            m.first_scheduled_ns = admitted_ns
        if m.first_token_sampled_ns is None:
            m.first_token_sampled_ns = admitted_ns
        return self.adopt(m, request)

    def get(self, request_id: str) -> RequestMetrics | None:
        entry = self._open.get(request_id)
        return entry.metrics if entry is not None else None

    def drop(self, request_id: str) -> None:
        """Forget an open record without closing it (no record, no observation)."""
        self._open.pop(request_id, None)

    # -- one iteration ---------------------------------------------------------------------------
    def stamp_step(self, plan: SchedulerOutput, deltas: Iterable[RequestDelta], start_ns: int, end_ns: int
                   ) -> list[str]:
        """Phase stamps of one iteration; returns the ids whose first token it sampled.

        A chunk spans its iteration: from before schedule() (start_ns) to the end of the forward
        pass and sampling (end_ns), which is also when its tokens count as sampled. The first
        schedule ends the queue; the first after a preemption is the resume; a prefill chunk
        before the first token counts as prefill, one after it as recompute."""
        tracked = self._open
        for rid in plan.preempted_request_ids:
            if (entry := tracked.get(rid)) is not None:
                entry.metrics.stamp_preempted(start_ns)
        iteration_id = plan.iteration_id
        for s in plan.scheduled:
            if (entry := tracked.get(s.request_id)) is not None:
                req = entry.request
                cached, repeat = (req.num_cached_tokens, req.num_repeat_tokens) if req is not None else (0, 0)
                entry.metrics.stamp_scheduled(iteration_id, start_ns, end_ns, len(s.token_ids), s.is_prefill, cached,
                                              repeat)
        firsts = []
        for d in deltas:
            n = len(d.new_token_ids)
            if not n or (entry := tracked.get(d.request_id)) is None:
                continue
            m = entry.metrics
            if n == 1:
                m.token_sampled_ns.append(end_ns)
                m.token_iteration_ids.append(iteration_id)
            else:
                m.token_sampled_ns.extend([end_ns] * n)
                m.token_iteration_ids.extend([iteration_id] * n)
            if m.first_token_sampled_ns is None:
                m.first_token_sampled_ns = end_ns
                firsts.append(d.request_id)
        return firsts

    def iteration(self, plan: SchedulerOutput, *, start_ns: int, end_ns: int, prepare_ns: int, forward_ns: int,
                  sample_ns: int, num_running: int, num_waiting: int, modeled: ModeledCost,
                  schedule_ns: int = 0, output_ns: int = 0, worker: str | None = None, role: str | None = None,
                  predicted_s: float | None = None, split_ns: dict[str, int] | None = None) -> IterationRecord | None:
        """The IterationRecord of one non-empty iteration, observed and (keep) kept."""
        if plan.is_empty or not self.enabled:
            return None
        num_prefill = num_decode = 0
        chunks = []
        for s in plan.scheduled:
            n = len(s.token_ids)
            if s.is_prefill:
                num_prefill += n
            else:
                num_decode += n
            chunks.append(ScheduledChunk(s.request_id, n, s.is_prefill, s.start_position + n))
        rec = with_split(IterationRecord(
            iteration_id=plan.iteration_id, worker=self.worker if worker is None else worker,
            role=self.role if role is None else role, start_ns=start_ns, end_ns=end_ns, schedule_ns=schedule_ns,
            prepare_ns=prepare_ns, forward_ns=forward_ns, sample_ns=sample_ns, output_ns=output_ns,
            num_prefill_tokens=num_prefill, num_decode_tokens=num_decode, chunks=chunks,
            num_blocks_used=plan.num_used_blocks, num_blocks_free=plan.num_free_blocks,
            num_running=num_running, num_waiting=num_waiting,
            preempted_request_ids=list(plan.preempted_request_ids), modeled=modeled,
            **budget_fields(plan, predicted_s)), split_ns)
        self.add_iteration(rec)
        return rec

    def add_iteration(self, rec: IterationRecord) -> None:
        """Observe and (keep) keep an iteration record (the router: one a worker built)."""
        if not self.enabled:
            return
        if self.on_iteration is not None:
            self.on_iteration(rec)
        if self.keep:
            self.iterations.append(rec)

    # -- delivery and the end of a request -----------------------------------------------------------
    @staticmethod
    def stamp_sent(m: RequestMetrics, sent_ns: int, num_tokens: int | None = None) -> int:
        """`num_tokens` (None: every) sampled-but-unsent tokens were handed over at sent_ns; returns how many."""
        n = len(m.token_sampled_ns) - len(m.token_sent_ns)
        if num_tokens is not None:
            n = min(n, num_tokens)
        if n > 0:
            m.token_sent_ns.extend([sent_ns] * n)
        return max(n, 0)

    def finish(self, request_id: str, reason: str | None, num_output_tokens: int, finished_ns: int | None, *,
               error: str | None = None, metrics: RequestMetrics | None = None) -> RequestMetrics | None:
        """The request ended: close its record at `finished_ns` (offline: its last token was just
        handed over), or, when a server delivers the tokens (None), once it calls mark_delivered."""
        entry = self._open.pop(request_id, None)
        m = entry.metrics if entry is not None else metrics
        if m is None:
            return None
        m.finish_reason = reason
        m.num_output_tokens = num_output_tokens
        if error is not None:
            m.error = error
        if finished_ns is None:
            self._awaiting_delivery[request_id] = m
        else:
            self._close(m, finished_ns)
        return m

    def mark_delivered(self, request_id: str, sent_ns: int) -> None:
        """A finished request's last bytes were written at `sent_ns`: close its record."""
        m = self._awaiting_delivery.pop(request_id, None)
        if m is not None:
            self._close(m, sent_ns)

    def _close(self, m: RequestMetrics, finished_ns: int) -> None:
        m.finished_ns = max(finished_ns, m.token_sent_ns[-1] if m.token_sent_ns else finished_ns)
        if not (self.enabled and self.closes):
            return
        if self.on_finished is not None:
            self.on_finished(m)
        if self.keep:
            self.requests.append(m)

    # -- what it holds (a server without --record must hold only what is in flight) ------------------
    def stats(self) -> dict[str, int]:
        return {"num_open": len(self._open), "num_awaiting_delivery": len(self._awaiting_delivery),
                "num_kept_requests": len(self.requests), "num_kept_iterations": len(self.iterations)}
