"""The one plain-data contract between the scheduler and whatever executes its plan.

    scheduler.schedule() -> SchedulerOutput ──▶ executor.execute(plan) -> StepResult
    scheduler.update(plan, result) -> list[RequestDelta]

The torch runner, the simulator's cost model and the disaggregated workers all read the same
objects. Everything here is plain Python (ints, lists, dataclasses) so it pickles cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from phaselab.core.sampling_params import SamplingParams
from phaselab.core.adaptive_budget import BudgetDecision


@dataclass
class ScheduledRequest:
    """One request's share of one iteration: compute `token_ids` at positions
    `start_position .. start_position + len(token_ids) - 1`, reading/writing K/V through
    `block_ids` (the full block table after this step's allocation)."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    new_block_ids: list[int]
    sample: bool  # this chunk reaches the last known token: the executor samples one token
    is_prefill: bool  # phase label of this chunk (see Request.is_prefill)
    sampling_params: SamplingParams
    num_output_tokens: int = 0  # tokens sampled so far (min_tokens, seeded-draw bookkeeping)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this chunk is written (prefix + chunk)."""
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    iteration_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # requests finished or aborted since the previous plan: executors drop their per-request state
    finished_request_ids: list[str] = field(default_factory=list)
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    budget: BudgetDecision | None = None  # the adaptive prefill budget's decision (slo_tbt_ms), else None
    block_size: int = 0  # tokens per KV block (0: not known, e.g. a synthetic plan; no shared-read count)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled if not s.is_prefill)


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (from the raw model logits)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepResult:
    iteration_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # measured durations of the step's parts (ns), filled by the executor
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    # the forward's own split where it ran as one native decode call, timed inside it (ns per kind:
    # attention, linear, elementwise; timing.IterationRecord names them); None where it did not
    split_ns: dict[str, int] | None = None


@dataclass
class RequestDelta:
    """What one iteration changed for one request, as the engine's output side needs it."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: TokenLogprobs | None = None


@dataclass
class EngineStats:
    """What a serving front may read of an engine between steps (ServingEngine.stats()): queue
    lengths, KV usage, and what the phase recorder holds (bounded when records are not kept)."""

    num_waiting: int  # queued or prefilling (disaggregated: not decoding yet)
    num_running: int
    num_unfinished: int
    kv_usage: float  # fraction of KV blocks in use (disaggregated: over every live worker)
    num_blocks_used: int
    records: dict[str, int] = field(default_factory=dict)  # PhaseRecorder.stats()
    # why no new request can be served now (disaggregated: a role without a live worker); None: it can
    unavailable: str | None = None


def shape_plan(iteration_id: int, chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int],
               block_ids: Sequence[int], block_size: int) -> SchedulerOutput:
    """A synthetic plan of the given shape over borrowed blocks (shared between its entries: only
    the time is wanted, the K/V written are garbage). Decodes and chunk ends sample greedily."""
    greedy = SamplingParams(temperature=0.0)
    plan = SchedulerOutput(iteration_id=iteration_id)
    entries = [(n, s, True) for n, s in chunks] + [(1, c - 1, False) for c in decode_contexts]
    for i, (n, start, is_prefill) in enumerate(entries):
        num_table = -(-(start + n) // block_size)
        table = [block_ids[(i + j) % len(block_ids)] for j in range(num_table)]
        plan.scheduled.append(ScheduledRequest(
            request_id=f"warm-up-{iteration_id}-{i}", token_ids=[(7 * j + i) % 1000 + 1 for j in range(n)],
            start_position=start, block_ids=table, new_block_ids=[], sample=True, is_prefill=is_prefill,
            sampling_params=greedy))
    return plan
