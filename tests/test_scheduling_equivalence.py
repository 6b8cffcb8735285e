"""Scheduling must not change greedy outputs: policies, budgets, preemption, prefix caching."""

from __future__ import annotations

import warnings

import pytest
import torch

from phaselab import SamplingParams
from tests._model_helpers import compare_greedy, long_text, make_llm

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = [3, 17, 40, 90, 150, 260, 380, 600]


@pytest.fixture(scope="module")
def checkpoint():
    from phaselab.model.loader import load_checkpoint

    return load_checkpoint(None, torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """prefill-first, large cache, prefix caching off: the plainest schedule."""
    llm = make_llm(checkpoint, dtype="float32", kv_cache_memory="512MiB", max_model_len=2048,
                   policy="prefill-first", enable_prefix_caching=False)
    ids = llm.get_tokenizer().encode(long_text(40))
    prompts = [ids[11 * i : 11 * i + n] for i, n in enumerate(LENGTHS)]
    outs = llm.generate(prompts, GREEDY)
    return llm, prompts, [o.token_ids for o in outs]


def _check_same(llm, prompts, expected, ref_llm) -> None:
    outs = llm.generate(prompts, GREEDY)
    ties = [t for p, o, e in zip(prompts, outs, expected)
            if (t := compare_greedy(o.token_ids, e, p, ref_llm.engine.score))]
    if ties:
        warnings.warn("; ".join(ties))
    sched = llm.engine.scheduler
    sched.check_invariants()
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_chunked_budgets_equal_prefill_first(checkpoint, reference, budget):
    ref_llm, prompts, expected = reference
    llm = make_llm(checkpoint, dtype="float32", kv_cache_memory="512MiB", max_model_len=2048,
                   policy="chunked", max_num_batched_tokens=budget, enable_prefix_caching=False)
    _check_same(llm, prompts, expected, ref_llm)


def test_preemption_does_not_change_outputs(checkpoint, reference):
    ref_llm, prompts, expected = reference
    # 48 blocks x 16 tokens = 768 tokens for ~1600 prompt tokens in flight: preemption must happen
    llm = make_llm(checkpoint, dtype="float32", kv_cache_memory=48 * 16 * 46080, policy="chunked",
                   max_num_batched_tokens=256, enable_prefix_caching=False)
    _check_same(llm, prompts, expected, ref_llm)
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_prefix_cache_hit_equals_cold(checkpoint, reference):
    ref_llm, prompts, expected = reference
    llm = make_llm(checkpoint, dtype="float32", kv_cache_memory="512MiB", max_model_len=2048, policy="chunked",
                   max_num_batched_tokens=128, enable_prefix_caching=True)
    _check_same(llm, prompts, expected, ref_llm)  # cold: fills the cache
    outs = llm.generate(prompts, GREEDY)  # warm: every prompt of >= 2 blocks hits
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert all(o.num_cached_tokens >= 16 for o, n in zip(outs, LENGTHS) if n > 32)
    ties = [t for p, o, e in zip(prompts, outs, expected)
            if (t := compare_greedy(o.token_ids, e, p, ref_llm.engine.score))]
    if ties:
        warnings.warn("; ".join(ties))
    stats = llm.engine.scheduler.prefix_cache_stats
    assert stats.num_hit_tokens > 0 and stats.num_query_tokens >= stats.num_hit_tokens
