"""The scheduler: which requests compute how many tokens in each iteration.

    add_request ──▶ waiting ──schedule──▶ running ──update: stop / length──▶ finished
                       ▲                     │
                       └── front ◀─ preempt ─┘     finish_requests (abort, stop string): any state

One iteration is `plan = schedule()`, `result = executor.execute(plan)`, `update(plan, result)`.
`schedule()` advances each scheduled request's num_computed_tokens right away (as vLLM v1 does),
so the next plan can be built from the counters alone; `update()` appends the sampled tokens,
checks stops, registers the blocks the step filled in the prefix cache, and frees finished
requests. A request is in prefill or decode only by its counters (see Request.is_prefill).

Policies (SchedulerConfig.policy):

- `chunked` (default, decode-first). One pass over `running` in admission order: a request in
  decode gets its one token; a request mid-prefill (or recomputing after a preemption) gets a
  chunk of min(tokens left, budget left minus one token for each decode not yet served,
  long_prefill_token_threshold if set), so every decode is served before any prefill token is
  spent. Then, unless this iteration preempted someone, waiting requests are admitted in FCFS
  order (preempted ones at the front) with chunks of the same rule from the remaining budget.
  At most `max_num_partial_prefills` requests may be left mid-prefill at the end of an
  iteration. FCFS is strict: when the head of the queue cannot be admitted (budget, seqs,
  blocks, partial-prefill limit), nobody behind it is, so the head is never starved.
- `prefill-first`. If the head of the waiting queue can be admitted with its whole remaining
  prompt, the iteration admits waiting requests (FCFS, whole prompts) while budget, seqs and
  blocks allow and schedules no decode token; otherwise it gives every running request its
  decode token. No request is ever left mid-prefill (the config guarantees
  max_num_batched_tokens >= max_model_len).

Adaptive budget (SchedulerConfig.slo_tbt_ms > 0, chunked only): before serving, the iteration's
prefill tokens are capped by core/adaptive_budget.py's choose_prefill_budget, from the running decodes, the
pending prefill segments (partial prefills in running order, then the waiting requests that have
a seat, each from its prefix-cache hit and capped by long_prefill_token_threshold) and the cost
coefficients the engine last fitted (`set_cost_coefficients`). The rules above are unchanged: the
cap only lowers how many prefill tokens the budget leaves. The decision rides on the plan
(`plan.budget`) for the iteration record.

Prefill order (SchedulerConfig.slo_ttft_ms > 0 and schedule(now)): the waiting queue is kept in
core/adaptive_budget.py's prefill_rank order instead of FCFS: requests resuming after a preemption first, then
those that have waited half their TTFT target (FCFS), then the shortest remaining prompt. With the
chunked policy a request mid-prefill yields to the head of that queue when the head ranks before
it (a short prompt that arrived during a long one's chunks): the admissions take the budget first
and the yielding prefill gets what is left (and, when the head did not fit and nothing else was
scheduled, preempts as a running request does: otherwise no block would free up). FCFS strictness holds in the new order. Without a
target, or without the caller's clock, the order is FCFS as above.

Preemption by recompute: when a running request cannot get the block its step needs, the most
recently admitted running request is preempted (possibly itself): its blocks are freed, its
num_computed_tokens goes back to 0 and it goes to the front of the waiting queue. On resume it
recomputes prompt + generated tokens (its own registered blocks may be prefix hits) and samples
only once all of them are computed, so its output is unchanged. Admission never preempts, and an
iteration that preempted admits nobody (it has just run out of blocks). Victims always come from
the not-yet-scheduled tail of `running`, so nothing scheduled in this iteration is undone.

Decisions where the spec was silent (the request queues' own, such as the length limit, are in
core/request_queues.py, with the disaggregated entry points add_prefilled_request and `parked`):
- Every schedule() call gets a new iteration id, empty plans included: an empty plan still
  carries finished_request_ids that executors must see. update() is optional for an empty plan.
- A request aborted between schedule() and update() is dropped from the step's results; its
  blocks are freed at once (the synchronous engine loop finishes the step before the next
  schedule() can reuse them).
"""

from __future__ import annotations

import itertools
from collections import deque

from phaselab.core.config import CacheConfig, SchedulerConfig
from phaselab.core.outputs import RequestDelta, ScheduledRequest, SchedulerOutput, StepResult
from phaselab.core.request import Request, RequestStatus
from phaselab.core.request_queues import RequestQueues
from phaselab.core.adaptive_budget import BudgetDecision, choose_prefill_budget, prefill_rank
from phaselab.cost.iteration_cost import IterationCostCoefficients, chunk_cost, largest_chunk_within


