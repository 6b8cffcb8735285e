"""The requests of a simulated run: token counts, output lengths and arrival times.

The same generators and seeds as the bench (`bench` subcommand; phaselab/workload: lengths, arrivals, trace):

    SeedSequence(seed).spawn(2) ─▶ [0] lengths (LengthDist draws, in the bench's order)
                                   [1] open-loop arrival gaps (gamma_intervals: Poisson at burstiness 1)

so `random` with a seed gives the bench's input/output lengths and send times exactly. The bench
then builds prompt *text* of those lengths from a tokenizer's vocabulary; the simulator needs only
the token counts and makes each prompt unique (its first token is the request's own id, so no two
requests share a cached block by accident). `shared-prefix` builds its groups the same way (a
group's first `prefix_len` tokens are identical, the rest unique); its lengths are drawn with the
bench's distributions but, since the bench interleaves prompt-text draws in the same generator,
not bit-identical to the bench's. `interference` has no random draw. `trace` reads the bench's
JSONL keys. With `exact_prompts` (a tokenizer), the bench's own specs are tokenized instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from phaselab.workload.arrivals import ArrivalPlan, arrival_offsets, workload_seeds
from phaselab.workload.interference import InterferenceParams
from phaselab.workload.lengths import LengthDist, WorkloadError
from phaselab.workload.params import SharedPrefixParams
from phaselab.workload.trace_file import TRACE_INPUT_TOKENS, TRACE_OUTPUT_TOKENS, first_of, read_trace_rows

PREFIX_TOKEN_BASE = 1 << 40  # first token of a shared-prefix group's prompts
UNIQUE_TOKEN_BASE = 1 << 41  # first token of a request's own part
DUMMY_TOKEN = 1  # what the cost-model executor samples
EOS_TOKEN = 2  # sampled where the workload says the request stops


@dataclass
class SimRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float = 0.0
    output_len: int | None = None  # stop (EOS) after this many output tokens; None: run to max_tokens
    group: str = "default"
    prefix_group: int | None = None  # shared-prefix group: the first prefix_len tokens are the group's
    prefix_len: int = 0
    prompt_token_ids: list[int] | None = None  # exact ids (e.g. tokenized bench prompts)
    index: int = 0  # position in the workload (makes synthetic prompts unique)
    arrival_ns: int | None = None  # exact offset in ns (replays); overrides arrival_s
    after_finished: str | tuple[str, ...] | None = None  # released when that request (all those) ended, not at an offset

    @property
    def offset_ns(self) -> int:
        return self.arrival_ns if self.arrival_ns is not None else round(self.arrival_s * 1e9)

    def token_ids(self) -> list[int]:
        """The prompt's token ids: exact if given, else synthetic and unique to this request
        (a shared-prefix group's first prefix_len tokens are the group's)."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        n = self.num_prompt_tokens
        if self.prefix_group is not None and self.prefix_len > 0:
            head = [PREFIX_TOKEN_BASE + self.prefix_group] + [0] * (self.prefix_len - 1)
            return head + [UNIQUE_TOKEN_BASE + self.index] + [0] * (n - self.prefix_len - 1)
        return [UNIQUE_TOKEN_BASE + self.index] + [0] * (n - 1)


def _apply_arrivals(requests: list[SimRequest], arrivals: ArrivalPlan, rng: np.random.Generator) -> list[SimRequest]:
    if arrivals.self_timed or arrivals.concurrency is not None:
        return requests
    for r, t in zip(requests, arrival_offsets(len(requests), arrivals.request_rate, arrivals.burstiness, rng)):
        r.arrival_s = t
    return requests


