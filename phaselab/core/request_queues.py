"""The request queues under the scheduler: which requests exist and in which state, and the KV
blocks they hold. `RequestQueues` is the bookkeeping `Scheduler` (core/scheduler.py) builds on;
the scheduling policy (who computes how many tokens) is there, and nothing here chooses.

    requests   every unfinished request, by id
    waiting    WAITING / PREEMPTED, in admission order (preempted ones at the front)
    running    RUNNING, in admission order: the last is the next victim of a preemption
    parked     prefill_only requests whose token is sampled (disaggregation): blocks kept

Requests come in through add_request (to `waiting`) and, on a decode worker of disaggregated
serving, add_prefilled_request (straight to `running`); finish_requests ends them in any state
(abort, stop string) and frees their blocks at once. The queries and the queue invariants
(check_invariants) are here too.

A request's length limit is min(its max_num_tokens, max_model_len, KV capacity + 1 tokens): a
request that could not fit even alone would otherwise preempt itself forever. With a cache of at
least max_model_len tokens (the engine's default sizing) max_model_len binds first. add_request
writes the effective limit back to request.max_num_tokens.

Disaggregated serving (docs/disaggregation.md) adds two entry points, both plain bookkeeping:

    prefill worker:  add_request(Request(prefill_only=True)) ─ prefill ─ token sampled ─▶ parked
                     (not scheduled, blocks kept: the KV awaits pickup) ── finish_requests ─▶ freed
    decode worker:   add_prefilled_request(request with prompt + outputs, all but the last token's
                     K/V computed elsewhere) ─▶ blocks allocated, RUNNING in decode at once; the
                     caller writes the received K/V into the returned blocks before schedule()

A parked request owns blocks but is neither running nor waiting: it never counts against
max_num_seqs and is never preempted (its blocks are what the decode side will read). A
pre-filled request is admitted only when its blocks fit with one token of headroom, nobody is
waiting (preempted requests first) and a seat is free; otherwise None: the caller retries later,
and that wait is the decode admission wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from phaselab.core.config import CacheConfig, SchedulerConfig
from phaselab.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, cdiv
from phaselab.core.request import Request, RequestStatus
from phaselab.errors import InvalidRequestError


class RequestQueues:
    """The requests of one scheduler by state, and their KV blocks (see the module docstring)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()  # WAITING / PREEMPTED, preempted ones at the front
        self.running: list[Request] = []  # RUNNING, in admission order: the last is the next victim
        # prefill_only requests whose token is sampled: blocks kept, never scheduled (disaggregation)
        self.parked: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # finished since the last plan

    # -- requests in --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        cfg, size = self.scheduler_config, self.cache_config.block_size
        num_prompt, num_blocks = request.num_prompt_tokens, self.kv_cache_manager.num_blocks
        if num_prompt >= cfg.max_model_len:
            raise InvalidRequestError(
                f"request {request.request_id!r}: the prompt has {num_prompt} tokens but max_model_len "
                f"is {cfg.max_model_len} (prompt + at least one output token); shorten the prompt or "
                "raise max_model_len"
            )
        if cdiv(num_prompt, size) > num_blocks:
            raise InvalidRequestError(
                f"request {request.request_id!r}: the prompt has {num_prompt} tokens and needs "
                f"{cdiv(num_prompt, size)} KV blocks of {size} tokens, but the whole cache holds "
                f"{num_blocks} blocks ({num_blocks * size} tokens); shorten the prompt or give the "
                "KV cache more memory (--kv-cache-memory)"
            )
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        limit = min(cfg.max_model_len, num_blocks * size + 1)
        if request.max_num_tokens is not None:
            limit = min(limit, request.max_num_tokens)
        assert limit > num_prompt
        request.max_num_tokens = limit
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests in any state (abort, stop string) and free their blocks now.
        Unknown or already finished ids are ignored. Returns the requests finished here."""
        assert status.is_finished
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        finished = []
        for rid in ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if rid in self.parked:
                del self.parked[rid]
            elif request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def add_prefilled_request(self, request: Request) -> list[int] | None:
        """Admit a request whose K/V were computed elsewhere (the decode side of disaggregated
        serving). `request.all_token_ids` is prompt + the outputs sampled so far; the K/V of all
        but the last token exist (num_tokens - 1 of them), so the request enters RUNNING in
        decode. Returns its block table, into which the caller writes the received K/V before
        the next schedule(), or None, changing nothing, when it cannot be admitted now: requests
        are waiting (preempted ones go first), max_num_seqs are running, or fewer blocks are free
        than its K/V plus one token need. The caller retries later (backpressure).
        """
        cfg, size = self.scheduler_config, self.cache_config.block_size
        rid, kv = request.request_id, self.kv_cache_manager
        num_computed = request.num_tokens - 1
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if request.num_tokens >= cfg.max_model_len:
            raise InvalidRequestError(
                f"request {rid!r}: {request.num_tokens} tokens (prompt + outputs) but max_model_len is "
                f"{cfg.max_model_len} on this worker; raise max_model_len")
        if cdiv(num_computed + 1, size) > kv.num_blocks:
            raise InvalidRequestError(
                f"request {rid!r}: its K/V ({num_computed} tokens) need {cdiv(num_computed + 1, size)} KV blocks "
                f"of {size} tokens, but this worker's whole cache holds {kv.num_blocks}; give the decode "
                "workers more KV memory (--kv-cache-memory)")
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        assert request.num_output_tokens >= 1, "a pre-filled request carries the token its prefill sampled"
        if self.waiting or len(self.running) >= cfg.max_num_seqs:
            return None
        if cdiv(num_computed + 1, size) > kv.block_pool.num_free_blocks:
            return None
        limit = min(cfg.max_model_len, kv.num_blocks * size + 1)
        if request.max_num_tokens is not None:
            limit = min(limit, request.max_num_tokens)
        assert limit > request.num_tokens  # else its prefill worker would have finished it
        request.max_num_tokens = limit
        block_ids = kv.allocate_slots(request, num_computed, record_query=False)
        assert block_ids is not None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        request.num_cached_tokens = 0
        self.requests[rid] = request
        self.running.append(request)
        return block_ids

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status  # set first: a finished request's free() also drops its hashes
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # -- queries ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def has_schedulable_requests(self) -> bool:
        """Anything for schedule() to do (parked requests only wait to be freed)."""
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        return self.requests.get(request_id)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.stats

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Asserts what must hold of the queues between steps (Scheduler.check_invariants adds the
        plan's; tests call it after every step)."""
        cfg, kv = self.scheduler_config, self.kv_cache_manager
        kv.check_invariants()  # ref count == number of tables holding the block, for every block
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        parked_ids = set(self.parked)
        assert len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting)
        assert not running_ids & waiting_ids and not parked_ids & (running_ids | waiting_ids)
        assert running_ids | waiting_ids | parked_ids == set(self.requests)
        assert set(kv.req_to_blocks) == running_ids | parked_ids, "only running (and parked) requests hold blocks"
        for r in self.parked.values():
            assert r.status == RequestStatus.RUNNING and r.prefill_only and r.num_tokens_to_compute == 1
            assert len(kv.req_to_blocks[r.request_id]) == cdiv(r.num_computed_tokens, kv.block_size)
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert len(kv.req_to_blocks[r.request_id]) == cdiv(r.num_computed_tokens, kv.block_size)
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0
        assert len(self.running) <= cfg.max_num_seqs
