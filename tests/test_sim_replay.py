"""Replay: fed the measured iteration times of a run, the simulator's scheduler takes exactly the
same decisions, iteration by iteration. The slow test produces the run with the real engine on the
bundled model (staggered arrivals, a KV cache small enough to preempt)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from phaselab.obs.rundir import read_run_dir
from phaselab.cost.catalog import get_hardware
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.loop import simulate
from phaselab.sim.replay import ReplayError, replay, replay_inputs
from phaselab.sim.workload import SimRequest
from phaselab.modelinfo.model_config import ModelConfig

TINY = ModelConfig("llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def _as_real_run(path, config: ModelConfig) -> None:
    """Make a simulated run directory look like an engine's (what replay reads of config.json)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("simulated")
    cfg["model"] = {"config": dataclasses.asdict(config)}
    (path / "config.json").write_text(json.dumps(cfg))


def test_replay_of_a_run_with_idle_gaps_and_preemptions_takes_the_same_decisions(tmp_path):
    d = Deployment(TINY, get_hardware("cpu"),
                   colocated=RoleConfig(max_num_batched_tokens=48, max_num_seqs=5, num_blocks=14), max_model_len=200)
    # bursts separated by idle periods, plus stragglers arriving mid-iteration
    arrivals = [0.0, 0.0, 0.001, 0.05, 0.0501, 0.2, 5.0, 5.0, 5.003, 9.0]
    lengths = [(40, 30), (90, 24), (30, 40), (120, 20), (60, 36), (25, 28), (150, 12), (70, 30), (20, 60), (100, 5)]
    reqs = [SimRequest(f"r{i}", n, m, arrival_s=t, index=i, output_len=m if i % 3 == 0 else None)
            for i, (t, (n, m)) in enumerate(zip(arrivals, lengths))]
    original = simulate(d, reqs)
    assert sum(m.num_preemptions for m in original.requests) > 0
    original.write(str(tmp_path))
    _as_real_run(tmp_path, TINY)
    r = replay(str(tmp_path))
    assert r.identical, r.describe()
    assert len(r.real) == len(original.iterations) > 50
    # the replayed clock is the original's, iteration by iteration
    assert [i.start_ns for i in r.result.iterations] == [i.start_ns for i in original.iterations]


def test_prediction_inputs_keep_each_request_at_its_own_arrival(tmp_path):
    """A prediction simulates the run's workload under another configuration, whose iterations start
    elsewhere: a request that arrived mid-iteration must arrive there at its own time (and wait for
    the step, as its measured TTFT did), not at the recorded run's next iteration start."""
    d = Deployment(TINY, get_hardware("cpu"), colocated=RoleConfig(max_num_batched_tokens=64, num_blocks=64),
                   max_model_len=400)
    arrivals = [0.0, 0.0007, 0.0013, 0.2, 0.2004]  # stragglers inside the first and the later iterations
    reqs = [SimRequest(f"r{i}", 200, 4, arrival_s=t, index=i) for i, t in enumerate(arrivals)]
    simulate(d, reqs).write(str(tmp_path))
    _as_real_run(tmp_path, TINY)
    data = read_run_dir(str(tmp_path))
    by_id = lambda rs: {r.request_id: r.arrival_ns / 1e9 for r in rs}  # noqa: E731
    own = by_id(replay_inputs(data, at="arrival")[1])
    aligned = by_id(replay_inputs(data)[1])
    assert own == pytest.approx({f"r{i}": t for i, t in enumerate(arrivals)}, abs=1e-9)
    assert all(aligned[r] >= own[r] for r in own)
    assert sum(aligned[r] > own[r] + 1e-4 for r in own) >= 2, (own, aligned)


def test_replay_refuses_simulated_and_multi_worker_runs(tmp_path):
    d = Deployment(TINY, get_hardware("cpu"), num_replicas=2,
                   colocated=RoleConfig(num_blocks=64), max_model_len=200)
    result = simulate(d, [SimRequest(f"r{i}", 30, 5, index=i) for i in range(4)])
    result.write(str(tmp_path))
    with pytest.raises(ReplayError, match="one worker"):
        replay_inputs(read_run_dir(str(tmp_path)))


@pytest.mark.slow
def test_replay_of_a_real_engine_run_takes_the_same_decisions(tmp_path):
    """The real engine (bundled model, bf16) with requests added at given steps; the replay gets
    each real iteration's measured time and each request at the first iteration that began after
    it was queued."""
    from phaselab import LLM, SamplingParams
    from tests._model_helpers import long_text

    llm = LLM(dtype="bfloat16", kv_cache_memory="6MiB", max_model_len=256, policy="chunked",
              max_num_batched_tokens=64, max_num_seqs=6)
    eng = llm.engine
    ids = eng.tokenizer.encode(long_text(12))
    lengths = [(40, 20), (90, 16), (30, 24), (120, 12), (60, 20), (25, 16), (150, 8), (70, 16)]
    prompts, offset = [], 0
    for n, _ in lengths:
        prompts.append(ids[offset:offset + n])  # distinct text: no prefix-cache hit across requests
        offset += n + 7
    at_step = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5], 14: [6], 15: [7]}
    step = 0
    while at_step or eng.has_unfinished_requests():
        for i in at_step.pop(step, []):
            eng.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=lengths[i][1]))
        if eng.has_unfinished_requests():
            eng.step()
        step += 1
    assert eng.scheduler.num_preemptions_total > 0  # 17 blocks of 16 tokens: the run preempts
    eng.write_record(str(tmp_path))

    r = replay(str(tmp_path))
    assert r.identical, r.describe()
    assert len(r.real) == len(r.simulated) == len(eng.iterations)
    assert not r.notes
    real = read_run_dir(str(tmp_path))
    real_ids = {m.request_id: (m.num_output_tokens, m.num_preemptions) for m in real.requests}
    sim_ids = {m.request_id: (m.num_output_tokens, m.num_preemptions) for m in r.result.requests}
    assert real_ids == sim_ids
