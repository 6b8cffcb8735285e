"""The one vocabulary for time (see docs/metrics.md): per-request phase timestamps and the
durations derived from them.

    arrived ─▶ tokenized ─▶ queued ─▶ first scheduled ─▶ prefill chunk k: start/end
      ─▶ first token sampled ─▶ [kv transfer queued/start/end] ─▶ [decode admitted]
      ─▶ token i sampled ─▶ token i sent ─▶ finished(reason)      (+ preempted / resumed)

All timestamps are `time.monotonic_ns()` values taken by the caller (core never reads a clock),
so they compare across processes of one host. Derived durations are in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phaselab.cost.formulas import ModeledCost


# The phases that tile TTFT, in timeline order (RequestMetrics.ttft_components_ns).
TTFT_COMPONENTS = (
    "tokenize", "admission", "queue", "schedule_to_prefill", "prefill_compute", "prefill_wait",
    "post_prefill", "transfer_queue", "transfer", "decode_admission", "delivery",
)


@dataclass
class PrefillChunk:
    iteration_id: int
    start_ns: int
    end_ns: int
    num_tokens: int


@dataclass
class RequestMetrics:
    arrived_ns: int = 0
    tokenized_ns: int | None = None
    queued_ns: int | None = None
    first_scheduled_ns: int | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)  # up to the first token
    recompute_chunks: list[PrefillChunk] = field(default_factory=list)  # after a preemption post-first-token
    first_token_sampled_ns: int | None = None
    kv_transfer_queued_ns: int | None = None  # disaggregated serving only
    kv_transfer_start_ns: int | None = None
    kv_transfer_end_ns: int | None = None
    kv_transfer_bytes: int | None = None
    decode_admitted_ns: int | None = None
    token_sampled_ns: list[int] = field(default_factory=list)
    token_iteration_ids: list[int] = field(default_factory=list)
    token_sent_ns: list[int] = field(default_factory=list)
    preempted_ns: list[int] = field(default_factory=list)
    resumed_ns: list[int] = field(default_factory=list)
    finished_ns: int | None = None
    finish_reason: str | None = None
    request_id: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # prompt tokens whose full blocks began an earlier request too (cache on or off): what a prefix
    # cache could skip (core/kv_cache_manager.py count_repeats)
    num_repeat_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    worker: str = ""  # the worker that prefilled it (disaggregated: also decode_worker)
    decode_worker: str | None = None
    error: str | None = None

    # -- stamping: the one place the engine and the simulator apply the vocabulary's rules ---------
    def stamp_preempted(self, now_ns: int) -> None:
        self.preempted_ns.append(now_ns)
        self.num_preemptions += 1

    def stamp_scheduled(self, iteration_id: int, start_ns: int, end_ns: int, num_tokens: int,
                        is_prefill: bool, num_cached_tokens: int, num_repeat_tokens: int = 0) -> None:
        """One iteration scheduled `num_tokens` of this request between start_ns and end_ns.

        The first one ends the queue; the first after a preemption is the resume; a prefill
        chunk before the first token counts as prefill, one after it as recompute."""
        if self.first_scheduled_ns is None:
            self.first_scheduled_ns = start_ns
            self.num_cached_tokens = max(num_cached_tokens, 0)
            self.num_repeat_tokens = num_repeat_tokens
        if len(self.resumed_ns) < len(self.preempted_ns):
            self.resumed_ns.append(start_ns)
        if is_prefill:
            chunks = self.prefill_chunks if self.first_token_sampled_ns is None else self.recompute_chunks
            chunks.append(PrefillChunk(iteration_id, start_ns, end_ns, num_tokens))

    # -- derived durations (seconds; None when the phase did not happen) ---------------------------
    @staticmethod
    def _span(a: int | None, b: int | None) -> float | None:
        return None if a is None or b is None else (b - a) / 1e9

    @property
    def tokenize_s(self) -> float | None:
        return self._span(self.arrived_ns, self.tokenized_ns)

    @property
    def queue_s(self) -> float | None:
        """Queued (after tokenization) until the scheduler first gave the request tokens."""
        return self._span(self.queued_ns, self.first_scheduled_ns)

    @property
    def prefill_compute_s(self) -> float:
        """Sum of the iterations that carried this request's prefill chunks."""
        return sum(c.end_ns - c.start_ns for c in self.prefill_chunks) / 1e9

    @property
    def prefill_span_s(self) -> float | None:
        """First chunk start to last chunk end: compute plus the waits between chunks."""
        if not self.prefill_chunks:
            return None
        return (self.prefill_chunks[-1].end_ns - self.prefill_chunks[0].start_ns) / 1e9

    @property
    def ttft_s(self) -> float | None:
        """Server-side TTFT: arrived -> first token sent (sampled, where nothing is sent)."""
        first = self.token_sent_ns[0] if self.token_sent_ns else self.first_token_sampled_ns
        return self._span(self.arrived_ns, first)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive sent tokens (sampled, where nothing is sent)."""
        ts = self.token_sent_ns or self.token_sampled_ns
        return [(b - a) / 1e9 for a, b in zip(ts, ts[1:])]

    @property
    def e2e_s(self) -> float | None:
        return self._span(self.arrived_ns, self.finished_ns)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (n_out - 1); None for fewer than two output tokens."""
        n = len(self.token_sampled_ns) or self.num_output_tokens  # a client's record has no sampled stamps
        if n < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    # -- derived durations added for the phase record (obs/): additive, same conventions -----------
    @property
    def admission_s(self) -> float | None:
        """Tokenized until queued in the scheduler (validation, request construction)."""
        return self._span(self.tokenized_ns, self.queued_ns)

    @property
    def prefill_wait_s(self) -> float | None:
        """Time between prefill chunks: prefill span minus prefill compute."""
        if not self.prefill_chunks:
            return None
        return (self._prefill_span_ns() - self._prefill_compute_ns()) / 1e9

    @property
    def transfer_queue_s(self) -> float | None:
        """KV transfer queued until it started (disaggregated serving only)."""
        return self._span(self.kv_transfer_queued_ns, self.kv_transfer_start_ns)

    @property
    def transfer_s(self) -> float | None:
        """KV transfer start to end (disaggregated serving only)."""
        return self._span(self.kv_transfer_start_ns, self.kv_transfer_end_ns)

    @property
    def decode_admission_wait_s(self) -> float | None:
        """KV transfer end until the decode worker admitted the request."""
        return self._span(self.kv_transfer_end_ns, self.decode_admitted_ns)

    @property
    def decode_s(self) -> float | None:
        """First token sampled until finished (vLLM's decode time starts at the same point)."""
        return self._span(self.first_token_sampled_ns, self.finished_ns)

    @property
    def delivery_s(self) -> list[float]:
        """Per token: sampled -> sent (only tokens that have both timestamps)."""
        return [(b - a) / 1e9 for a, b in zip(self.token_sampled_ns, self.token_sent_ns)]

    @property
    def first_token_sent_ns(self) -> int | None:
        """TTFT's end: the first token sent (sampled, where nothing is sent)."""
        return self.token_sent_ns[0] if self.token_sent_ns else self.first_token_sampled_ns

    def _prefill_compute_ns(self) -> int:
        return sum(c.end_ns - c.start_ns for c in self.prefill_chunks)

    def _prefill_span_ns(self) -> int:
        return self.prefill_chunks[-1].end_ns - self.prefill_chunks[0].start_ns if self.prefill_chunks else 0

    def ttft_components_ns(self) -> dict[str, int]:
        """TTFT (arrived -> first token sent) tiled into consecutive phases, in ns; sums exactly.

        A cursor walks the milestones in vocabulary order; each phase gets cursor -> its
        milestone. A missing milestone, or one after the first token was sent, is skipped (its
        phase adds 0); one earlier than the cursor adds 0. So the parts always tile
        [arrived, first sent], whatever the deployment. Disaggregated: the KV transfer counts only
        where the first token is sent after it (e.g. by the decode worker); `transfer_queue` runs
        from the first token sampled to the transfer start; `delivery` is the rest up to the send.
        Empty before a first token exists.
        """
        end = self.first_token_sent_ns
        if end is None:
            return {}
        parts = dict.fromkeys(TTFT_COMPONENTS, 0)
        cursor = self.arrived_ns

        def advance(phase: str, milestone: int | None) -> None:
            nonlocal cursor
            if milestone is not None and milestone <= end:
                reached = max(milestone, cursor)
                parts[phase] += reached - cursor
                cursor = reached

        advance("tokenize", self.tokenized_ns)
        advance("admission", self.queued_ns)
        advance("queue", self.first_scheduled_ns)
        if self.prefill_chunks:
            advance("schedule_to_prefill", self.prefill_chunks[0].start_ns)
            advance("prefill_compute", self.prefill_chunks[-1].end_ns)
            # the chunk region [first start, last end] splits into compute and the waits between
            region = parts["prefill_compute"]
            parts["prefill_compute"] = min(region, self._prefill_compute_ns())
            parts["prefill_wait"] = region - parts["prefill_compute"]
        advance("post_prefill", self.first_token_sampled_ns)
        advance("transfer_queue", self.kv_transfer_queued_ns)
        advance("transfer_queue", self.kv_transfer_start_ns)
        advance("transfer", self.kv_transfer_end_ns)
        advance("decode_admission", self.decode_admitted_ns)
        parts["delivery"] = end - cursor
        return parts

    def ttft_components(self) -> dict[str, float]:
        """`ttft_components_ns()` in seconds (sums to ttft_s up to float rounding)."""
        return {k: v / 1e9 for k, v in self.ttft_components_ns().items()}


