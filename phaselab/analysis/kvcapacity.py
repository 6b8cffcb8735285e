"""KV capacity: the time a request lost because the KV cache was full, from its own record.

One cause for one mechanism. A full cache costs a request three ways, each taken from where it
happened, never from gaps between sent tokens (a gap can be long for other reasons):

    preempted ─ readmission wait ─ resumed ─ recompute chunks ─ (decoding again)
    queued ─ [iterations with a free slot but too few free blocks for this request] ─ first scheduled

- **preemptions**: the record's own preemption events (`RequestMetrics.preempted_ns`, stamped by
  the scheduler when it preempts), so the count equals the scheduler's.
- **recompute**: the compute of the chunks that rebuilt the lost KV: `recompute_chunks` (after the
  first token) and, for a request preempted before its first token, the prefill chunks after the
  resume up to the tokens it had computed before (prorated within a chunk).
- **readmission wait**: preempted -> resumed (waiting in the queue for blocks again).
- **block wait**: the part of the first queue wait spent in iterations of its worker that had a
  free running slot (`num_running < max_num_seqs`) but fewer free blocks than the request's first
  chunk needs: it waited for KV, not for a slot.

`intervals()` gives the time spans on the request's own timeline; the accounting moves the time
they cover from the phase they fell in (queue, prefill, a gap) to the cause `kv-capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phaselab.core.timing import IterationRecord, RequestMetrics


@dataclass
class KVLoss:
    """One request's KV-capacity time, by kind, and the spans it covers (ns, on its timeline)."""

    num_preemptions: int = 0
    recompute: list[tuple[int, int]] = field(default_factory=list)
    readmission: list[tuple[int, int]] = field(default_factory=list)
    block_wait: list[tuple[int, int]] = field(default_factory=list)

    @staticmethod
    def _sum(spans: list[tuple[int, int]]) -> float:
        return sum(b - a for a, b in spans) / 1e9

    @property
    def recompute_s(self) -> float:
        return self._sum(self.recompute)

    @property
    def readmission_s(self) -> float:
        return self._sum(self.readmission)

    @property
    def block_wait_s(self) -> float:
        return self._sum(self.block_wait)

    def spans(self) -> list[tuple[int, int]]:
        return self.recompute + self.readmission + self.block_wait


@dataclass(frozen=True)
class Limits:
    block_size: int
    max_num_seqs: int | None
    max_num_batched_tokens: int | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Limits:
        sched = config.get("scheduler") or {}
        cache = config.get("cache") or {}
        bs = cache.get("block_size") or config.get("block_size") or 16
        return cls(int(bs), sched.get("max_num_seqs"), sched.get("max_num_batched_tokens"))


def _recompute_before_first_token(m: RequestMetrics) -> list[tuple[int, int]]:
    """Prefill chunks after a pre-first-token resume that rebuilt tokens computed before it."""
    spans: list[tuple[int, int]] = []
    cuts = sorted(t for t in m.preempted_ns if m.first_token_sampled_ns is None or t < m.first_token_sampled_ns)
    if not cuts:
        return spans
    computed = lost = 0
    k = 0
    for c in m.prefill_chunks:
        while k < len(cuts) and cuts[k] <= c.start_ns:  # a preemption before this chunk: all of it is lost
            lost, computed, k = lost + computed, 0, k + 1
        redo = min(c.num_tokens, lost)
        if redo > 0 and c.num_tokens > 0:
            spans.append((c.start_ns, c.start_ns + (c.end_ns - c.start_ns) * redo // c.num_tokens))
            lost -= redo
        computed += c.num_tokens
    return spans


def request_loss(m: RequestMetrics, iterations: list[IterationRecord], limits: Limits) -> KVLoss:
    """`iterations`: the iterations of the request's (first) worker, in id order."""
    loss = KVLoss(num_preemptions=len(m.preempted_ns))
    for k, p in enumerate(m.preempted_ns):
        if k < len(m.resumed_ns) and m.resumed_ns[k] > p:
            loss.readmission.append((p, m.resumed_ns[k]))
        elif k >= len(m.resumed_ns) and m.finished_ns is not None and m.finished_ns > p:
            loss.readmission.append((p, m.finished_ns))  # never readmitted (aborted while waiting)
    loss.recompute = [(c.start_ns, c.end_ns) for c in m.recompute_chunks] + _recompute_before_first_token(m)
    if m.queued_ns is not None and m.first_scheduled_ns is not None and limits.max_num_seqs:
        need_tokens = max(1, m.num_prompt_tokens - max(m.num_cached_tokens, 0))
        if limits.max_num_batched_tokens:
            need_tokens = min(need_tokens, limits.max_num_batched_tokens)
        need_blocks = -(-need_tokens // limits.block_size)
        for r in iterations:
            if r.end_ns <= m.queued_ns or r.start_ns >= m.first_scheduled_ns:
                continue
            if r.num_running < limits.max_num_seqs and r.num_blocks_free < need_blocks:
                loss.block_wait.append((max(r.start_ns, m.queued_ns), min(r.end_ns, m.first_scheduled_ns)))
    return loss


def overlap_ns(a: int, b: int, spans: list[tuple[int, int]]) -> int:
    """Length of [a, b] covered by `spans` (which do not overlap each other)."""
    return sum(max(0, min(b, s1) - max(a, s0)) for s0, s1 in spans)
