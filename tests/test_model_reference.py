"""The bundled model against Hugging Face transformers on the same (dequantized GGUF) weights."""

from __future__ import annotations

import warnings

import pytest
import torch

from phaselab import LLM, SamplingParams
from tests._model_helpers import compare_greedy, hf_greedy, hf_logits

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_continuations(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def test_fp32_greedy_matches_transformers(llm_fp32, hf_model, prompts, hf_continuations):
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm_fp32.generate(prompts, greedy)  # all 8 together: batched, mixed lengths
    ties = []
    for p, out, ref in zip(prompts, outs, hf_continuations):
        ref = ref[:NEW_TOKENS]
        tie = compare_greedy(out.token_ids[: len(ref)], ref, p, lambda ids: hf_logits(hf_model, ids))
        if tie:
            ties.append(tie)
    if ties:
        warnings.warn("; ".join(ties))
    assert len(ties) <= 1, f"more than one near-tie is suspicious: {ties}"


def test_fp32_last_position_logits_match(llm_fp32, hf_model, prompts):
    for p in prompts:
        ours = llm_fp32.engine.score(p)[-1]
        ref = hf_logits(hf_model, p)[-1]
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-3, f"prompt of {len(p)} tokens: max |logit diff| = {diff:.2e}"


def test_bf16_top1_agrees_with_fp32_under_teacher_forcing(hf_model, prompts, hf_continuations):
    llm_bf16 = LLM(dtype="bfloat16", kv_cache_memory="256MiB", max_model_len=4096)
    agree = total = 0
    for p, cont in zip(prompts, hf_continuations):
        seq = p + cont
        ref_top1 = hf_logits(hf_model, seq).argmax(-1)
        ours_top1 = llm_bf16.engine.score(seq).argmax(-1)
        # every position that predicts a next token
        agree += int((ref_top1[:-1] == ours_top1[:-1]).sum())
        total += len(seq) - 1
    rate = agree / total
    assert rate >= 0.98, f"bf16 top-1 agrees with fp32 at only {rate:.2%} of {total} positions"


def test_score_leaves_no_block_in_use(llm_fp32, prompts):
    llm_fp32.engine.score(prompts[0])
    assert llm_fp32.engine.scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