@dataclass
class ScheduledChunk:
    request_id: str
    num_tokens: int
    is_prefill: bool
    context_len: int  # tokens in the cache after this chunk


@dataclass
class IterationRecord:
    """One scheduler iteration of one worker: when, how long each part took, what it carried."""

    iteration_id: int
    worker: str
    role: str  # "colocated" | "prefill" | "decode"
    start_ns: int  # before schedule()
    end_ns: int  # after the outputs were handled
    schedule_ns: int = 0
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    output_ns: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    num_running: int = 0
    num_waiting: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    modeled: ModeledCost = field(default_factory=ModeledCost)
    # The adaptive prefill budget (SchedulerConfig.slo_tbt_ms, docs/slo.md); None under a fixed budget.
    # Measured time is end_ns - start_ns, the same span the TBT target bounds.
    prefill_budget: int | None = None  # prefill tokens the policy allowed in this iteration
    budget_reason: str | None = None  # core.slo.BudgetDecision.reason: target | all-prefill-fits | infeasible ...
    slo_tbt_s: float | None = None  # the target it aimed at (under target x (1 - margin))
    slo_feasible: bool | None = None  # False: even min_chunk (or the decodes alone) was predicted over it
    predicted_ns: int | None = None  # the online cost model's time for this plan, before it learned from it
    # MEASURED inside a step whose forward ran as one native decode call (model/kernels/decode_layers.c,
    # its per-kernel timers; None on every other step): attention = RoPE + K/V write + paged attention
    # over the history; linear = the layers' four projections and the LM head; elementwise = norms,
    # SiLU * up and the embedding rows. The rest of the step (other_ns) is Python, scheduling, sampling
    # and output handling.
    attention_ns: int | None = None
    linear_ns: int | None = None
    elementwise_ns: int | None = None

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def has_split(self) -> bool:
        return self.attention_ns is not None

    @property
    def other_ns(self) -> int | None:
        """The step's time outside the native call's kernels (None without a measured split)."""
        if self.attention_ns is None:
            return None
        return (self.end_ns - self.start_ns) - self.attention_ns - (self.linear_ns or 0) - (self.elementwise_ns or 0)


def with_split(rec: IterationRecord, split_ns: dict[str, int] | None) -> IterationRecord:
    """`rec` with its measured split from an executor's StepResult.split_ns (unchanged when None)."""
    if split_ns is not None:
        rec.attention_ns = int(split_ns.get("attention", 0))
        rec.linear_ns = int(split_ns.get("linear", 0))
        rec.elementwise_ns = int(split_ns.get("elementwise", 0))
    return rec
