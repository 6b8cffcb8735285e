"""Sampler properties: greedy is argmax, seeded draws ignore the batch, filters never leak,
frequencies follow softmax(logits / T), min_tokens masks stopping, logprobs are the raw ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from phaselab.core.outputs import ScheduledRequest
from phaselab.core.sampling_params import SamplingParams
from phaselab.model.sampler import Sampler

EOS = 3
_ids = itertools.count()


def req(num_output_tokens: int = 0, request_id: str | None = None, **params: object) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id or f"r{next(_ids)}",
        token_ids=[1],
        start_position=0,
        block_ids=[0],
        new_block_ids=[],
        sample=True,
        is_prefill=False,
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        num_output_tokens=num_output_tokens,
    )


def counts(sampler: Sampler, logits: torch.Tensor, num_rows: int, num_steps: int, **params: object) -> torch.Tensor:
    """Token histogram of num_rows unseeded requests (own generators) drawing num_steps times."""
    requests = [req(**params) for _ in range(num_rows)]
    batch = logits.expand(num_rows, -1)
    hist = torch.zeros(logits.shape[-1], dtype=torch.long)
    for _ in range(num_steps):
        tokens, _ = sampler.sample(batch, requests)
        hist += torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])
    return hist


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4; 2-7 % above
    scipy's chi2.ppf(1 - 1e-4, df) for small df, i.e. slightly lenient). The draws are seeded, so
    each test is deterministic; the bound only has to reject a wrong distribution."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * h**0.5) ** 3


def assert_matches(hist: torch.Tensor, probs: torch.Tensor) -> None:
    support = probs > 0
    n = hist.sum().item()
    assert hist[~support].sum() == 0, f"sampled excluded tokens: {hist.tolist()}"
    expected = probs[support].double() * n
    chi2 = ((hist[support].double() - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < chi2_critical(df), f"chi2={chi2:.1f} df={df} hist={hist.tolist()} expected={expected.tolist()}"


def test_greedy_is_argmax_and_leaves_input_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    before = logits.clone()
    requests = [req(temperature=0.0, min_tokens=1 if i % 2 else 0) for i in range(7)]
    tokens, logprobs = Sampler(frozenset({EOS})).sample(logits, requests)
    masked = logits.clone()
    masked[1::2, EOS] = float("-inf")
    assert tokens == masked.argmax(dim=-1).tolist()
    assert logprobs == [None] * 7
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    assert Sampler(frozenset()).sample(torch.empty(0, 10), []) == ([], [])


def test_top_k_1_equals_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 100)
    tokens, _ = Sampler(frozenset()).sample(logits, [req(top_k=1, temperature=1.5) for _ in range(16)])
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_request_ignores_batch_and_row(dtype: torch.dtype) -> None:
    """The same seed gives the same tokens alone and in a batch, at changing rows, next to other
    filters. Coarse bf16 logits have many ties, also at the top-k/top-p cut."""
    vocab, num_steps = 64, 25
    step_logits = torch.randn(num_steps, vocab, generator=torch.Generator().manual_seed(5))
    if dtype == torch.bfloat16:
        step_logits = (step_logits * 2).round() / 2
    step_logits = step_logits.to(dtype)
    params = dict(seed=1234, temperature=0.9, top_p=0.95, top_k=40, min_p=0.01)

    alone = Sampler(frozenset({EOS}), seed=0)
    target = req(request_id="target", **params)
    alone_tokens = [alone.sample(step_logits[s : s + 1], [target])[0][0] for s in range(num_steps)]

    batched = Sampler(frozenset({EOS}), seed=99)
    others = [req(), req(seed=7), req(temperature=0.0), req(top_p=0.5), req(top_k=3), req(temperature=2.0, logprobs=3)]
    noise = torch.Generator().manual_seed(11)
    batch_tokens = []
    for s in range(num_steps):
        row = s % (len(others) + 1)
        requests = others[:row] + [req(request_id="target", **params)] + others[row:]
        logits = torch.randn(len(requests), vocab, generator=noise).to(dtype)
        logits[row] = step_logits[s]
        batch_tokens.append(batched.sample(logits, requests)[0][row])
    assert batch_tokens == alone_tokens
    assert len(set(alone_tokens)) > 5  # really random, not degenerate


def test_generator_state_persists_until_free() -> None:
    """A request keeps its random stream across steps (preemption does not restart it); after
    free() the same id starts over from its seed."""
    logits = torch.zeros(1, 1000)
    sampler = Sampler(frozenset())
    first = [sampler.sample(logits, [req(request_id="a", seed=3)])[0][0] for _ in range(5)]
    assert len(set(first)) == 5
    sampler.free(["a"])
    assert sampler.num_generators == 0
    again = [sampler.sample(logits, [req(request_id="a", seed=3)])[0][0] for _ in range(5)]
    assert again == first


def test_different_seeds_differ_and_unseeded_is_reproducible() -> None:
    logits = torch.zeros(2, 1000)
    sampler = Sampler(frozenset())
    a, b = req(seed=1), req(seed=2)
    draws = [sampler.sample(logits, [a, b])[0] for _ in range(10)]
    assert [d[0] for d in draws] != [d[1] for d in draws]

    def unseeded_run(sampler_seed: int) -> list[list[int]]:
        sampler = Sampler(frozenset(), seed=sampler_seed)
        requests = [req(request_id=f"u{i}") for i in range(3)]
        return [sampler.sample(torch.zeros(3, 1000), requests)[0] for _ in range(4)]

    assert unseeded_run(0) == unseeded_run(0)
    assert unseeded_run(0) != unseeded_run(1)
    run = unseeded_run(0)
    assert len({tuple(col) for col in zip(*run)}) == 3  # the three requests get distinct streams


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_tempered_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    hist = counts(Sampler(frozenset(), seed=int(temperature * 10)), logits, 1000, 12, temperature=temperature)
    assert_matches(hist, torch.softmax(logits / temperature, dim=-1))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()
    # sorted: 0.5, 0.3 (mass 0.8 >= 0.75) -> {1, 3}
    hist = counts(Sampler(frozenset()), logits, 1000, 6, top_p=0.75)
    assert_matches(hist, torch.tensor([0.0, 0.5, 0.0, 0.3, 0.0]) / 0.8)
    # top_p below the top token's mass still keeps that one token
    hist = counts(Sampler(frozenset()), logits, 200, 2, top_p=0.1)
    assert hist.tolist() == [0, 400, 0, 0, 0]


def test_top_k_then_top_p_then_min_p() -> None:
    probs = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.07])
    logits = probs.log()
    # top_k=4 renormalises over {0..3} (0.35 .. 0.059); top_p=0.7 keeps 0.353 + 0.294 + 0.235 = 0.88
    hist = counts(Sampler(frozenset()), logits, 1000, 6, top_k=4, top_p=0.7)
    assert_matches(hist, torch.tensor([0.3, 0.25, 0.2, 0.0, 0.0, 0.0]) / 0.75)
    # min_p=0.3: keep p >= 0.09 -> {0, 1, 2, 3}
    hist = counts(Sampler(frozenset()), logits, 1000, 6, min_p=0.3)
    assert_matches(hist, torch.tensor([0.3, 0.25, 0.2, 0.1, 0.0, 0.0]) / 0.85)


def test_filters_never_leak_under_temperature() -> None:
    """A large temperature flattens the distribution; top-k must still hold on the survivors."""
    torch.manual_seed(3)
    logits = torch.randn(40)
    allowed = set(logits.topk(5).indices.tolist())
    hist = counts(Sampler(frozenset()), logits, 500, 4, top_k=5, temperature=5.0)
    assert {i for i, c in enumerate(hist.tolist()) if c} == allowed


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 6] = 8.0
    sampler = Sampler(frozenset({EOS}))
    greedy = dict(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    assert sampler.sample(logits, [req(num_output_tokens=0, **greedy)])[0] == [6]
    assert sampler.sample(logits, [req(num_output_tokens=2, **greedy)])[0] == [6]
    assert sampler.sample(logits, [req(num_output_tokens=3, **greedy)])[0] == [EOS]
    # ignore_eos is about stopping, not masking: min_tokens still bans eos
    assert sampler.sample(logits, [req(num_output_tokens=0, ignore_eos=True, **greedy)])[0] == [6]
    # sampled rows too, even though eos/stop hold almost all the mass
    batch = logits.expand(300, -1)
    tokens, _ = sampler.sample(batch, [req(min_tokens=1, stop_token_ids=[5]) for _ in range(300)])
    assert EOS not in tokens and 5 not in tokens


def test_logprobs_are_raw_with_rank_and_top() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 30)
    logits[0, EOS] = 5.0  # the argmax, banned by min_tokens -> the sampled token has rank 2
    ref = torch.log_softmax(logits, dim=-1)
    requests = [
        req(temperature=0.0, min_tokens=1, logprobs=3),
        req(temperature=0.3, top_k=3, logprobs=0),
        req(temperature=0.0),
    ]
    tokens, logprobs = Sampler(frozenset({EOS})).sample(logits, requests)
    first, second, third = logprobs
    assert third is None
    assert first is not None and second is not None

    assert first.token_id == tokens[0] == logits[0].topk(2).indices[1].item()
    assert first.rank == 2
    assert first.logprob == pytest.approx(ref[0, tokens[0]].item(), abs=1e-6)
    top_values, top_ids = ref[0].topk(3)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert first.top[0][0] == EOS  # raw: masking did not touch the reported distribution

    # temperature and top-k do not change reported logprobs; rank counts strictly larger ones
    assert second.top == []
    assert second.logprob == pytest.approx(ref[1, tokens[1]].item(), abs=1e-6)
    assert second.rank == 1 + int((ref[1] > ref[1, tokens[1]]).sum())


def test_bf16_logits() -> None:
    torch.manual_seed(6)
    logits = torch.randn(6, 200).to(torch.bfloat16)
    requests = [req(temperature=0.0, logprobs=2)] * 3 + [req(temperature=0.8, top_p=0.9, logprobs=1)] * 3
    tokens, logprobs = Sampler(frozenset()).sample(logits, requests)
    assert tokens[:3] == logits[:3].float().argmax(dim=-1).tolist()
    ref = torch.log_softmax(logits.float(), dim=-1)
    for row, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert entry is not None and entry.token_id == token
        assert entry.logprob == pytest.approx(ref[row, token].item(), abs=1e-5)


@pytest.mark.parametrize("temperature", [1e-6, 1e-20, 1e-38, 1e-45, 1e-300])
def test_tiny_temperature_is_greedy_not_token_0(temperature: float) -> None:
    """x / T overflowed to inf for a tiny T and softmax(inf - inf) was NaN, whose argmax is token 0:
    every token came out as 0. The argmax is the independent truth here; token 0 is never it."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 1000, generator=gen) * 8 + 20  # logits of ~20 (as a real model's)
    logits[:, 0] = -50.0
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler(frozenset({EOS}))
    requests = [req(temperature=temperature, top_p=p, top_k=k, min_p=m)
                for p, k, m in ((1.0, 0, 0.0), (0.9, 0, 0.0), (1.0, 50, 0.0), (1.0, 0, 0.1))]
    for _ in range(5):
        tokens, _ = sampler.sample(logits, requests)
        assert tokens == expected
