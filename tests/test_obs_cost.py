"""Modeled cost of an iteration against hand computation, plus the obs/ package's purity rules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
from phaselab.core.sampling_params import SamplingParams
from phaselab.cost.formulas import ModeledCost
from phaselab.cost.formulas import keys_attended, modeled_cost
from phaselab.modelinfo.model_config import ModelConfig


def tiny(tied: bool) -> ModelConfig:
    # q_size = 2 x 4 = 8, kv_size = 1 x 4 = 4
    return ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=tied,
    )


def entry(rid: str, start: int, n: int, sample: bool, is_prefill: bool) -> ScheduledRequest:
    return ScheduledRequest(rid, list(range(n)), start, [0], [], sample, is_prefill, SamplingParams())


def mixed_plan() -> SchedulerOutput:
    """A mid-prompt prefill chunk (3 tokens after a 4-token prefix, no sample) + two decodes."""
    return SchedulerOutput(iteration_id=7, scheduled=[
        entry("p", start=4, n=3, sample=False, is_prefill=True),
        entry("d1", start=7, n=1, sample=True, is_prefill=False),
        entry("d2", start=2, n=1, sample=True, is_prefill=False),
    ])


# Hand computation shared by both tests (dtype_bytes = 2, T = 5 tokens, 2 sampled rows):
#   per-layer params  = 8*(8+4+4) + 8*8 + 3*8*16 + 2*8 = 128 + 64 + 384 + 16 = 592
#   num_parameters    = 2*592 + 32*8 (+ 32*8 if untied) + 8 = 1448 tied, 1704 untied
#   kv bytes / token  = 2 (K,V) * 2 layers * 4 * 2 bytes = 32
#   kv_write          = 5 * 32 = 160
#   kv_read           = (4 [chunk: prefix] + 8 [d1: 7+1] + 3 [d2: 2+1]) * 32 = 480
#   linear MACs/layer = 128 + 64 + 384 = 576
#   matmul_flops      = 2*5*2*576 + 2*2*8*32 = 11520 + 1024 = 12544
#   keys attended     = (3*4 + 3*4/2) + 8 + 3 = 18 + 8 + 3 = 29
#   attention_flops   = 2 layers * 4 * 2 heads * 4 head_dim * 29 = 1856


def test_hand_worked_iteration_tied() -> None:
    cost = modeled_cost(tiny(tied=True), mixed_plan(), dtype_bytes=2)
    assert cost == ModeledCost(
        weight_bytes=2896,  # 1448 * 2: the tied table is read whole by the LM head
        kv_read_bytes=480, kv_write_bytes=160, matmul_flops=12544, attention_flops=1856,
    )
    assert cost.total_bytes == 3536 and cost.flops == 14400


def test_hand_worked_iteration_untied() -> None:
    cost = modeled_cost(tiny(tied=False), mixed_plan(), dtype_bytes=2)
    # (1704 - 256 table + 5 rows * 8) * 2 = 1488 * 2
    assert cost == ModeledCost(
        weight_bytes=2976, kv_read_bytes=480, kv_write_bytes=160, matmul_flops=12544, attention_flops=1856,
    )


def test_whole_prompt_prefill_fp32() -> None:
    # one 6-token prompt from scratch, sampled: reads no KV, attends 6*7/2 = 21 keys
    plan = SchedulerOutput(iteration_id=0, scheduled=[entry("p", start=0, n=6, sample=True, is_prefill=True)])
    cost = modeled_cost(tiny(tied=True), plan, dtype_bytes=4)
    assert cost == ModeledCost(
        weight_bytes=1448 * 4,
        kv_read_bytes=0,
        kv_write_bytes=6 * 64,  # kv bytes/token in fp32 = 2*2*4*4 = 64
        matmul_flops=2 * 6 * 2 * 576 + 2 * 1 * 8 * 32,  # 13824 + 512
        attention_flops=2 * 4 * 2 * 4 * 21,  # 1344
    )


def test_empty_plan_costs_nothing() -> None:
    assert modeled_cost(tiny(tied=False), SchedulerOutput(iteration_id=0), dtype_bytes=2) == ModeledCost()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=2, max_value=64), min_size=1, max_size=6))
def test_chunking_keeps_attention_flops_but_rereads_the_prefix(chunk_sizes: list[int]) -> None:
    """Causal keys add up over chunks, so attention FLOPs do not depend on chunking; each chunk
    re-reads the prefix written by the chunks before it."""
    n = sum(chunk_sizes)
    starts = [sum(chunk_sizes[:k]) for k in range(len(chunk_sizes))]
    assert sum(keys_attended(c, s) for c, s in zip(chunk_sizes, starts)) == keys_attended(n, 0) == n * (n + 1) // 2
    config = tiny(tied=True)
    costs = [modeled_cost(config, SchedulerOutput(0, [entry("p", s, c, False, True)]), 2)
             for c, s in zip(chunk_sizes, starts)]
    whole = modeled_cost(config, SchedulerOutput(0, [entry("p", 0, n, False, True)]), 2)
    assert sum(c.attention_flops for c in costs) == whole.attention_flops
    assert sum(c.kv_write_bytes for c in costs) == whole.kv_write_bytes
    assert sum(c.kv_read_bytes for c in costs) == sum(starts) * config.kv_bytes_per_token(2)


def test_obs_imports_no_torch() -> None:
    code = (
        "import sys, phaselab.obs, phaselab.obs.prometheus, phaselab.obs.perfetto, "
        "phaselab.obs.rundir; assert 'torch' not in sys.modules, 'phaselab.obs pulled in torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_cost_imports_no_torch() -> None:
    """Every module of the cost package loads without torch: the scheduler prices plans with it, and
    the simulator and the analysis run where torch is not installed."""
    root = Path(__file__).parents[1]
    modules = sorted(f"phaselab.cost.{p.stem}" for p in (root / "phaselab" / "cost").glob("*.py") if p.stem != "__init__")
    assert "phaselab.cost.formulas" in modules and "phaselab.cost.online_fit" in modules
    code = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules, 'phaselab.cost pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_obs_reads_no_clock_except_the_creation_date() -> None:
    """Callers pass timestamps (the simulator runs on a virtual clock); only config.json is dated."""
    clocks = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
              "now", "utcnow", "today"}
    obs = Path(__file__).parents[1] / "phaselab" / "obs"
    calls = set()
    for file in obs.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in clocks:
                    calls.add((file.name, ast.unparse(func)))
    assert calls == {("rundir.py", "datetime.now")}


def _shared_prefix_plans(prefixes, picks, block_size):
    """Plans of a real scheduler with the prefix cache, one request arriving per step over a few
    shared prefixes (a later one finds the earlier ones' blocks cached)."""
    from phaselab.core.config import CacheConfig, SchedulerConfig
    from phaselab.core.outputs import StepResult
    from phaselab.core.request import Request
    from phaselab.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(policy="chunked", max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128),
                      CacheConfig(block_size=block_size, num_blocks=256, enable_prefix_caching=True))
    heads = [[1000 * (k + 1) + j for j in range(n)] for k, n in enumerate(prefixes)]
    for step in range(300):
        if step < len(picks):  # each: a shared prefix, its own tail, tokens to make
            k, own, out = picks[step]
            prompt = heads[k % len(heads)] + [10 * step + j for j in range(own)]
            sched.add_request(Request(f"r{step}", prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                                      max_model_len=128))
        plan = sched.schedule()
        if plan.is_empty and step >= len(picks):
            break
        yield plan
        sched.update(plan, StepResult(plan.iteration_id, {e.request_id: 7 for e in plan.scheduled if e.sample}))
    assert not sched.has_unfinished_requests()