def random_requests(num_prompts: int, input_len: str | int = "256", output_len: str | int = "128", seed: int = 0,
                    arrivals: ArrivalPlan = ArrivalPlan()) -> list[SimRequest]:
    """The bench's `random` workload: lengths from LengthDist specs ("256", "uniform:128:512", ...).
    Each request generates exactly its drawn output length (the bench sends it as max_tokens; a
    simulated model never samples EOS unless `output_len` says so)."""
    rng_w, rng_a = workload_seeds(seed)
    ins = LengthDist.parse(input_len).sample(rng_w, num_prompts)
    outs = LengthDist.parse(output_len).sample(rng_w, num_prompts)
    reqs = [SimRequest(f"req-{i}", n_in, n_out, index=i)
            for i, (n_in, n_out) in enumerate(zip(ins, outs))]
    return _apply_arrivals(reqs, arrivals, rng_a)


def shared_prefix_requests(num_prompts: int, num_groups: int = SharedPrefixParams.num_groups,
                           prefix_len: int = SharedPrefixParams.prefix_len, suffix_len: str = SharedPrefixParams.suffix_len,
                           output_len: str = SharedPrefixParams.output_len, seed: int = 0, arrivals: ArrivalPlan = ArrivalPlan()
                           ) -> list[SimRequest]:
    """Request i belongs to group i % num_groups; prompt = the group's prefix_len tokens + a suffix."""
    rng_w, rng_a = workload_seeds(seed)
    suffixes = LengthDist.parse(suffix_len).sample(rng_w, num_prompts)
    outs = LengthDist.parse(output_len).sample(rng_w, num_prompts)
    reqs = [SimRequest(f"req-{i}", prefix_len + n_suf, n_out, group=f"group-{i % num_groups}",
                       prefix_group=i % num_groups, prefix_len=prefix_len, index=i)
            for i, (n_suf, n_out) in enumerate(zip(suffixes, outs))]
    return _apply_arrivals(reqs, arrivals, rng_a)


def interference_requests(p: InterferenceParams = InterferenceParams()) -> list[SimRequest]:
    """The bench's `interference` workload: streams at t=0, long prompts at start + k x interval."""
    reqs = [SimRequest(f"req-stream-{i}", p.stream_input_len, p.stream_output_len, 0.0, group="stream", index=i)
            for i in range(p.num_streams)]
    reqs += [SimRequest(f"req-long-{k}", p.long_input_len, p.long_output_len, p.long_arrival_s(k),
                        group="long", index=p.num_streams + k) for k in range(p.num_long_prompts)]
    return reqs


def trace_requests(path: str, num_prompts: int | None = None, time_scale: float = 1.0) -> list[SimRequest]:
    """The bench's trace JSONL (Mooncake keys too), read by the bench's own reader; the simulator
    needs token counts, not prompt text."""
    rows = read_trace_rows(path, num_prompts)
    for lineno, (_, row) in enumerate(rows, start=1):
        if first_of(row, TRACE_INPUT_TOKENS) is None or first_of(row, TRACE_OUTPUT_TOKENS) is None:
            raise WorkloadError(f"{path}: request {lineno}: the simulator needs an input token count "
                                f"({'/'.join(TRACE_INPUT_TOKENS)}) and an output token count ({'/'.join(TRACE_OUTPUT_TOKENS)})")
    t0 = min(t for t, _ in rows)
    return [SimRequest(str(row.get("request_id") or f"req-{i}"), int(first_of(row, TRACE_INPUT_TOKENS)), int(first_of(row, TRACE_OUTPUT_TOKENS)),
                       (t - t0) * time_scale, group=str(row.get("group", "default")), index=i)
            for i, (t, row) in enumerate(rows)]


def from_bench_specs(specs: Sequence[Any], token_ids: Sequence[list[int]], offsets: Sequence[float] | None = None
                     ) -> list[SimRequest]:
    """The bench's own RequestSpecs with their prompts tokenized (exact prompts, prefix hits and all)."""
    return [SimRequest(s.request_id, len(ids), s.max_tokens,
                       offsets[i] if offsets is not None else (s.arrival_s or 0.0), group=s.group,
                       prompt_token_ids=list(ids), index=i)
            for i, (s, ids) in enumerate(zip(specs, token_ids))]
