"""Turn one row of logits per scheduled request into one token (and, on request, its logprobs).

Pipeline per row, all in float32 (vLLM's order):

    raw logits ──▶ logprobs (if asked; from the RAW logits, see below)
        │
        ▼ min_tokens: eos + stop_token_ids -> -inf while num_output_tokens < min_tokens
        ├── temperature == 0 ──▶ argmax                      (greedy rows: one vectorised argmax)
        ▼
    / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ softmax ─▶ exponential race with the request's
                                                           own generator (one draw per token)

Reproducibility contract: a request's tokens depend only on its logits and its own
`torch.Generator`, never on the batch around it or its row. The generator is created the first
time the request is seen (seeded by `params.seed`, or derived from the sampler's seed and a
counter) and lives until `free()`, so a request that is preempted and recomputed continues the
same random stream: exactly one draw is made per sampled token, none for greedy rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from phaselab.core.outputs import ScheduledRequest, TokenLogprobs
from phaselab.model import kernels

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """Scramble a counter into a well-spread 63-bit seed, so that consecutive unseeded requests
    (seed, 0), (seed, 1), ... get unrelated random streams rather than neighbouring ones."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # manual_seed wants a value that fits int64


class Sampler:
    """Samples the next token of every row; owns one random generator per live request.

    Logprobs are the *raw* model distribution: `log_softmax` of the logits as they come out of
    the model, before min_tokens masking, temperature and the top-k/top-p/min-p filters (vLLM's
    default `logprobs_mode="raw_logprobs"`). That makes them comparable across sampling settings
    and means a filter never turns a reported logprob into -inf.
    """

    def __init__(self, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._num_unseeded = 0  # counter behind derived seeds: deterministic for a fixed arrival order

    @property
    def num_generators(self) -> int:
        """Live per-request generators (a leak check for tests: 0 once everything is freed)."""
        return len(self._generators)

    def free(self, request_ids: Iterable[str]) -> None:
        """Forget finished/aborted requests. Not for preempted ones: their stream must go on."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _generator(self, request: ScheduledRequest, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.sampling_params.seed
            if seed is None:
                seed = _splitmix64((self.seed << 32) ^ self._num_unseeded)
                self._num_unseeded += 1
            gen = torch.Generator(device=device)
            gen.manual_seed(seed & ((1 << 63) - 1))
            self._generators[request.request_id] = gen
        assert gen.device.type == device.type, f"generator of {request.request_id} lives on {gen.device}"
        return gen

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: list[ScheduledRequest]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample one token per row. `logits` is (B, vocab), float32 or bf16; row i is requests[i]."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (tuple(logits.shape), len(requests))
        num_rows, vocab_size = logits.shape
        if num_rows == 0:
            return [], []
        device = logits.device
        x = logits.float()  # (B, V); aliases `logits` when that is already float32

        # Raw logprobs first: nothing below may influence them.
        logprob_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw_logprobs = torch.log_softmax(x[logprob_rows], dim=-1) if logprob_rows else None

        # min_tokens: forbid every way of stopping on a token until enough tokens exist.
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        for i, r in enumerate(requests):
            params = r.sampling_params
            if r.num_output_tokens < params.min_tokens:
                banned = {t for t in (*self.eos_token_ids, *params.stop_token_ids) if 0 <= t < vocab_size}
                mask_rows.extend([i] * len(banned))
                mask_cols.extend(banned)
        if mask_rows:
            if x is logits:
                x = x.clone()  # never write into the caller's logits
            x[mask_rows, mask_cols] = float("-inf")

        greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        # greedy picks natively where the kernels build: torch's argmax is a scalar loop that also
        # wakes OpenMP's team (kernels.argmax_rows: the same index, ties and NaN included)
        if not sampled:  # all greedy (or all sampled, below): no gather copy of the logits
            token_ids = kernels.argmax_rows(x)  # (B,)
        elif not greedy:
            token_ids = self._sample_random(x, requests)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            token_ids[greedy] = kernels.argmax_rows(x[greedy])
            token_ids[sampled] = self._sample_random(x[sampled], [requests[i] for i in sampled])

        tokens: list[int] = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            entries = self._logprobs(raw_logprobs, token_ids[logprob_rows], [requests[i] for i in logprob_rows])
            for row, entry in zip(logprob_rows, entries):
                logprobs[row] = entry
        return tokens, logprobs

    def _sample_random(self, x: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
        """Temperature, filters and a seeded draw for the non-greedy rows. x: (S, V), read only."""
        num_rows, vocab_size = x.shape
        device = x.device
        params = [r.sampling_params for r in requests]
        # Shift each row so its largest logit is 0 before dividing: x / T overflows to inf for a
        # tiny T (1e-38 with logits ~20), and softmax(inf - inf) is NaN, whose argmax was token 0
        # every time. Shifted, a tiny T only pushes the other logits towards -inf (softmax is
        # shift-invariant, so nothing else changes), and the draw picks the top token: greedy.
        # The clamp keeps a T that float32 cannot hold (1e-50 -> 0) from dividing 0 by 0.
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        temperature.clamp_(min=torch.finfo(torch.float32).tiny)
        x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]  # (S, V)

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            # One stable descending sort serves both filters (top-p sees only top-k's survivors).
            # Stability breaks ties by token id, so the kept set depends on the row alone: a
            # topk(max k over the batch) would be cheaper but lets the batch pick among ties
            # (common with bf16 logits) and so break seeded reproducibility.
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # (S, V)
            position = torch.arange(vocab_size, device=device)[None, :]
            if any(k < vocab_size for k in top_k):
                k = torch.tensor(top_k, device=device)[:, None]
                sorted_x.masked_fill_(position >= k, float("-inf"))  # exactly k tokens stay
            if any(p < 1.0 for p in top_p):
                # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass
                # strictly before it is still short of top_p. The top token always stays.
                probs = sorted_x.softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs
                # Rows without top-p get an unreachable bar: a float32 cumsum can pass 1.0 early.
                p = torch.tensor([q if q < 1.0 else 2.0 for q in top_p], device=device)[:, None]
                drop = (mass_before >= p) & (position > 0)
                sorted_x.masked_fill_(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sorted_x)

        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            probs = x.softmax(dim=-1)
            threshold = torch.tensor(min_p, dtype=torch.float32, device=device)[:, None] * probs.amax(
                dim=-1, keepdim=True
            )
            x = x.masked_fill(probs < threshold, float("-inf"))

        probs = x.softmax(dim=-1)  # (S, V); filtered tokens are exactly 0
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i. The
        # noise of each row comes from that request's own generator, one draw per token. Clamping
        # E away from 0 keeps p/E finite, so a filtered token (p = 0) scores 0 and can never win.
        noise = torch.empty_like(probs)
        for row, request in enumerate(requests):
            noise[row].exponential_(generator=self._generator(request, device))
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logprobs: torch.Tensor, token_ids: torch.Tensor, requests: list[ScheduledRequest]
    ) -> list[TokenLogprobs]:
        """Sampled-token logprob, its rank (1 + tokens strictly more likely) and the top-k list."""
        chosen = logprobs.gather(1, token_ids[:, None])  # (L, 1)
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # (L,)
        max_k = max(r.sampling_params.logprobs or 0 for r in requests)
        top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
        token_list: list[int] = token_ids.tolist()
        chosen_list: list[float] = chosen[:, 0].tolist()
        rank_list: list[int] = ranks.tolist()
        top_value_list: list[list[float]] = top_values.tolist() if top_values is not None else []
        top_id_list: list[list[int]] = top_ids.tolist() if top_ids is not None else []
        out = []
        for row, request in enumerate(requests):
            k = request.sampling_params.logprobs or 0
            top = list(zip(top_id_list[row][:k], top_value_list[row][:k])) if k else []
            out.append(TokenLogprobs(token_list[row], chosen_list[row], rank_list[row], top))
        return out
