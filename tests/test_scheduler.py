"""The scheduler alone, driven by a fake executor that checks the KV it reads.

The fake executor keeps a (position, token) pair per KV slot. For every scheduled chunk it first
checks that the slots of all earlier positions, read through the plan's block table, hold exactly
the request's own tokens (so a wrong prefix hit, a shared block overwritten, or a stale table is
caught), then writes the chunk, and samples a token that is a function of the context it read.
Outputs are thus a function of the prompt alone, whatever the scheduling: the reference for
"preempted = not preempted", "prefix hit = cold", "chunked = prefill-first".
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections import defaultdict

import pytest

from phaselab.core.config import CacheConfig, SchedulerConfig
from phaselab.core.outputs import RequestDelta, SchedulerOutput, StepResult, TokenLogprobs
from phaselab.core.request import Request, RequestStatus
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.scheduler import Scheduler
from phaselab.errors import InvalidRequestError


def context_token(context: tuple[int, ...]) -> int:
    """The fake model: the next token is a deterministic function of the whole context."""
    return 100 + hash(context) % 900


def reference_output(prompt: list[int], params: SamplingParams, eos: frozenset[int], max_num_tokens: int) -> list[int]:
    """What a request must produce, computed without any scheduler."""
    tokens, out = list(prompt), []
    while True:
        t = context_token(tuple(tokens))
        tokens.append(t)
        out.append(t)
        if len(out) >= params.min_tokens and (t in params.stop_token_ids or (not params.ignore_eos and t in eos)):
            return out
        if len(tokens) >= max_num_tokens:
            return out


class Harness:
    def __init__(
        self,
        policy: str = "chunked",
        *,
        block_size: int = 4,
        num_blocks: int = 256,
        budget: int = 64,
        max_num_seqs: int = 16,
        max_model_len: int = 64,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
        slo_ttft_ms: float = 0.0,
    ) -> None:
        self.sched = Scheduler(
            SchedulerConfig(
                policy=policy,
                max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                long_prefill_token_threshold=long_prefill_token_threshold,
                max_num_partial_prefills=max_num_partial_prefills,
                slo_ttft_ms=slo_ttft_ms,
            ),
            CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
        )
        self.block_size = block_size
        self.requests: dict[str, Request] = {}  # every request ever added (aborted ones too)
        self.slots: dict[int, list[tuple[int, int] | None]] = defaultdict(lambda: [None] * block_size)
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finish_reasons: dict[str, str] = {}
        self.plans: list[SchedulerOutput] = []
        self.clock = 0.0  # seconds: the arrival_time of add() and the `now` of step(), one per step

    def add(self, rid: str, prompt: list[int], eos: frozenset[int] = frozenset(), **params) -> Request:
        params.setdefault("max_tokens", 8)
        req = Request(rid, prompt, SamplingParams(**params), eos_token_ids=eos,
                      max_model_len=self.sched.scheduler_config.max_model_len, arrival_time=self.clock)
        self.sched.add_request(req)
        self.requests[rid] = req
        return req

    def execute(self, plan: SchedulerOutput) -> StepResult:
        bs = self.block_size
        result = StepResult(plan.iteration_id)
        for s in plan.scheduled:
            truth = self.requests[s.request_id].all_token_ids
            assert s.token_ids == truth[s.start_position : s.context_len]
            assert len(s.block_ids) == math.ceil(s.context_len / bs)
            for p in range(s.start_position):  # read the cached context
                assert self.slots[s.block_ids[p // bs]][p % bs] == (p, truth[p]), f"{s.request_id}: bad KV at {p}"
            for i, t in enumerate(s.token_ids):  # write the chunk
                p = s.start_position + i
                self.slots[s.block_ids[p // bs]][p % bs] = (p, t)
            if s.sample:
                context = tuple(self.slots[s.block_ids[p // bs]][p % bs][1] for p in range(s.context_len))  # type: ignore[index]
                token = context_token(context)
                result.sampled_token_ids[s.request_id] = token
                result.logprobs[s.request_id] = TokenLogprobs(token, -0.5, 1)
        return result

    def step(self) -> tuple[SchedulerOutput, list[RequestDelta]]:
        plan = self.sched.schedule(self.clock)
        deltas = self.sched.update(plan, self.execute(plan))
        self.sched.check_invariants()
        self.record(plan, deltas)
        self.clock += 1.0
        return plan, deltas

    def record(self, plan: SchedulerOutput, deltas: list[RequestDelta]) -> None:
        self.plans.append(plan)
        for d in deltas:
            assert d.request_id not in self.finish_reasons
            self.outputs[d.request_id].extend(d.new_token_ids)
            if d.finish_reason is not None:
                self.finish_reasons[d.request_id] = d.finish_reason

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")

    def expected(self, rid: str) -> list[int]:
        r = self.requests[rid]
        assert r.max_num_tokens is not None
        return reference_output(r.prompt_token_ids, r.sampling_params, r.eos_token_ids, r.max_num_tokens)

    def assert_all_blocks_free(self) -> None:
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(ref == 0 for ref in pool.ref_cnt)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 97 + 1 for i in range(n)]


# -- basics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["chunked", "prefill-first"])
def test_requests_run_to_length_and_free_everything(policy):
    h = Harness(policy)
    for i in range(5):
        h.add(f"r{i}", prompt(3 + 5 * i, i), max_tokens=4 + i, ignore_eos=True)
    h.run()
    for i in range(5):
        assert h.outputs[f"r{i}"] == h.expected(f"r{i}")
        assert len(h.outputs[f"r{i}"]) == 4 + i and h.finish_reasons[f"r{i}"] == "length"
    h.assert_all_blocks_free()
    assert h.sched.num_running == h.sched.num_waiting == 0


def test_plan_fields_and_delta_contents():
    h = Harness(block_size=4, budget=6)
    h.add("a", prompt(10), max_tokens=2)
    plan, deltas = h.step()
    (s,) = plan.scheduled
    assert (s.start_position, s.num_tokens, s.sample, s.is_prefill, s.num_output_tokens) == (0, 6, False, True, 0)
    assert s.block_ids == s.new_block_ids and len(s.block_ids) == 2
    assert plan.num_used_blocks == 2 and plan.num_free_blocks == 254
    assert deltas == []
    plan, deltas = h.step()
    (s2,) = plan.scheduled
    assert (s2.start_position, s2.num_tokens, s2.sample, s2.is_prefill) == (6, 4, True, True)
    assert s2.block_ids == s.block_ids + s2.new_block_ids and len(s2.new_block_ids) == 1
    (d,) = deltas
    assert d.request_id == "a" and len(d.new_token_ids) == 1 and d.finish_reason is None
    assert d.logprobs is not None and d.logprobs.token_id == d.new_token_ids[0]
    plan, deltas = h.step()
    (s3,) = plan.scheduled
    assert (s3.start_position, s3.num_tokens, s3.sample, s3.is_prefill, s3.num_output_tokens) == (10, 1, True, False, 1)
    assert deltas[0].finish_reason == "length"
    plan, _ = h.step()
    assert plan.is_empty and plan.finished_request_ids == ["a"]


def test_iteration_ids_increment_for_every_plan_including_empty_ones():
    h = Harness()
    ids = [h.step()[0].iteration_id for _ in range(3)]
    assert ids == [0, 1, 2]
    h.add("a", prompt(4), max_tokens=1)
    assert h.step()[0].iteration_id == 3


def test_stop_token_eos_min_tokens_and_ignore_eos():
    h = Harness()
    p = prompt(5)
    ref = reference_output(p, SamplingParams(max_tokens=6, ignore_eos=True), frozenset(), len(p) + 6)
    stop_at, eos_at = ref[2], ref[1]
    assert len({stop_at, eos_at}) == 2 and eos_at not in ref[2:] and stop_at not in ref[:2]
    h.add("stop", p, stop_token_ids=[stop_at], max_tokens=6)
    h.add("eos", p, eos=frozenset({eos_at}), max_tokens=6)
    h.add("ignore", p, eos=frozenset({eos_at}), ignore_eos=True, max_tokens=6)
    h.add("min", p, eos=frozenset({eos_at}), min_tokens=3, max_tokens=6)
    h.run()
    assert h.outputs["stop"] == ref[:3] and h.finish_reasons["stop"] == "stop"
    assert h.requests["stop"].stop_reason == stop_at
    assert h.outputs["eos"] == ref[:2] and h.finish_reasons["eos"] == "stop"
    assert h.requests["eos"].stop_reason is None
    assert h.outputs["ignore"] == ref and h.finish_reasons["ignore"] == "length"
    assert h.outputs["min"] == ref and h.finish_reasons["min"] == "length"  # eos before min_tokens
    h.assert_all_blocks_free()


def test_length_is_capped_by_max_model_len():
    h = Harness(max_model_len=12)
    r = h.add("a", prompt(10), max_tokens=None, ignore_eos=True)
    h.run()
    assert r.num_tokens == 12 and h.finish_reasons["a"] == "length"


# -- rejection ------------------------------------------------------------------------------
def test_too_long_prompt_is_rejected_and_others_are_served():
    h = Harness(max_model_len=16, block_size=4, num_blocks=3)
    h.add("ok1", prompt(5), max_tokens=3)
    with pytest.raises(InvalidRequestError, match=r"16 tokens.*max_model_len is 16"):
        h.add("long", prompt(16))
    with pytest.raises(InvalidRequestError, match=r"13 tokens and needs 4 KV blocks of 4 tokens.*3 blocks"):
        h.add("big", prompt(13))
    with pytest.raises(InvalidRequestError, match="already in use"):
        h.add("ok1", prompt(3))
    h.add("ok2", prompt(6, 1), max_tokens=3)
    h.run()
    assert h.finish_reasons == {"ok1": "length", "ok2": "length"}
    assert h.sched.get_request("long") is None and h.sched.get_request("big") is None
    h.assert_all_blocks_free()


def test_length_is_capped_by_kv_capacity():
    h = Harness(block_size=4, num_blocks=3, max_model_len=64)  # 12 token slots
    r = h.add("a", prompt(10), max_tokens=20, ignore_eos=True)
    assert r.max_num_tokens == 13  # the 13th token is sampled but never needs a slot
    h.run()
    assert r.num_tokens == 13 and h.finish_reasons["a"] == "length"
    assert h.outputs["a"] == h.expected("a")


# -- the deterministic scenario of issue 3 --------------------------------------------------
def _eight_decoding(policy: str, budget: int) -> Harness:
    h = Harness(policy, block_size=16, num_blocks=1024, budget=budget, max_model_len=4096)
    for i in range(8):
        h.add(f"d{i}", prompt(10, i), max_tokens=100, ignore_eos=True)
    h.step()
    assert all(not r.is_prefill for r in h.sched.running) and h.sched.num_running == 8
    return h


def test_scenario_prefill_first_freezes_the_streams_for_one_iteration():
    h = _eight_decoding("prefill-first", budget=4096)
    h.add("long", prompt(2048, 99), max_tokens=4, ignore_eos=True)
    plan, _ = h.step()
    assert plan.num_prefill_tokens == 2048 and plan.num_decode_tokens == 0
    assert [s.request_id for s in plan.scheduled] == ["long"] and plan.scheduled[0].sample
    plan, _ = h.step()
    assert plan.num_prefill_tokens == 0 and plan.num_decode_tokens == 9
    h.run()
    assert all(h.outputs[rid] == h.expected(rid) for rid in h.requests)


def test_scenario_chunked_keeps_every_decode_in_every_iteration():
    budget = 256
    h = _eight_decoding("chunked", budget=budget)
    h.add("long", prompt(2048, 99), max_tokens=4, ignore_eos=True)
    prefill_iterations = 0
    while h.sched.get_request("long") is not None and h.sched.get_request("long").num_output_tokens == 0:
        plan, _ = h.step()
        assert plan.num_tokens <= budget
        assert plan.num_decode_tokens == 8
        assert {s.request_id for s in plan.scheduled if not s.is_prefill} == {f"d{i}" for i in range(8)}
        assert plan.num_prefill_tokens in (budget - 8, 2048 % (budget - 8))
        prefill_iterations += 1
    assert prefill_iterations == math.ceil(2048 / (budget - 8)) == 9
    h.run()
    assert all(h.outputs[rid] == h.expected(rid) for rid in h.requests)


# -- chunking rules -------------------------------------------------------------------------
def test_long_prefill_threshold_caps_chunks():
    h = Harness(budget=64, long_prefill_token_threshold=5, max_num_partial_prefills=2)
    h.add("a", prompt(12), max_tokens=1)
    h.add("b", prompt(12, 1), max_tokens=1)
    plan, _ = h.step()
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 5), ("b", 5)]
    plan, _ = h.step()
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 5), ("b", 5)]
    plan, _ = h.step()
    assert [(s.request_id, s.num_tokens, s.sample) for s in plan.scheduled] == [("a", 2, True), ("b", 2, True)]


def test_partial_prefill_limit_is_fcfs():
    h = Harness(budget=64, long_prefill_token_threshold=8, max_num_partial_prefills=1)
    h.add("a", prompt(20), max_tokens=1)
    h.add("b", prompt(20, 1), max_tokens=1)  # would also be left partial: waits
    h.add("c", prompt(3, 2), max_tokens=1)  # would complete, but does not overtake b
    plan, _ = h.step()
    assert [s.request_id for s in plan.scheduled] == ["a"]
    plan, _ = h.step()
    assert [s.request_id for s in plan.scheduled] == ["a"]
    plan, _ = h.step()  # a completes with 4 tokens; b may now be left partial, c completes
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 4), ("b", 8), ("c", 3)]


def test_max_num_seqs_limits_admission():
    h = Harness(max_num_seqs=2)
    for i in range(4):
        h.add(f"r{i}", prompt(3, i), max_tokens=3, ignore_eos=True)
    plan, _ = h.step()
    assert [s.request_id for s in plan.scheduled] == ["r0", "r1"] and h.sched.num_waiting == 2
    h.run()
    assert all(len(h.outputs[f"r{i}"]) == 3 for i in range(4))


# -- preemption -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["chunked", "prefill-first"])
@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_resumes_with_identical_outputs(policy, prefix):
    def run(num_blocks: int) -> Harness:
        h = Harness(policy, block_size=4, num_blocks=num_blocks, budget=64, enable_prefix_caching=prefix)
        for i in range(4):
            h.add(f"r{i}", prompt(10, i), max_tokens=20, ignore_eos=True)
        h.run()
        h.assert_all_blocks_free()
        return h

    small, large = run(num_blocks=12), run(num_blocks=256)
    assert small.sched.num_preemptions_total > 0 and large.sched.num_preemptions_total == 0
    assert any(r.num_preemptions > 0 for r in small.requests.values())
    assert sum(r.num_preemptions for r in small.requests.values()) == small.sched.num_preemptions_total
    preempted = {rid for plan in small.plans for rid in plan.preempted_request_ids}
    assert preempted == {rid for rid, r in small.requests.items() if r.num_preemptions}
    for rid in large.requests:
        assert small.outputs[rid] == large.outputs[rid] == large.expected(rid)


def test_victim_is_the_most_recently_admitted():
    # each request needs 3 blocks to finish; 5 blocks: the second admitted gets preempted
    h = Harness(block_size=4, num_blocks=5, budget=64, max_num_seqs=2)
    h.add("first", prompt(4), max_tokens=6, ignore_eos=True)
    h.add("second", prompt(4, 1), max_tokens=6, ignore_eos=True)
    h.add("third", prompt(4, 2), max_tokens=6, ignore_eos=True)  # waits for a seat
    while not h.sched.num_preemptions_total:
        plan, _ = h.step()
    assert plan.preempted_request_ids == ["second"] and [s.request_id for s in plan.scheduled] == ["first"]
    second = h.requests["second"]
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert second.num_preemptions == 1
    assert list(h.sched.waiting) == [second, h.requests["third"]]  # back at the front
    h.run()
    for rid in ("first", "second", "third"):
        assert h.outputs[rid] == h.expected(rid)


def test_resumed_request_recomputes_before_sampling():
    h = Harness(block_size=2, num_blocks=6, budget=3, enable_prefix_caching=False)
    h.add("a", prompt(2), max_tokens=9, ignore_eos=True)
    h.add("b", prompt(2, 1), max_tokens=9, ignore_eos=True)
    while not h.sched.num_preemptions_total:
        h.step()
    b = h.requests["b"]
    n_out = b.num_output_tokens
    assert n_out > 0
    while b.num_computed_tokens < b.num_tokens - 1 or b.status != RequestStatus.RUNNING:
        plan, deltas = h.step()
        assert "b" not in {d.request_id for d in deltas}  # no sampling while recomputing
    h.run()
    assert h.outputs["b"] == h.expected("b")


# -- prefix caching -------------------------------------------------------------------------
def test_second_request_skips_the_cached_prefix():
    h = Harness(block_size=4)
    shared = prompt(9)
    h.add("a", shared + [1, 2], max_tokens=2)
    h.run()
    b = h.add("b", shared + [3, 4, 5], max_tokens=2)
    plan, _ = h.step()
    (s,) = plan.scheduled
    assert s.start_position == 8 and b.num_cached_tokens == 8 and s.token_ids == b.prompt_token_ids[8:]
    stats = h.sched.prefix_cache_stats
    assert (stats.num_queries, stats.num_hit_tokens, stats.num_hit_blocks) == (2, 8, 2)
    assert stats.num_query_tokens == 11 + 12
    h.run()
    assert h.outputs["b"] == h.expected("b")


def test_prefix_hit_while_the_owner_is_running_shares_blocks():
    h = Harness(block_size=4)
    shared = prompt(12)
    h.add("a", shared + [1], max_tokens=6, ignore_eos=True)
    h.step()
    h.add("b", shared + [2], max_tokens=6, ignore_eos=True)
    plan, _ = h.step()
    sb = next(s for s in plan.scheduled if s.request_id == "b")
    sa = next(s for s in plan.scheduled if s.request_id == "a")
    assert sb.start_position == 12 and sb.block_ids[:3] == sa.block_ids[:3]
    h.run()
    assert h.outputs["a"] == h.expected("a") and h.outputs["b"] == h.expected("b")
    h.assert_all_blocks_free()


def test_no_prefix_hits_when_disabled():
    h = Harness(block_size=4, enable_prefix_caching=False)
    h.add("a", prompt(9), max_tokens=2)
    h.run()
    b = h.add("b", prompt(9) + [1], max_tokens=2)
    plan, _ = h.step()
    assert plan.scheduled[0].start_position == 0 and b.num_cached_tokens == 0
    assert h.sched.prefix_cache_stats.num_queries == 0


@pytest.mark.parametrize("caching", [True, False])
def test_repeats_count_the_prefix_an_earlier_request_began_with_cache_on_or_off(caching):
    """Repeats are counted from the token ids themselves: the full blocks of a prompt that an
    earlier request's prompt (or finished sequence: a follow-up turn) began with; with caching on
    they equal the hits here (nothing evicted), with it off they are what the cache would skip."""
    h = Harness(block_size=4, enable_prefix_caching=caching)
    shared = prompt(9)
    a = h.add("a", shared + [1, 2], max_tokens=3, ignore_eos=True)
    h.run()
    b = h.add("b", shared + [3, 4, 5], max_tokens=2)  # 2 full blocks of the 9 shared tokens
    c = h.add("c", prompt(9, 1), max_tokens=2)  # another prompt: nothing repeated
    follow = h.add("d", a.all_token_ids + [7, 7, 7], max_tokens=2)  # the next turn of a's conversation
    h.run()
    assert (a.num_repeat_tokens, b.num_repeat_tokens, c.num_repeat_tokens) == (0, 8, 0)
    assert follow.num_repeat_tokens == 12  # a's prompt and output: 14 tokens, 3 full blocks
    assert b.num_cached_tokens == (8 if caching else 0)
    assert h.outputs["b"] == h.expected("b") and h.outputs["d"] == h.expected("d")
    h.assert_all_blocks_free()


# -- abort ----------------------------------------------------------------------------------
def test_abort_in_every_state():
    h = Harness(max_num_seqs=1)
    h.add("run", prompt(5), max_tokens=10)
    h.add("wait", prompt(5, 1), max_tokens=10)
    h.step()
    assert h.sched.get_request("run").status == RequestStatus.RUNNING
    done = h.sched.finish_requests(["wait", "run", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["wait", "run"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    h.sched.check_invariants()
    h.assert_all_blocks_free()
    assert h.sched.finish_requests("run", RequestStatus.FINISHED_ABORTED) == []  # already finished
    plan, _ = h.step()
    assert plan.finished_request_ids == ["wait", "run"] and plan.is_empty
    assert not h.sched.has_unfinished_requests()


def test_abort_between_schedule_and_update_drops_the_result():
    h = Harness()
    h.add("a", prompt(5), max_tokens=10)
    h.add("b", prompt(5, 1), max_tokens=10)
    plan = h.sched.schedule()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    result = h.execute(plan)
    deltas = h.sched.update(plan, result)
    h.sched.check_invariants()
    assert [d.request_id for d in deltas] == ["b"]
    assert h.sched.get_request("a") is None
    plan, _ = h.step()
    assert plan.finished_request_ids == ["a"] and [s.request_id for s in plan.scheduled] == ["b"]


def test_stop_string_finish_via_finish_requests():
    h = Harness()
    h.add("a", prompt(5), max_tokens=10)
    h.step()
    (r,) = h.sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert r.status.finish_reason == "stop"
    h.assert_all_blocks_free()


# -- core/ stays pure -------------------------------------------------------------------------
def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "import phaselab.core.scheduler, phaselab.core.block_pool, phaselab.core.kv_cache_manager\n"
        "import phaselab.core.request, phaselab.core.outputs\n"
        "assert 'torch' not in sys.modules, 'core imported torch'\n"
        "assert 'numpy' not in sys.modules, 'core imported numpy'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