class Scheduler(RequestQueues):
    """The policy over RequestQueues' bookkeeping: schedule() plans an iteration, update() applies it."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 cost_coefficients: IterationCostCoefficients | None = None) -> None:
        super().__init__(scheduler_config, cache_config)
        self.iteration_id = -1  # id of the last plan
        self.num_preemptions_total = 0
        self._in_flight: dict[str, Request] = {}  # the last plan's requests, until update()
        self._last_plan: SchedulerOutput | None = None
        # the adaptive budget's cost model, refitted by the caller from measured iterations; all
        # zero (every budget fits) until the first fit
        self.cost_coefficients = cost_coefficients or IterationCostCoefficients()
        self._prefill_left = 0  # prefill tokens this iteration may still schedule
        # predicted seconds of prefill this iteration may still add (adaptive, feasible), else None
        self._time_left: float | None = None
        self._yielding: set[str] = set()  # mid-prefill requests served after the admissions (TTFT order)

    def set_cost_coefficients(self, coefficients: IterationCostCoefficients) -> None:
        """The adaptive budget's cost model for the next schedule() (the engine refits it)."""
        self.cost_coefficients = coefficients

    # -- schedule -----------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """The next iteration's plan. `now`: the caller's clock, on the scale of the requests'
        arrival_time (seconds); with a TTFT target it orders the prefills (_order_prefills), and
        without it (or without a target) the order is FCFS."""
        assert not self._in_flight, "schedule() called before update() of the previous plan"
        self.iteration_id += 1
        plan = SchedulerOutput(iteration_id=self.iteration_id, block_size=self.cache_config.block_size)
        budget = self._prefill_left = self.scheduler_config.max_num_batched_tokens
        self._time_left = None
        self._yielding = self._order_prefills(now)
        if self.scheduler_config.adaptive:
            plan.budget = decision = self._choose_budget()
            self._prefill_left = decision.prefill_budget
            if decision.feasible and decision.reason in ("target", "all-prefill-fits"):
                # The token budget was planned from each waiting request's prefix hit; this
                # iteration's own allocations may evict a cached block first, so each chunk is
                # also held to the time left, priced from its actual start.
                c = self.cost_coefficients
                contexts = [r.num_computed_tokens + 1 for r in self.running if not r.is_prefill]
                self._time_left = decision.limit_s - c.overhead_s - c.decode_seq_s * len(contexts) \
                    - c.decode_context_s * sum(contexts)
                if c.wide_rows and len(contexts) + decision.prefill_budget > c.wide_rows:
                    self._time_left -= c.wide_s  # the budget was planned in the batched GEMM's regime
        if self.scheduler_config.policy == "prefill-first":
            self._schedule_waiting(plan, budget, whole_prompts=True)
            if not plan.scheduled:
                self._schedule_running(plan, budget)
        else:
            budget = self._schedule_running(plan, budget)
            if not plan.preempted_request_ids:
                budget = self._schedule_waiting(plan, budget, whole_prompts=False)
            if self._yielding:
                self._schedule_yielded(plan, budget)
        plan.finished_request_ids, self._finished_ids = self._finished_ids, []
        plan.num_free_blocks = self.kv_cache_manager.block_pool.num_free_blocks
        plan.num_used_blocks = self.kv_cache_manager.block_pool.num_used_blocks
        self._in_flight = {s.request_id: self.requests[s.request_id] for s in plan.scheduled}
        self._last_plan = plan
        return plan

    def _order_prefills(self, now: float | None) -> set[str]:
        """With a TTFT target and the caller's clock, put the waiting queue in core/adaptive_budget.py's
        prefill_rank order (resuming first, then those that waited half their target, FCFS, then
        the shortest remaining prompt) and return the running mid-prefill requests that yield this
        iteration's prefill tokens to the head of that queue (they are served after the
        admissions, from what budget is left: _schedule_yielded). Without either: FCFS, nobody
        yields."""
        cfg = self.scheduler_config
        if cfg.slo_ttft_ms <= 0 or now is None or not self.waiting:
            return set()
        ttft_s = cfg.slo_ttft_ms / 1e3

        def rank(r: Request, position: int | None = None) -> tuple[int, float, float]:
            return prefill_rank(r.arrival_time, r.num_tokens_to_compute, now, ttft_s, position)

        ranked = sorted(((rank(r, i if r.status == RequestStatus.PREEMPTED else None), i, r)
                         for i, r in enumerate(self.waiting)), key=lambda kir: kir[:2])
        self.waiting = deque(r for _, _, r in ranked)
        if cfg.policy != "chunked" or len(self.running) >= cfg.max_num_seqs:
            return set()  # no seat: the head waits whatever the running prefills do
        head = ranked[0][0]
        return {r.request_id for r in self.running if r.is_prefill and head < rank(r)}

    def _choose_budget(self) -> BudgetDecision:
        """The adaptive prefill budget of this iteration (core/adaptive_budget.py), from the counters; the
        pending prefills in the order they will be served (partial prefills in running order, the
        waiting requests with a seat, the partial prefills yielding to them)."""
        cfg = self.scheduler_config
        cap = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
        decodes: list[int] = []
        segments: list[tuple[int, int]] = []
        yielded: list[tuple[int, int]] = []
        for r in self.running:
            if r.is_prefill:
                seg = (r.num_computed_tokens, min(r.num_tokens_to_compute, cap))
                (yielded if r.request_id in self._yielding else segments).append(seg)
            else:
                decodes.append(r.num_computed_tokens + 1)  # its one query attends its whole context
        pending = sum(n for _, n in segments)
        for r in itertools.islice(self.waiting, max(0, cfg.max_num_seqs - len(self.running))):
            if pending >= cfg.max_num_batched_tokens:
                break
            _, num_hit = self.kv_cache_manager.get_computed_blocks(r)
            segments.append((num_hit, min(r.num_tokens - num_hit, cap)))
            pending += segments[-1][1]
        segments += yielded
        return choose_prefill_budget(self.cost_coefficients, decodes, segments, cfg.slo_tbt_ms / 1e3,
                                     cfg.slo_margin, cfg.slo_min_chunk, cfg.max_num_batched_tokens)

    def _schedule_running(self, plan: SchedulerOutput, budget: int) -> int:
        """Serve running requests in admission order; decodes first by budget reservation.
        Returns the budget left."""
        num_decodes_left = sum(1 for r in self.running if not r.is_prefill)  # not yet served
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            is_decode = not request.is_prefill
            if is_decode:
                num_decodes_left -= 1
                num_new = 1
            elif request.request_id in self._yielding:
                i += 1  # served after the admissions it yields to (_schedule_yielded)
                continue
            else:
                num_new = self._chunk_size(request.num_tokens_to_compute, budget - num_decodes_left,
                                           request.num_computed_tokens)
                if num_new == 0:
                    i += 1
                    continue
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()  # most recently admitted; never one served already
                if victim is not request and not victim.is_prefill:
                    num_decodes_left -= 1
                self._preempt(victim, plan)
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # the request preempted itself: it was the last one running
            self._add_scheduled(plan, request, num_new, new_block_ids, is_prefill=not is_decode)
            budget -= num_new
            i += 1
        return budget

    def _schedule_yielded(self, plan: SchedulerOutput, budget: int) -> int:
        """The mid-prefill requests that yielded to waiting ones (_order_prefills): chunks from the
        budget left, in running order. Nobody is preempted for them while anything else runs this
        iteration (that work frees blocks as it finishes): one whose blocks do not fit waits for the
        next. When nothing else was scheduled -- the head they yielded to did not fit either -- the
        most recently admitted running request is preempted as _schedule_running does, or no block
        would ever free up (hypothesis found two mid-prefill requests holding the whole cache, each
        waiting for a block, behind a preempted head)."""
        for request in self.running:
            if budget <= 0:
                break
            if request.request_id not in self._yielding:
                continue
            num_new = self._chunk_size(request.num_tokens_to_compute, budget, request.num_computed_tokens)
            if num_new == 0:
                continue
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_block_ids is None and not plan.scheduled:  # nothing scheduled: no victim undoes work
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            self._add_scheduled(plan, request, num_new, new_block_ids, is_prefill=True)
            budget -= num_new
        return budget

    def _schedule_waiting(self, plan: SchedulerOutput, budget: int, whole_prompts: bool) -> int:
        """Admit waiting requests in strict FCFS order. Returns the budget left."""
        cfg = self.scheduler_config
        num_partial = sum(1 for r in self.running if self._is_partial(r))
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            hit_block_ids, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_to_compute = request.num_tokens - num_hit_tokens
            if whole_prompts:
                if num_to_compute > budget:
                    break
                num_new = num_to_compute
            else:
                num_new = self._chunk_size(num_to_compute, budget, num_hit_tokens)
                if num_new == 0:
                    break  # the adaptive budget allows no more prefill in this iteration
            left_partial = self._leaves_partial(request, num_to_compute - num_new)
            if left_partial and num_partial >= cfg.max_num_partial_prefills:
                break
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new, hit_block_ids)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:  # first admission
                request.num_cached_tokens = num_hit_tokens
                request.num_repeat_tokens = self.kv_cache_manager.count_repeats(request)
            self.running.append(request)
            # Before the step nothing is computed: an admission is a prefill (also a resume).
            self._add_scheduled(plan, request, num_new, new_block_ids, is_prefill=True)
            num_partial += left_partial
            budget -= num_new
        return budget

    def _chunk_size(self, num_to_compute: int, budget: int, start: int) -> int:
        num_new = min(num_to_compute, budget, self._prefill_left)
        if self.scheduler_config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.scheduler_config.long_prefill_token_threshold)
        if self._time_left is not None and num_new > 0:
            num_new = largest_chunk_within(self.cost_coefficients, start, num_new, self._time_left)
        return max(num_new, 0)

    @staticmethod
    def _leaves_partial(request: Request, num_left: int) -> bool:
        """Would `num_left` uncomputed tokens leave the request mid-prefill? One token left
        after an output exists is a decode step (a resumed request catching up), not a prefill."""
        return num_left > 1 or (num_left == 1 and request.num_output_tokens == 0)

    @classmethod
    def _is_partial(cls, request: Request) -> bool:
        return cls._leaves_partial(request, request.num_tokens_to_compute)

    def _add_scheduled(
        self, plan: SchedulerOutput, request: Request, num_new: int, new_block_ids: list[int], is_prefill: bool
    ) -> None:
        start = request.num_computed_tokens
        plan.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.all_token_ids[start : start + num_new],
                start_position=start,
                block_ids=list(self.kv_cache_manager.req_to_blocks[request.request_id]),
                new_block_ids=new_block_ids,
                sample=start + num_new == request.num_tokens,
                is_prefill=is_prefill,
                sampling_params=request.sampling_params,
                num_output_tokens=request.num_output_tokens,
            )
        )
        request.num_computed_tokens += num_new
        if is_prefill:
            self._prefill_left -= num_new
            if self._time_left is not None:
                self._time_left -= chunk_cost(self.cost_coefficients, num_new, start)

    def _preempt(self, request: Request, plan: SchedulerOutput) -> None:
        # Its full computed blocks were registered by update(): they stay cached while free.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        plan.preempted_request_ids.append(request.request_id)

    # -- results in ---------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, result: StepResult) -> list[RequestDelta]:
        """Apply one executed plan: returns one delta per request that got a token or finished."""
        assert plan.iteration_id == result.iteration_id == self.iteration_id, "update() of a stale plan"
        in_flight, self._in_flight = self._in_flight, {}
        deltas = []
        for scheduled in plan.scheduled:
            request = in_flight.get(scheduled.request_id)
            if request is None or request.is_finished:
                continue  # finished (aborted) after schedule(): its result is dropped
            self.kv_cache_manager.cache_blocks(request, scheduled.context_len)
            if not scheduled.sample:
                continue
            rid = request.request_id
            assert rid in result.sampled_token_ids, f"the executor sampled no token for {rid}"
            token_id = result.sampled_token_ids[rid]
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self._finish(request, status)
            elif request.prefill_only:
                self.parked[rid] = request  # its KV waits for a decode worker; out of `running` below
            deltas.append(
                RequestDelta(
                    request_id=rid,
                    new_token_ids=[token_id],
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=result.logprobs.get(rid),
                )
            )
        self.running = [r for r in self.running if not r.is_finished and r.request_id not in self.parked]
        return deltas

    @staticmethod
    def _check_stop(request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        assert request.max_num_tokens is not None  # set by add_request
        if request.num_tokens >= request.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Asserts what must hold between steps (tests call it after every one): the queues', then
        the partial prefills' and the last plan's."""
        super().check_invariants()
        cfg = self.scheduler_config
        num_partial = sum(1 for r in self.running if self._is_partial(r))
        if cfg.policy == "prefill-first":
            assert num_partial == 0, "prefill-first left a request mid-prefill"
        else:
            assert num_partial <= cfg.max_num_partial_prefills
        plan = self._last_plan
        if plan is not None:
            assert plan.num_tokens <= cfg.max_num_batched_tokens
            assert len(plan.scheduled) <= cfg.max_num_seqs
            assert len({s.request_id for s in plan.scheduled}) == len(plan.scheduled)
            if cfg.policy == "prefill-first":
                assert not (plan.num_prefill_tokens and plan.num_decode_tokens), "mixed prefill-first plan"
            if plan.budget is not None:
                assert plan.num_prefill_tokens <= plan.budget.prefill_budget, "the adaptive budget was exceeded"
