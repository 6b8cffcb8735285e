"""The adaptive budget on the real engine (issue 17): the records carry the decision, the
prediction and the measured time; the outputs are those of any other chunking; an unreachable
target is reported as infeasible (min_chunk keeps prefill moving) and a loose one chunks nothing.

Targets are chosen at the two extremes (1 ms: no CPU iteration of this model is that fast; 1 h)
so that what the policy must decide does not depend on this machine's speed.
"""

from __future__ import annotations

import pytest

from phaselab import LLM
from phaselab.core.sampling_params import SamplingParams
from phaselab.obs.rundir import iteration_from_json, iteration_to_json


def _workload(llm) -> tuple[list[list[int]], list[SamplingParams]]:
    tok = llm.get_tokenizer()
    short = [tok.encode(f"Count slowly from {i} to ten:") for i in range(3)]
    long_prompt = tok.encode(" ".join(f"word{i}" for i in range(150)))
    return short + [long_prompt], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4


def _serve(llm, prompts, params) -> list[list[int]]:
    """Three short requests start decoding, then the long one arrives."""
    engine = llm.engine
    ids = [engine.add_request(p, params[i]) for i, p in enumerate(prompts[:3])]
    outputs: dict[str, list[int]] = {}
    for _ in range(2):
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    ids.append(engine.add_request(prompts[3], params[3]))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[i] for i in ids]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024, max_num_batched_tokens=512)
    prompts, params = _workload(llm)
    return prompts, params, _serve(llm, prompts, params)


def test_unreachable_target_is_reported_and_min_chunk_keeps_prefill_moving(reference):
    prompts, params, expected = reference
    llm = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024, max_num_batched_tokens=512,
              slo_tbt_ms=1.0, slo_min_chunk=16)
    engine = llm.engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks  # the warm-up gave its borrowed blocks back
    assert _serve(llm, prompts, params) == expected  # chunking never changes greedy tokens
    mixed = [r for r in engine.iterations if r.num_decode_tokens and r.num_prefill_tokens]
    assert mixed, "the long prompt was prefilled beside the decodes"
    for r in engine.iterations:
        assert r.prefill_budget is not None and r.slo_tbt_s == pytest.approx(1e-3)
        assert r.predicted_ns is not None and r.predicted_ns > 0
        assert r.num_prefill_tokens <= r.prefill_budget <= 512
    for r in mixed:
        assert r.slo_feasible is False and r.budget_reason == "infeasible"
        assert r.prefill_budget == 16 and r.num_prefill_tokens <= 16
    # the record survives the run directory
    back = iteration_from_json(iteration_to_json(mixed[0]))
    assert (back.prefill_budget, back.predicted_ns, back.slo_feasible) == (16, mixed[0].predicted_ns, False)
    text = engine.metrics.render().decode()
    assert "phaselab_slo_infeasible_iterations_total" in text and 'term="decode_seq_s"' in text
    assert engine.run_config()["slo"]["cost_model"]["seed_source"] == "warm-up"


def test_loose_target_chunks_nothing(reference, tmp_path):
    prompts, params, expected = reference
    llm = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024, max_num_batched_tokens=512,
              slo_tbt_ms=3.6e6)
    engine = llm.engine
    assert _serve(llm, prompts, params) == expected
    long_prefill = [r for r in engine.iterations if r.num_prefill_tokens > 100]
    assert long_prefill and all(r.slo_feasible and r.prefill_budget >= 509 for r in long_prefill)
    # a later run can start from this one's fitted model instead of a warm-up
    path = tmp_path / "run"
    engine.write_record(str(path))
    again = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024, max_num_batched_tokens=512,
                slo_tbt_ms=50.0, slo_cost_file=str(path / "config.json"))
    learned = engine.budget_learner.coefficients
    assert again.engine.budget_learner.seed_source == str(path / "config.json")
    assert again.engine.scheduler.cost_coefficients.as_tuple() == pytest.approx(learned.as_tuple(), rel=1e-9)