def _slot_rereads(plan, block_size) -> int:
    """The independent count: each K/V slot an entry reads, looked up in the physical (block,
    offset) it lives in; a slot an earlier entry of the plan read counts once per re-read."""
    slots_read: set[tuple[int, int]] = set()
    repeats = 0
    for e in plan.scheduled:
        for p in range(e.start_position + (1 if len(e.token_ids) == 1 else 0)):
            slot = (e.block_ids[p // block_size], p % block_size)
            repeats += slot in slots_read
            slots_read.add(slot)
    return repeats


@settings(max_examples=25, deadline=None)
@given(prefixes=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       picks=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(1, 6)), min_size=2, max_size=8),
       block_size=st.sampled_from([2, 4, 8]))
def test_repeated_kv_reads_match_a_count_of_physical_slots(prefixes, picks, block_size) -> None:
    """kv_repeat_read_bytes (a shared prefix's re-reads within one step) equals a count of the
    physical slots the plan's entries read, and never exceeds what is read."""
    from phaselab.cost.formulas import CostFormulas

    formulas = CostFormulas(tiny(True), 2)
    for plan in _shared_prefix_plans(prefixes, picks, block_size):
        cost = formulas.of_plan(plan)
        assert cost.kv_repeat_read_bytes == _slot_rereads(plan, block_size) * formulas.kv_bytes_per_token, plan
        assert 0 <= cost.kv_repeat_read_bytes <= cost.kv_read_bytes


def test_decodes_over_a_cached_prefix_reread_it() -> None:
    """Four requests over one 24-token prefix, arriving a step apart: once they decode together,
    three of them re-read the prefix's six full blocks each step; the first-block grouping misses none."""
    from phaselab.cost.formulas import CostFormulas

    formulas = CostFormulas(tiny(True), 2)
    plans = list(_shared_prefix_plans([24], [(0, 3, 12)] * 4, 4))
    rereads = [formulas.of_plan(p).kv_repeat_read_bytes // formulas.kv_bytes_per_token for p in plans]
    assert rereads == [_slot_rereads(p, 4) for p in plans]
    assert max(rereads) == 3 * 24  # three later readers x the six shared blocks x 4 tokens
