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
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
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
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

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
        n = len(self.token_sampled_ns)
        if n < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)
