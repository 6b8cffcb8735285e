"""Engine properties on the bundled model: batched = alone, seeds, KV accounting, bad input."""

from __future__ import annotations

import warnings

import pytest

from phaselab import SamplingParams
from phaselab.errors import InvalidRequestError
from tests._model_helpers import compare_greedy, long_text

pytestmark = pytest.mark.slow

LENGTHS = [5, 9, 17, 33, 60, 100, 150, 200, 300, 420, 555, 700, 850, 1000, 1200, 1500]


@pytest.fixture(scope="module")
def mixed_prompts(llm_fp32) -> list[list[int]]:
    ids = llm_fp32.get_tokenizer().encode(long_text(60))
    assert len(ids) > 3000
    # different offsets so the prompts differ from their first token on
    return [ids[7 * i : 7 * i + n] for i, n in enumerate(LENGTHS)]


def _assert_no_blocks_in_use(llm) -> None:
    sched = llm.engine.scheduler
    sched.check_invariants()
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0
    assert not sched.has_unfinished_requests()


def test_batched_equals_alone_greedy(llm_fp32, mixed_prompts):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = llm_fp32.generate(mixed_prompts, params)
    _assert_no_blocks_in_use(llm_fp32)
    ties = []
    for p, out in zip(mixed_prompts, together):
        alone = llm_fp32.generate([p], params)[0]
        tie = compare_greedy(out.token_ids, alone.token_ids, p, llm_fp32.engine.score)
        if tie:
            ties.append(tie)
    if ties:
        warnings.warn("; ".join(ties))
    _assert_no_blocks_in_use(llm_fp32)


def test_seeded_sampling_same_alone_and_in_batch(llm_fp32, mixed_prompts):
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(4)]
    picked = mixed_prompts[:4]
    alone = [llm_fp32.generate([p], sp)[0].text for p, sp in zip(picked, seeded)]
    # the same requests among unseeded sampling requests and greedy ones, in another order
    noise = SamplingParams(temperature=1.0, max_tokens=12)
    batch_prompts = [mixed_prompts[8], picked[2], mixed_prompts[5], picked[0], picked[3], mixed_prompts[9], picked[1]]
    batch_params = [noise, seeded[2], noise, seeded[0], seeded[3], noise, seeded[1]]
    outs = llm_fp32.generate(batch_prompts, batch_params)
    got = {1: outs[1].text, 3: outs[3].text, 4: outs[4].text, 6: outs[6].text}
    assert got[3] == alone[0] and got[6] == alone[1] and got[1] == alone[2] and got[4] == alone[3]
    # and a different seed gives a different sample
    other = llm_fp32.generate([picked[0]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=999,
                                                          max_tokens=20, ignore_eos=True))[0].text
    assert other != alone[0]
    _assert_no_blocks_in_use(llm_fp32)


def test_stop_conditions_and_logprobs(llm_fp32, mixed_prompts):
    p = mixed_prompts[3]
    base = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    # a stop string taken from the greedy text ends it there, excluded from the text
    stop = base.text[10:14]
    assert stop.strip(), "need a visible stop string"
    out = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    out = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                include_stop_str_in_output=True))[0]
    assert out.text == base.text[: base.text.index(stop) + len(stop)]
    # a stop token id ends it at that token
    tok = base.token_ids[5]
    out = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    # logprobs: the sampled token is the argmax under greedy, so rank 1, and top-3 are sorted
    out = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok_id and lp.rank == 1 and len(lp.top) == 3
        assert lp.top[0][0] == tok_id and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    _assert_no_blocks_in_use(llm_fp32)


def test_min_tokens_and_eos(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Say only: yes"}], add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    free = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=64))[0]
    assert free.finish_reason == "stop" and free.stop_reason is None  # ended by EOS
    n = len(free.token_ids)
    forced = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 5))[0]
    assert len(forced.token_ids) >= n + 5
    assert not set(forced.token_ids[: n + 5]) & llm_fp32.engine.eos_token_ids


def test_bad_prompts_fail_clearly_and_engine_keeps_serving(llm_fp32, mixed_prompts):
    eng = llm_fp32.engine
    too_long = list(mixed_prompts[-1]) * 3  # 4500 tokens > max_model_len 4096
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm_fp32.generate([mixed_prompts[0], too_long], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm_fp32.generate([[1, 2, 10**9]], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm_fp32.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    # nothing was started by the failed calls, and the engine still serves
    assert not eng.has_unfinished_requests()
    out = llm_fp32.generate([mixed_prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    _assert_no_blocks_in_use(llm_fp32)


def test_prompt_larger_than_cache_is_refused(bundled_path):
    from phaselab import LLM
    from phaselab.errors import ConfigError

    # a cache of 64 blocks x 16 tokens cannot hold the model's 8192-token context: explicit error
    with pytest.raises(ConfigError, match="kv-cache-memory"):
        LLM(dtype="float32", kv_cache_memory=64 * 16 * 46080, max_model_len=8192)
    small = LLM(dtype="float32", kv_cache_memory=64 * 16 * 46080)  # max_model_len follows the cache: 1024
    assert small.engine.max_model_len == 1024
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        small.generate([[5] * 1100], SamplingParams(max_tokens=4))
    # a request whose output would outgrow max_model_len stops there with "length"
    out = small.generate([[5] * 1000], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    _assert_no_blocks_in_use(small)


def test_abort_frees_blocks(llm_fp32, mixed_prompts):
    eng = llm_fp32.engine
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in mixed_prompts[4:8]]
    eng.step()
    eng.step()
    outs = eng.abort_request(rids[:2])
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id not in rids[:2]
    _assert_no_blocks_in_use(llm_fp32)


def test_chat_and_n(llm_fp32):
    outs = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in outs[0].text
    outs = llm_fp32.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))
    assert len(outs) == 1 and len(outs[0].outputs) == 3
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
