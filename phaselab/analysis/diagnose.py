"""`phaselab diagnose RUN_DIR`: which phase is slow, why, and what would fix it.

Works through the symptom table of DESIGN.md section 1, row by row, on a run directory
(docs/run-directory.md) and ranks the causes:

    what the user sees                          what is measured here
    first token later as prompts grow      ->   TTFT tiled into its phases (p50/p90/p99);
                                                prefill compute vs input length (slope, R^2, bend)
    later tokens slow down with history    ->   decode step time vs batch and context; MODELED KV
                                                bytes read per step; achieved vs machine bandwidth
    a new long prompt freezes the streams  ->   gaps of running streams aligned with the iterations
                                                that carried other requests' prefill (named)
    disaggregated servers move state       ->   KV bytes, bandwidth, transfer share, decode
                                                admission waits, busy fraction of each pool

**Ranking.** Every request's end-to-end time is cut into causes that sum to it exactly
(`analysis/accounting.py`): queue, prefill, transfer, stall, preemption, decode-kv, decode-step,
overhead. A cause's score is its share of the run's summed E2E: the share of all the time users
spent waiting that it explains. Causes are ranked by that share; each finding carries its key
figure, the evidence, the change it suggests and the number that would show the change worked.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from phaselab.analysis import fmt
from phaselab.analysis.accounting import CAUSES, STALL_FACTOR, Gap, RunAccount, account_run
from phaselab.analysis.doc import Doc, render_html, render_markdown, render_text
from phaselab.analysis.machine import Ceilings, load_ceilings, simulated_ceilings
from phaselab.analysis.stats import (
    LinearFit,
    MultiFit,
    linear_fit,
    multi_fit,
    nearest_rank_index,
    percentile,
    upward_bend,
)
from phaselab.core.timing import TTFT_COMPONENTS, IterationRecord, RequestMetrics
from phaselab.obs.rundir import RunData, read_run_dir

TITLES = {
    "queue": "first token slow: requests wait in the queue",
    "prefill": "first token slow: prefill compute",
    "transfer": "disaggregated servers spend time moving KV state",
    "stall": "a new prompt pauses the other streams",
    "preemption": "KV capacity: preempted requests recompute",
    "decode-kv": "later tokens slow down as the history grows (KV reads)",
    "decode-step": "later tokens: the per-step cost (weights read every step)",
    "decode": "later tokens: decode time (not split: no iteration records)",
    "overhead": "tokenization, admission and delivery overhead",
}
PERCENTILES = (50, 90, 99)
FIT_R2 = 0.3  # a fit explaining less than this is reported as "no clear dependence"


@dataclass
class KeyFigure:
    name: str
    value: float
    unit: str  # "share" (0-1), "s", "B/s", "ms/token"

    def text(self) -> str:
        if self.unit == "share":
            return f"{self.name} {fmt.pct(self.value)}"
        if self.unit == "s":
            return f"{self.name} {fmt.s(self.value)}"
        if self.unit == "B/s":
            return f"{self.name} {fmt.rate(self.value)}"
        return f"{self.name} {self.value:.3g} {self.unit}"


@dataclass
class Finding:
    cause: str
    title: str
    share: float  # of the run's summed E2E: the ranking score
    seconds: float
    key: KeyFigure
    verdict: str
    evidence: list[str]
    change: str
    check: str


# -- the analyses of each symptom row ------------------------------------------------------------------------
@dataclass
class TtftBreakdown:
    """TTFT tiled into phases: the aggregate (sum of each phase / sum of TTFT) and the breakdown of
    the request at each TTFT percentile (nearest rank: a request that happened, so its shares are
    exactly its phase record's and sum to 100%)."""

    components: list[str]
    total_s: dict[str, float]  # phase -> seconds summed over requests
    ttft_total_s: float
    at: dict[int, tuple[str, float, dict[str, float]]]  # percentile -> (request, ttft_s, phase -> s)

    def share(self, phase: str) -> float:
        return self.total_s[phase] / self.ttft_total_s if self.ttft_total_s > 0 else 0.0

    def shares_at(self, p: int) -> dict[str, float]:
        _, ttft, parts = self.at[p]
        return {k: (v / ttft if ttft > 0 else 0.0) for k, v in parts.items()}


def ttft_breakdown(requests: list[RequestMetrics]) -> TtftBreakdown | None:
    rows = [(m, m.ttft_components()) for m in requests if m.first_token_sent_ns is not None]
    rows = [(m, parts) for m, parts in rows if parts]
    if not rows:
        return None
    totals = dict.fromkeys(TTFT_COMPONENTS, 0.0)
    for _, parts in rows:
        for k, v in parts.items():
            totals[k] += v
    ttft_total = sum(sum(parts.values()) for _, parts in rows)
    rows.sort(key=lambda r: r[0].first_token_sent_ns - r[0].arrived_ns)  # type: ignore[operator]
    ttfts = [sum(parts.values()) for _, parts in rows]
    at = {}
    for p in PERCENTILES:
        m, parts = rows[nearest_rank_index(ttfts, p)]
        at[p] = (m.request_id, sum(parts.values()), parts)
    return TtftBreakdown(list(TTFT_COMPONENTS), totals, ttft_total, at)


@dataclass
class QueueAnalysis:
    share_of_ttft: float | None
    queue_p50_s: float | None
    queue_p99_s: float | None
    arrival_rate: float | None  # requests/s over the arrival window
    service_rate: float | None  # requests/s while busy
    growth: LinearFit | None  # queue_s against arrival offset (s of queue per s of run)
    first_third_s: float | None
    last_third_s: float | None
    max_waiting: int | None  # from the iteration records (None: not known)
    frac_at_max_seqs: float | None  # iterations whose running count was at max_num_seqs
    max_kv_usage: float | None

    @property
    def growing(self) -> bool:
        if self.growth is None or self.first_third_s is None or self.last_third_s is None:
            return False
        return self.growth.slope > 0.05 and self.last_third_s > 1.5 * self.first_third_s + 1e-3


def queue_analysis(run: RunData, ttft: TtftBreakdown | None) -> QueueAnalysis:
    reqs = sorted((m for m in run.requests if m.queue_s is not None), key=lambda m: m.arrived_ns)
    qs: list[float] = [m.queue_s for m in reqs if m.queue_s is not None]
    arrivals = [m.arrived_ns for m in reqs]
    arrival_rate = service_rate = None
    if len(reqs) >= 2 and arrivals[-1] > arrivals[0]:
        arrival_rate = (len(reqs) - 1) / ((arrivals[-1] - arrivals[0]) / 1e9)
    starts = [m.first_scheduled_ns for m in run.requests if m.first_scheduled_ns is not None]
    ends = [m.finished_ns for m in run.requests if m.finished_ns is not None]
    if starts and ends and max(ends) > min(starts):
        service_rate = len(ends) / ((max(ends) - min(starts)) / 1e9)
    growth = linear_fit([(a - arrivals[0]) / 1e9 for a in arrivals], qs) if reqs else None
    third = max(1, len(qs) // 3)
    max_seqs = (run.config.get("scheduler") or {}).get("max_num_seqs")
    its = run.iterations
    frac = None
    if its and max_seqs:
        frac = sum(1 for r in its if r.num_running >= max_seqs) / len(its)
    usage = [r.num_blocks_used / (r.num_blocks_used + r.num_blocks_free) for r in its
             if r.num_blocks_used + r.num_blocks_free > 0]
    return QueueAnalysis(
        share_of_ttft=ttft.share("queue") if ttft else None,
        queue_p50_s=percentile(qs, 50), queue_p99_s=percentile(qs, 99),
        arrival_rate=arrival_rate, service_rate=service_rate, growth=growth,
        first_third_s=sum(qs[:third]) / third if qs else None,
        last_third_s=sum(qs[-third:]) / third if qs else None,
        max_waiting=max((r.num_waiting for r in its), default=0), frac_at_max_seqs=frac,
        max_kv_usage=max(usage) if usage else None,
    )


@dataclass
class PrefillAnalysis:
    share_of_ttft: float | None
    points: list[tuple[int, float]]  # (uncached prompt tokens, prefill s apportioned by tokens) per request
    fit: LinearFit | None  # seconds against tokens
    bend_ratio: float | None
    bends_upward: bool
    tokens_per_s: float | None  # over prefill-only iterations
    achieved_flops: float | None  # MODELED FLOPs / measured time, prefill-only iterations
    mean_chunks: float | None
    wait_share_of_ttft: float | None
    prefix_hit_rate: float | None


def prefill_points(run: RunData) -> list[tuple[int, float]]:
    """(uncached prompt tokens, prefill time) per request. A chunk's time is its iteration's
    duration, apportioned by tokens when the iteration also computed other requests' tokens (a batched
    prefill, or decodes riding along): each token of an iteration costs about the same
    projections, so the points stay comparable across batching."""
    by_key = {(r.worker, r.iteration_id): r for r in run.iterations}
    pts = []
    for m in run.requests:
        if not m.prefill_chunks:
            continue
        t = 0.0
        for c in m.prefill_chunks:
            rec = by_key.get((m.worker, c.iteration_id))
            tokens = rec.num_prefill_tokens + rec.num_decode_tokens if rec else 0
            share = c.num_tokens / tokens if rec and tokens > 0 else 1.0
            t += (c.end_ns - c.start_ns) / 1e9 * min(1.0, share)
        pts.append((m.num_prompt_tokens - m.num_cached_tokens, t))
    return pts


def prefill_analysis(run: RunData, ttft: TtftBreakdown | None) -> PrefillAnalysis:
    pts = prefill_points(run)
    fit = linear_fit([p[0] for p in pts], [p[1] for p in pts])
    bend = upward_bend([p[0] for p in pts], [p[1] for p in pts])
    pure = [r for r in run.iterations if r.num_prefill_tokens > 0 and r.num_decode_tokens == 0]
    t = sum(r.duration_s for r in pure)
    chunks = [len(m.prefill_chunks) for m in run.requests if m.prefill_chunks]
    prompt = sum(m.num_prompt_tokens for m in run.requests)
    share = None
    wait = None
    if ttft:
        share = sum(ttft.share(k) for k in ("schedule_to_prefill", "prefill_compute", "prefill_wait", "post_prefill"))
        wait = ttft.share("prefill_wait")
    return PrefillAnalysis(
        share_of_ttft=share, points=pts, fit=fit,
        bend_ratio=bend.ratio if bend else None, bends_upward=bool(bend and bend.bends_upward),
        tokens_per_s=sum(r.num_prefill_tokens for r in pure) / t if t > 0 else None,
        achieved_flops=sum(r.modeled.flops for r in pure) / t if t > 0 else None,
        mean_chunks=sum(chunks) / len(chunks) if chunks else None,
        wait_share_of_ttft=wait,
        prefix_hit_rate=sum(m.num_cached_tokens for m in run.requests) / prompt if prompt else None,
    )


@dataclass
class DecodeBucket:
    batch_lo: int
    batch_hi: int
    steps: int
    step_s: float
    context: float  # mean total context tokens per step
    kv_read_bytes: float  # MODELED, mean per step
    bandwidth: float  # MODELED bytes / measured time


@dataclass
class DecodeAnalysis:
    num_steps: int
    step_p50_s: float | None
    step_p99_s: float | None
    kv_share: float | None  # MODELED KV-read bytes / all bytes, over decode-only steps (time-weighted)
    kv_read_per_step: float | None  # MODELED bytes
    weight_per_step: float | None  # MODELED bytes
    bandwidth_p50: float | None  # MODELED bytes / measured time
    fit: MultiFit | None  # step s = a + b * batch + c * context tokens
    context_fit: LinearFit | None  # step s against context tokens
    buckets: list[DecodeBucket]
    itl_p50_s: float | None
    itl_p99_s: float | None
    tpot_p50_s: float | None


def _decode_steps(iterations: list[IterationRecord]) -> list[IterationRecord]:
    return [r for r in iterations if r.num_prefill_tokens == 0 and r.num_decode_tokens > 0]


def decode_analysis(run: RunData) -> DecodeAnalysis:
    steps = _decode_steps(run.iterations)
    itls = [g for m in run.requests for g in m.itl_s]
    tpots = [m.tpot_s for m in run.requests if m.tpot_s is not None]
    if not steps:
        return DecodeAnalysis(0, None, None, None, None, None, None, None, None, [],
                              percentile(itls, 50), percentile(itls, 99), percentile(tpots, 50))
    durs = [r.duration_s for r in steps]
    ctx = [float(sum(c.context_len for c in r.chunks)) for r in steps]
    batch = [float(r.num_decode_tokens) for r in steps]
    total_t = sum(durs)
    kv_share = (sum(r.modeled.kv_read_bytes / r.modeled.total_bytes * r.duration_s for r in steps
                    if r.modeled.total_bytes) / total_t) if total_t > 0 else None
    bws = [r.modeled.total_bytes / r.duration_s for r in steps if r.duration_s > 0]
    buckets = []
    edges = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1 << 30]
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in steps if lo <= r.num_decode_tokens < hi]
        if not sel:
            continue
        t = sum(r.duration_s for r in sel)
        buckets.append(DecodeBucket(
            lo, hi - 1, len(sel), t / len(sel), sum(sum(c.context_len for c in r.chunks) for r in sel) / len(sel),
            sum(r.modeled.kv_read_bytes for r in sel) / len(sel),
            sum(r.modeled.total_bytes for r in sel) / t if t > 0 else 0.0))
    return DecodeAnalysis(
        num_steps=len(steps), step_p50_s=percentile(durs, 50), step_p99_s=percentile(durs, 99),
        kv_share=kv_share,
        kv_read_per_step=sum(r.modeled.kv_read_bytes for r in steps) / len(steps),
        weight_per_step=sum(r.modeled.weight_bytes for r in steps) / len(steps),
        bandwidth_p50=percentile(bws, 50),
        fit=multi_fit([batch, ctx], durs), context_fit=linear_fit(ctx, durs), buckets=buckets,
        itl_p50_s=percentile(itls, 50), itl_p99_s=percentile(itls, 99), tpot_p50_s=percentile(tpots, 50),
    )


@dataclass
class Culprit:
    """One iteration that carried other requests' prefill while streams waited."""

    worker: str
    iteration_id: int
    duration_s: float
    prefill_tokens: int
    requests: dict[str, int]  # request -> prefill tokens in it
    streams: set[str] = field(default_factory=set)
    max_gap_s: float = 0.0


@dataclass
class StallAnalysis:
    gaps: list[Gap]  # every gap with an interference excess
    stalls: list[Gap]  # those longer than STALL_FACTOR x their baseline
    total_excess_s: float
    max_stall_s: float  # longest gap that overlapped another request's prefill (0 if none)
    culprits: list[Culprit]  # by stalled streams x duration, most harmful first


def stall_analysis(account: RunAccount, iterations: list[IterationRecord]) -> StallAnalysis:
    gaps = [g for g in account.gaps if g.cause == "stall"]
    by_key = {(r.worker, r.iteration_id): r for r in iterations}
    culprits: dict[tuple[str, int], Culprit] = {}
    for g in gaps:
        for iid in g.iteration_ids:
            rec = by_key.get((g.worker, iid))
            if rec is None:
                continue
            c = culprits.get((g.worker, iid))
            if c is None:
                reqs = {ch.request_id: ch.num_tokens for ch in rec.chunks if ch.is_prefill}
                c = culprits[(g.worker, iid)] = Culprit(g.worker, iid, rec.duration_s, rec.num_prefill_tokens, reqs)
            c.streams.add(g.request_id)
            c.max_gap_s = max(c.max_gap_s, g.gap_s)
    ranked = sorted(culprits.values(), key=lambda c: (len(c.streams) * c.duration_s, c.prefill_tokens), reverse=True)
    return StallAnalysis(gaps, [g for g in gaps if g.is_stall()], sum(g.excess_s for g in gaps),
                         max((g.gap_s for g in gaps), default=0.0), ranked)


@dataclass
class PoolBusy:
    role: str
    workers: dict[str, float]  # worker -> busy fraction over the run window

    @property
    def mean(self) -> float:
        return sum(self.workers.values()) / len(self.workers) if self.workers else 0.0


@dataclass
class DisaggAnalysis:
    num_transfers: int
    bytes_total: int
    bytes_mean: float | None
    transfer_p50_s: float | None
    transfer_p99_s: float | None
    bandwidth: float | None  # sum bytes / sum transfer time
    transfer_queue_p50_s: float | None
    admission_wait_p50_s: float | None
    admission_wait_p99_s: float | None
    share_of_ttft: float | None  # transfer phases inside TTFT
    share_of_first_gap: float | None  # transfer time inside the gap after the first token
    pools: list[PoolBusy]

    @property
    def imbalance(self) -> float | None:
        """Busiest pool's mean busy fraction / least busy pool's (1 = balanced)."""
        means = [p.mean for p in self.pools if p.workers]
        if len(means) < 2 or min(means) <= 0:
            return None
        return max(means) / min(means)


def run_window_ns(run: RunData) -> tuple[int, int] | None:
    starts = [m.arrived_ns for m in run.requests] + [r.start_ns for r in run.iterations]
    ends = [m.finished_ns for m in run.requests if m.finished_ns] + [r.end_ns for r in run.iterations]
    if not starts or not ends:
        return None
    return min(starts), max(ends)


def pool_busy(run: RunData) -> list[PoolBusy]:
    window = run_window_ns(run)
    if window is None or window[1] <= window[0]:
        return []
    span = (window[1] - window[0]) / 1e9
    busy: dict[str, float] = defaultdict(float)
    roles: dict[str, str] = {}
    for r in run.iterations:
        busy[r.worker] += r.duration_s
        roles[r.worker] = r.role
    pools: dict[str, PoolBusy] = {}
    for w in sorted(busy):
        pools.setdefault(roles[w], PoolBusy(roles[w], {})).workers[w] = busy[w] / span
    return list(pools.values())


def disagg_analysis(run: RunData, account: RunAccount, ttft: TtftBreakdown | None) -> DisaggAnalysis | None:
    moved = [m for m in run.requests if m.transfer_s is not None]
    roles = {r.role for r in run.iterations}
    if not moved and not ({"prefill", "decode"} & roles):
        return None
    times: list[float] = [m.transfer_s for m in moved if m.transfer_s is not None]
    nbytes = [m.kv_transfer_bytes or 0 for m in moved]
    t_total = sum(times)
    first_gaps = []
    in_gap = 0.0
    for m in moved:
        ts = m.token_sent_ns or m.token_sampled_ns
        if len(ts) >= 2:
            first_gaps.append((ts[1] - ts[0]) / 1e9)
    gap_transfer = sum(a.parts["transfer"] for a in account.requests) - (
        sum(ttft.total_s[k] for k in ("transfer_queue", "transfer", "decode_admission")) if ttft else 0.0)
    if first_gaps and sum(first_gaps) > 0:
        in_gap = max(0.0, gap_transfer) / sum(first_gaps)
    waits = [m.decode_admission_wait_s for m in moved if m.decode_admission_wait_s is not None]
    tq = [m.transfer_queue_s for m in moved if m.transfer_queue_s is not None]
    return DisaggAnalysis(
        num_transfers=len(moved), bytes_total=sum(nbytes), bytes_mean=sum(nbytes) / len(moved) if moved else None,
        transfer_p50_s=percentile(times, 50), transfer_p99_s=percentile(times, 99),
        bandwidth=sum(nbytes) / t_total if t_total > 0 else None,
        transfer_queue_p50_s=percentile(tq, 50),
        admission_wait_p50_s=percentile(waits, 50), admission_wait_p99_s=percentile(waits, 99),
        share_of_ttft=(sum(ttft.share(k) for k in ("transfer_queue", "transfer", "decode_admission"))
                       if ttft else None),
        share_of_first_gap=in_gap if first_gaps else None,
        pools=pool_busy(run),
    )


# -- the run summary (the compare table's row) ---------------------------------------------------------------------
@dataclass
class RunSummary:
    num_requests: int
    duration_s: float
    output_tokens: int
    output_throughput: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    max_stall_s: float
    num_stalls: int
    ttft_shares: dict[str, float]  # cause -> share of summed TTFT
    transfer_bytes: int
    transfer_bandwidth: float | None
    busy: dict[str, float]  # worker -> busy fraction


def summarize(run: RunData, account: RunAccount, ttft: TtftBreakdown | None, stalls: StallAnalysis,
              disagg: DisaggAnalysis | None) -> RunSummary:
    window = run_window_ns(run)
    duration = (window[1] - window[0]) / 1e9 if window else 0.0
    out_tokens = sum(m.num_output_tokens for m in run.requests)
    ttfts = [m.ttft_s for m in run.requests if m.ttft_s is not None]
    itls = [g for m in run.requests for g in m.itl_s]
    tpots = [m.tpot_s for m in run.requests if m.tpot_s is not None]
    e2es = [m.e2e_s for m in run.requests if m.e2e_s is not None]
    shares: dict[str, float] = defaultdict(float)
    if ttft:
        from phaselab.analysis.accounting import TTFT_CAUSE

        for k in ttft.components:
            shares[TTFT_CAUSE[k]] += ttft.share(k)
    return RunSummary(
        num_requests=len(run.requests), duration_s=duration, output_tokens=out_tokens,
        output_throughput=out_tokens / duration if duration > 0 else None,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50), itl_p99_s=percentile(itls, 99), tpot_p50_s=percentile(tpots, 50),
        e2e_p50_s=percentile(e2es, 50), max_stall_s=stalls.max_stall_s, num_stalls=len(stalls.stalls),
        ttft_shares=dict(shares), transfer_bytes=disagg.bytes_total if disagg else 0,
        transfer_bandwidth=disagg.bandwidth if disagg else None,
        busy={w: f for p in (disagg.pools if disagg else pool_busy(run)) for w, f in p.workers.items()},
    )


# -- the diagnosis ---------------------------------------------------------------------------------------------------
@dataclass
class Diagnosis:
    path: str | None
    source: str  # "engine" (offline or server phase record), "disagg", "client"; "simulated ..." (phaselab/sim)
    config: dict[str, Any]
    summary: RunSummary
    account: RunAccount
    findings: list[Finding]  # ranked, highest share first
    ttft: TtftBreakdown | None
    queue: QueueAnalysis | None
    prefill: PrefillAnalysis | None
    decode: DecodeAnalysis | None
    stalls: StallAnalysis | None
    disagg: DisaggAnalysis | None
    ceilings: Ceilings
    notes: list[str] = field(default_factory=list)
    external: dict[str, Any] | None = None  # client run: what the server's /metrics said

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def finding(self, cause: str) -> Finding | None:
        return next((f for f in self.findings if f.cause == cause), None)

    def to_doc(self) -> Doc:
        from phaselab.analysis.diagnose_doc import diagnosis_doc

        return diagnosis_doc(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "source": self.source,
            "ranking": [{"rank": i + 1, "cause": f.cause, "title": f.title, "share": f.share, "seconds": f.seconds,
                         "key_figure": asdict(f.key), "verdict": f.verdict, "evidence": f.evidence,
                         "change": f.change, "check": f.check} for i, f in enumerate(self.findings)],
            "time_shares": self.account.shares, "time_seconds": self.account.totals,
            "summary": asdict(self.summary),
            "ttft": None if self.ttft is None else {
                "total_s": self.ttft.total_s, "ttft_total_s": self.ttft.ttft_total_s,
                "shares": {k: self.ttft.share(k) for k in self.ttft.components},
                "at": {str(p): {"request_id": rid, "ttft_s": t, "parts_s": parts,
                                "shares": self.ttft.shares_at(p)} for p, (rid, t, parts) in self.ttft.at.items()}},
            "ceilings": asdict(self.ceilings), "notes": self.notes, "external": self.external,
        }


def _policy(config: dict[str, Any]) -> tuple[str | None, int | None]:
    sched = config.get("scheduler") or {}
    if not sched and config.get("workers"):  # disaggregated: the prefill workers' scheduler
        for w in config["workers"].values():
            if w.get("role") == "prefill" and (w.get("engine") or {}).get("scheduler"):
                sched = w["engine"]["scheduler"]
                break
    return sched.get("policy"), sched.get("max_num_batched_tokens")


def diagnose(run: RunData | str | PathLike[str], ceilings: Ceilings | None = None,
             roofline: str | None = None) -> Diagnosis:
    """Diagnose a run directory (path) or an already read RunData."""
    path = None
    if not isinstance(run, RunData):
        path = str(run)
        run = read_run_dir(run)
    if run.config.get("source") == "client":
        from phaselab.analysis.external import diagnose_client_run

        return diagnose_client_run(run, path, ceilings or load_ceilings(roofline))
    ceilings = ceilings or simulated_ceilings(run.config) or load_ceilings(roofline, str(run.config.get("dtype")
                                                                                          or "bfloat16"))
    account = account_run(run.requests, run.iterations)
    ttft = ttft_breakdown(run.requests)
    queue = queue_analysis(run, ttft)
    prefill = prefill_analysis(run, ttft)
    decode = decode_analysis(run)
    stalls = stall_analysis(account, run.iterations)
    disagg = disagg_analysis(run, account, ttft)
    summary = summarize(run, account, ttft, stalls, disagg)
    source = "disagg" if (run.config.get("mode") == "disagg" or disagg) else "engine"
    if run.config.get("simulated"):
        source = "simulated " + source
    diag = Diagnosis(path, source, run.config, summary, account, [], ttft, queue, prefill, decode, stalls, disagg,
                     ceilings)
    if not run.iterations:
        diag.notes.append("no iteration records: decode time is not split, stalls are not aligned with iterations")
    diag.notes.append(f"machine ceilings: {ceilings.label()}")
    if roofline and ceilings.kind == "simulated":
        diag.notes.append(f"--roofline {roofline} not used: a simulated run is judged against the hardware it "
                          "simulated (config.json)")
    diag.notes.append("figures labelled MODELED come from the model config and the plans (docs/metrics.md), "
                      "not from a measurement")
    diag.findings = rank_findings(diag)
    return diag


def rank_findings(d: Diagnosis) -> list[Finding]:
    builders = {"queue": _queue_finding, "prefill": _prefill_finding, "transfer": _transfer_finding,
                "stall": _stall_finding, "preemption": _preemption_finding, "decode-kv": _decode_kv_finding,
                "decode-step": _decode_step_finding, "decode": _decode_finding, "overhead": _overhead_finding}
    out = []
    shares = d.account.shares
    for cause in CAUSES:
        if d.account.totals[cause] <= 0:
            continue
        f = builders[cause](d)
        f.share, f.seconds = shares[cause], d.account.totals[cause]
        out.append(f)
    out.sort(key=lambda f: f.share, reverse=True)
    return out


def _f(cause: str, key: KeyFigure, verdict: str, evidence: list[str], change: str, check: str) -> Finding:
    return Finding(cause, TITLES[cause], 0.0, 0.0, key, verdict, evidence, change, check)


# -- one finding per cause -------------------------------------------------------------------------------------------
def _queue_finding(d: Diagnosis) -> Finding:
    q = d.queue
    assert q is not None
    ev = [f"queue p50 {fmt.s(q.queue_p50_s)}, p99 {fmt.s(q.queue_p99_s)}; share of TTFT {fmt.pct(q.share_of_ttft)}"]
    server_queue = ((d.external or {}).get("metrics") or {}).get("queue")
    if q.queue_p50_s is None and server_queue:
        ev = [f"server mean queue time {fmt.s(server_queue['mean_s'])} over {server_queue['count']} requests "
              f"(`{server_queue['metric']}`); share of the client's TTFT {fmt.pct(q.share_of_ttft)}"]
    if q.arrival_rate is not None and q.service_rate is not None:
        ev.append(f"arrivals {q.arrival_rate:.2f} req/s vs completions {q.service_rate:.2f} req/s while busy "
                  f"(load {q.arrival_rate / q.service_rate:.2f}x capacity)")
    elif q.service_rate is not None:
        ev.append(f"all requests arrived together; completions {q.service_rate:.2f} req/s while busy")
    if q.growth is not None:
        ev.append(f"queue time against arrival time: {q.growth.slope:+.2f} s per s of run (R^2 {q.growth.r2:.2f}); "
                  f"first third mean {fmt.s(q.first_third_s)}, last third {fmt.s(q.last_third_s)}"
                  + (" — growing: arrivals above capacity" if q.growing else ""))
    if q.max_waiting is not None:
        ev.append(f"most requests waiting at once: {q.max_waiting}")
    sched = d.config.get("scheduler") or {}
    if q.frac_at_max_seqs is not None:
        ev.append(f"iterations at max_num_seqs={sched.get('max_num_seqs')}: {fmt.pct(q.frac_at_max_seqs)}; "
                  f"peak KV usage {fmt.pct(q.max_kv_usage)}")
    if q.max_kv_usage is not None and q.max_kv_usage > 0.9:
        change = ("admission waits for free KV blocks (peak usage " + fmt.pct(q.max_kv_usage)
                  + "): raise --kv-cache-memory, or shorten max_model_len / outputs")
    elif q.frac_at_max_seqs is not None and q.frac_at_max_seqs > 0.5 and (q.max_kv_usage or 0) < 0.7:
        change = (f"the running set is capped by max_num_seqs={sched.get('max_num_seqs')} while KV has room: "
                  "raise --max-num-seqs (batches grow, each step slows a little, the queue drains)")
    else:
        cap = f"{q.service_rate:.2f} req/s" if q.service_rate else "the measured capacity"
        change = (f"offered load exceeds capacity: keep arrivals below {cap} (client --max-concurrency or "
                  "admission control), or add capacity (another replica; in a disaggregated deployment a worker "
                  "for the busier pool)")
    target = max(0.1, (q.share_of_ttft or 0) / 4)
    check = (f"queue share of TTFT below {fmt.pct(target, 0)} (now {fmt.pct(q.share_of_ttft)}) and queue p99 "
             f"no longer growing over the run (now {fmt.s(q.queue_p99_s)})")
    verdict = (f"requests spend {fmt.pct(q.share_of_ttft)} of their TTFT waiting in the queue"
               + (", and the wait grows over the run" if q.growing else ""))
    return _f("queue", KeyFigure("queue share of TTFT", q.share_of_ttft or 0.0, "share"), verdict, ev, change, check)


def _prefill_finding(d: Diagnosis) -> Finding:
    p = d.prefill
    assert p is not None
    ev = [f"prefill (compute + waits between chunks) is {fmt.pct(p.share_of_ttft)} of TTFT"]
    if p.fit is not None:
        what = "client TTFT against input length" if d.source == "client" else \
            "prefill time against uncached input length"
        ev.append(f"{what}: {p.fit.slope * 1e3:.3f} ms/token, intercept "
                  f"{p.fit.intercept * 1e3:.1f} ms, R^2 {p.fit.r2:.2f} over {p.fit.n} requests")
    if p.bend_ratio is not None:
        ev.append(f"at the longest inputs prefill takes {p.bend_ratio:.2f}x the line through the shorter half"
                  + (" — it bends upward (attention grows with the square of the length)" if p.bends_upward
                     else " — no upward bend"))
    if p.tokens_per_s:
        gemm = d.ceilings.gemm_flops_per_s
        ev.append(f"prefill-only iterations: {p.tokens_per_s:.0f} tokens/s; MODELED "
                  f"{fmt.rate(p.achieved_flops, 'FLOP/s')}"
                  f" = {fmt.pct((p.achieved_flops or 0) / gemm)} of {_ceiling_owner(d)} GEMM rate "
                  f"({d.ceilings.kind} {fmt.rate(gemm, 'FLOP/s')})")
    if p.mean_chunks:
        ev.append(f"chunks per prompt: {p.mean_chunks:.1f}; waits between chunks {fmt.pct(p.wait_share_of_ttft)} "
                  "of TTFT")
    if p.prefix_hit_rate:
        ev.append(f"prefix cache served {fmt.pct(p.prefix_hit_rate)} of prompt tokens")
    policy, budget = _policy(d.config)
    if p.wait_share_of_ttft and p.wait_share_of_ttft > 0.2 and policy == "chunked":
        change = (f"chunks wait between iterations ({fmt.pct(p.wait_share_of_ttft)} of TTFT): raise "
                  f"--max-num-batched-tokens (now {budget}) or --max-num-partial-prefills")
    else:
        change = (f"prefill compute is the TTFT on {d.ceilings.where}: send fewer uncached prompt tokens "
                  "(shared prefixes "
                  "hit the prefix cache), give prefill its own capacity (disaggregated prefill workers, a faster "
                  "device); chunking does not shorten it")
        if p.bends_upward:
            change += "; long inputs cost more than linearly: cap or split the longest prompts"
    slope = p.fit.slope * 1e3 if p.fit else None
    check = (f"TTFT p50 below {fmt.s((d.summary.ttft_p50_s or 0) * 0.7)} (now {fmt.s(d.summary.ttft_p50_s)})"
             + (f" or the prefill slope below {slope * 0.7:.3f} ms/token (now {slope:.3f})" if slope else ""))
    verdict = f"prefill compute is {fmt.pct(p.share_of_ttft)} of TTFT" + (
        f", {slope:.3f} ms per input token" if slope else "")
    key = KeyFigure("prefill share of TTFT", p.share_of_ttft or 0.0, "share")
    return _f("prefill", key, verdict, ev, change, check)


def _ceiling_owner(d: Diagnosis) -> str:
    """ "the machine's" or "the simulated h100 x TP4's": whose roofline a figure is compared with."""
    return f"{d.ceilings.where}'s" if d.ceilings.kind == "simulated" else "the machine's"


def _transfer_finding(d: Diagnosis) -> Finding:
    x = d.disagg
    if x is None:
        return _f("transfer", KeyFigure("KV bandwidth", 0.0, "B/s"), "transfer time without transfer records", [],
                  "—", "—")
    ev = [f"{x.num_transfers} KV transfers, {fmt.nbytes(x.bytes_total)} in all ({fmt.nbytes(x.bytes_mean)} per "
          f"request); transfer p50 {fmt.s(x.transfer_p50_s)}, p99 {fmt.s(x.transfer_p99_s)}",
          f"achieved bandwidth {fmt.rate(x.bandwidth)} (bytes / transfer time); "
          + (f"link {d.ceilings.link_name}: {fmt.rate(d.ceilings.link_bandwidth_bytes_per_s)} per direction between "
             f"a prefill and a decode engine (simulated)" if d.ceilings.link_bandwidth_bytes_per_s else
             f"machine memory bandwidth {fmt.rate(d.ceilings.bandwidth_bytes_per_s)} ({d.ceilings.kind})"),
          f"waiting for the transport: p50 {fmt.s(x.transfer_queue_p50_s)}; decode admission wait p50 "
          f"{fmt.s(x.admission_wait_p50_s)}, p99 {fmt.s(x.admission_wait_p99_s)}",
          f"transfer share of TTFT {fmt.pct(x.share_of_ttft)}; of the gap after the first token "
          f"{fmt.pct(x.share_of_first_gap)} (the prefill worker streams the first token itself)"]
    for pool in x.pools:
        ev.append(f"{pool.role} pool busy {fmt.pct(pool.mean)} (" + ", ".join(
            f"{w} {fmt.pct(v)}" for w, v in pool.workers.items()) + ")")
    if x.imbalance:
        ev.append(f"pool imbalance: busiest / least busy = {x.imbalance:.2f}x")
    waits = (x.admission_wait_p50_s or 0) + (x.transfer_queue_p50_s or 0)
    if waits > (x.transfer_p50_s or 0):
        busy = max(x.pools, key=lambda p: p.mean) if x.pools else None
        change = ("transfers wait more than they move (queue for the transport and decode admission): "
                  + (f"add a {busy.role} worker (its pool is busy {fmt.pct(busy.mean)})" if busy
                     else "add decode capacity") + ", or raise the decode workers' KV memory")
        check = f"transfer queue + admission wait p50 below {fmt.s(waits / 3)} (now {fmt.s(waits)})"
    else:
        change = ("the KV transfer itself is slow: use a faster transport (--kv-transport; shared memory or "
                  "RDMA/NCCL between hosts), overlap it with prefill layer by layer, or keep short prompts colocated "
                  "where the transfer costs more than the interference it removes")
        target = (x.bandwidth or 0) * 4
        check = (f"achieved KV bandwidth above {fmt.rate(target)} (now {fmt.rate(x.bandwidth)}) and transfer p50 "
                 f"below {fmt.s((x.transfer_p50_s or 0) / 4)}")
    verdict = (f"moving KV costs {fmt.s(x.transfer_p50_s)} per request at {fmt.rate(x.bandwidth)}"
               f" ({fmt.nbytes(x.bytes_mean)} each)")
    return _f("transfer", KeyFigure("achieved KV bandwidth", x.bandwidth or 0.0, "B/s"), verdict, ev, change, check)


def _stall_finding(d: Diagnosis) -> Finding:
    st = d.stalls
    assert st is not None
    policy, budget = _policy(d.config)
    ev = [f"{len(st.gaps)} gaps of running streams overlapped other requests' prefill; {len(st.stalls)} of them are "
          f"stalls (over {STALL_FACTOR:g}x the stream's own pace); excess time {fmt.s(st.total_excess_s)}",
          f"longest: {fmt.s(st.max_stall_s)}"]
    for c in st.culprits[:5]:
        reqs = ", ".join(f"{rid} ({n} tokens)" for rid, n in sorted(c.requests.items(), key=lambda kv: -kv[1])[:4])
        ev.append(f"iteration {c.iteration_id} on {c.worker}: {c.prefill_tokens} prefill tokens of {reqs}, "
                  f"{fmt.s(c.duration_s)}; {len(c.streams)} streams waited (longest gap {fmt.s(c.max_gap_s)})")
    if not st.culprits and st.gaps:  # a client's view: the requests waiting for their first token meanwhile
        blamed: dict[str, int] = {}
        for g in st.gaps:
            for rid in g.culprits:
                blamed[rid] = blamed.get(rid, 0) + 1
        ev.append("requests waiting for their first token during the stalls (their prefill, most likely): " + ", ".join(
            f"{rid} ({n} stalls)" for rid, n in sorted(blamed.items(), key=lambda kv: -kv[1])[:6]))
    pf = d.prefill
    slope = pf.fit.slope if pf and pf.fit and pf.fit.slope > 0 else None
    biggest = max((c.prefill_tokens for c in st.culprits), default=0)
    if policy == "prefill-first":
        chunk = max(64, min(512, biggest // 4 or 256))
        change = (f"switch to --policy chunked with --max-num-batched-tokens {chunk}: a stall shrinks to one chunk"
                  + (f" (about {fmt.s(slope * chunk)} at the measured {slope * 1e3:.3f} ms/token)" if slope else "")
                  + "; the long prompt's own TTFT grows a little; or disaggregate prefill from decode")
    elif policy == "chunked" and budget is not None and budget <= 128:
        per_chunk = max((c.duration_s for c in st.culprits), default=0.0)
        change = (f"chunks are already small (budget {budget}) and each still pauses the streams (up to "
                  f"{fmt.s(per_chunk)}: per-iteration overhead and re-reading the prompt's prefix); a smaller budget "
                  "adds more iterations: move prefill to its own worker pool (disaggregated) so decode iterations "
                  "carry no prefill, or raise the budget if the long prompts' TTFT matters more")
    elif policy == "chunked":
        new = max(64, (budget or 512) // 2)
        change = (f"lower --max-num-batched-tokens from {budget} to {new} (or set --long-prefill-token-threshold): "
                  "each chunk pauses the streams for less time; or move prefill to its own pool (disaggregated)")
    else:
        change = ("long prompts pause the other streams on the server: schedule prefill in chunks (vLLM: "
                  "--enable-chunked-prefill with a smaller --max-num-batched-tokens), or disaggregate prefill")
    base = sorted(g.baseline_s for g in st.gaps)[len(st.gaps) // 2] if st.gaps else 0.0
    check = (f"longest gap of a running stream below {fmt.s(STALL_FACTOR * base)} ({STALL_FACTOR:g}x its pace; "
             f"now {fmt.s(st.max_stall_s)}) and ITL p99 below {fmt.s((d.summary.itl_p99_s or 0) / 2)} "
             f"(now {fmt.s(d.summary.itl_p99_s)})")
    verdict = (f"other requests' prefill paused running streams for {fmt.s(st.total_excess_s)} in all; the longest "
               f"gap was {fmt.s(st.max_stall_s)}")
    return _f("stall", KeyFigure("longest stall", st.max_stall_s, "s"), verdict, ev, change, check)


def _preemption_finding(d: Diagnosis) -> Finding:
    gaps = [g for g in d.account.gaps if g.cause == "preemption"]
    ev = [f"{len(gaps)} gaps include the request's own recomputation after a preemption; "
          f"{fmt.s(sum(g.excess_s for g in gaps))} in all"]
    if d.queue and d.queue.max_kv_usage is not None:
        ev.append(f"peak KV usage {fmt.pct(d.queue.max_kv_usage)}")
    change = "KV capacity runs out mid-decode: raise --kv-cache-memory, or lower --max-num-seqs / max_model_len"
    check = "no preemptions (phaselab_num_preemptions_total stays 0)"
    return _f("preemption", KeyFigure("recompute time", sum(g.excess_s for g in gaps), "s"),
              "preempted requests lose time recomputing their KV", ev, change, check)


def _decode_evidence(d: Diagnosis) -> list[str]:
    x = d.decode
    ev: list[str] = []
    if x is None or not x.num_steps:
        return ev
    ev.append(f"{x.num_steps} decode-only steps: p50 {fmt.s(x.step_p50_s)}, p99 {fmt.s(x.step_p99_s)}; ITL p50 "
              f"{fmt.s(x.itl_p50_s)}, p99 {fmt.s(x.itl_p99_s)}; TPOT p50 {fmt.s(x.tpot_p50_s)}")
    ev.append(f"MODELED bytes per step: weights {fmt.nbytes(x.weight_per_step)}, KV read "
              f"{fmt.nbytes(x.kv_read_per_step)}"
              f" (KV {fmt.pct(x.kv_share)} of the bytes, time-weighted)")
    bw = d.ceilings.bandwidth_bytes_per_s
    if x.bandwidth_p50:
        frac = x.bandwidth_p50 / bw
        ev.append(f"achieved bandwidth p50 {fmt.rate(x.bandwidth_p50)} = {fmt.pct(frac)} of {_ceiling_owner(d)} "
                  f"{fmt.rate(bw)} ({d.ceilings.kind})"
                  + (" — a memory-bound signature" if frac > 0.5 else
                     " — well below the memory roof: per-step overheads and compute dominate"))
    if x.fit is not None and x.fit.r2 >= FIT_R2:
        ev.append(f"step time = {x.fit.intercept * 1e3:.1f} ms + {x.fit.coefs[0] * 1e3:.2f} ms x batch + "
                  f"{x.fit.coefs[1] * 1e6:.2f} ms x (context / 1000 tokens) (R^2 {x.fit.r2:.2f})")
    elif x.context_fit is not None and x.context_fit.r2 >= FIT_R2:
        ev.append(f"step time against total context: {x.context_fit.slope * 1e6:.2f} ms per 1000 tokens "
                  f"(R^2 {x.context_fit.r2:.2f})")
    elif x.fit is not None or x.context_fit is not None:
        r2 = (x.fit or x.context_fit).r2  # type: ignore[union-attr]
        ev.append(f"step time shows no clear dependence on batch or context in this run (best fit R^2 {r2:.2f}: "
                  "too little spread, or noise)")
    if x.buckets:
        ev.append("by batch: " + "; ".join(
            f"{b.batch_lo}-{b.batch_hi}: {b.steps} steps, {fmt.s(b.step_s)}, context {b.context:.0f}, "
            f"KV {fmt.nbytes(b.kv_read_bytes)}" for b in x.buckets))
    return ev


def _decode_kv_finding(d: Diagnosis) -> Finding:
    x = d.decode
    kv = x.kv_share if x else None
    max_seqs = (d.config.get("scheduler") or {}).get("max_num_seqs")
    change = (f"the history is what later tokens pay for: lower --max-num-seqs (now {max_seqs}) so each step reads "
              "less KV (fewer tokens per second in total), cap output lengths / max_model_len, or add decode capacity "
              "(another replica, or more decode workers in a disaggregated deployment)")
    step = x.step_p50_s if x else None
    check = (f"decode step p50 below {fmt.s((step or 0) * 0.7)} (now {fmt.s(step)}) with the MODELED KV share of "
             f"step bytes below {fmt.pct((kv or 0) * 0.6)} (now {fmt.pct(kv)})")
    verdict = f"KV-cache reads are {fmt.pct(kv)} of the bytes a decode step moves (MODELED)" + (
        ": the history slows the tokens" if (kv or 0) >= 0.3 else "; the history costs little per step here")
    return _f("decode-kv", KeyFigure("KV share of decode-step bytes (MODELED)", kv or 0.0, "share"), verdict,
              _decode_evidence(d), change, check)


def _threads(config: dict[str, Any]) -> list[int]:
    """torch threads of each engine of the run (disaggregated: each worker's)."""
    engines = [config] + [(w.get("engine") or {}) for w in (config.get("workers") or {}).values()]
    return [int(e["machine"]["torch_num_threads"]) for e in engines
            if isinstance(e.get("machine"), dict) and e["machine"].get("torch_num_threads")]


def _decode_step_finding(d: Diagnosis) -> Finding:
    x = d.decode
    weights = x.weight_per_step if x else None
    floor = (weights or 0) / d.ceilings.bandwidth_bytes_per_s
    step = x.step_p50_s if x else None
    tput = d.summary.output_throughput
    ratio = (step or 0) / floor if floor > 0 else None
    threads = _threads(d.config)
    if ratio is not None and ratio <= 2:
        change = ("each step reads all weights and is near its bandwidth floor: for more tokens per second batch "
                  "more streams per step (raise --max-num-seqs / client concurrency); for faster tokens a smaller "
                  "dtype or quantized weights")
    else:
        head = f"a decode step takes {ratio:.1f}x its weight-read floor ({fmt.s(floor)}" if ratio else \
            "decode steps take long ("
        change = head + ("): per-step overhead and compute, not bandwidth, set the pace"
                  + (f" (torch threads per engine: {', '.join(map(str, threads))}; a disaggregated deployment on few "
                     "cores splits them between the pools)" if threads else "")
                  + "; batch more streams per step (raise --max-num-seqs / client concurrency) to amortize it, "
                  + ("spread each engine over more GPUs (tensor parallelism), or a faster device (the simulated "
                     "per-iteration overheads are in config.json's cost_model)" if d.ceilings.kind == "simulated" else
                     "give the decode engine more cores, or use a faster kernel path (bf16 GEMM, a GPU)"))
    check = (f"output throughput above {fmt.num((tput or 0) * 1.5, 1)} tokens/s (now {fmt.num(tput, 1)}) with ITL p50 "
             f"within +20% (now {fmt.s(d.summary.itl_p50_s)})")
    verdict = (f"decode steps at their per-step cost: p50 {fmt.s(x.step_p50_s if x else None)}, weights "
               f"{fmt.nbytes(weights)} per step (floor at {_ceiling_owner(d)}"
               f"{'' if d.ceilings.kind == 'simulated' else ' ' + d.ceilings.kind} bandwidth {fmt.s(floor)})")
    return _f("decode-step", KeyFigure("decode step p50", (x.step_p50_s or 0.0) if x else 0.0, "s"), verdict,
              _decode_evidence(d), change, check)


def _decode_finding(d: Diagnosis) -> Finding:
    s = d.summary
    verdict = f"time after the first token: ITL p50 {fmt.s(s.itl_p50_s)}, p99 {fmt.s(s.itl_p99_s)}"
    change = ("record the server's iterations (phaselab serve --record) to split decode time into KV reads and the "
              "per-step cost; meanwhile: fewer concurrent streams shorten each step")
    check = f"ITL p50 below {fmt.s((s.itl_p50_s or 0) * 0.7)} (now {fmt.s(s.itl_p50_s)})"
    return _f("decode", KeyFigure("ITL p50", s.itl_p50_s or 0.0, "s"), verdict, _decode_evidence(d), change, check)


def _overhead_finding(d: Diagnosis) -> Finding:
    t = d.ttft
    parts = {k: (t.share(k) if t else 0.0) for k in ("tokenize", "admission", "delivery")}
    share = sum(parts.values())
    ev = [f"of TTFT: tokenize {fmt.pct(parts['tokenize'])}, admission {fmt.pct(parts['admission'])}, delivery "
          f"{fmt.pct(parts['delivery'])}"]
    if d.source == "client":
        share = d.summary.ttft_shares.get("overhead", 0.0)
        ev = [f"client TTFT not explained by the server's queue and prefill means: {fmt.pct(share)} (network, HTTP, "
              "tokenization, detokenization, streaming)"]
    change = ("time outside the model: tokenization, admission and output delivery (a server's event loop and "
              "socket writes; offline, the caller's loop); profile the front end or detokenize off the loop")
    check = f"overhead share of TTFT below {fmt.pct(max(0.02, share / 3))} (now {fmt.pct(share)})"
    return _f("overhead", KeyFigure("overhead share of TTFT", share, "share"),
              f"tokenization, admission and delivery are {fmt.pct(share)} of TTFT", ev, change, check)


# -- writing -----------------------------------------------------------------------------------------------------------
def write_diagnosis(diag: Diagnosis, out_dir: str | PathLike[str]) -> dict[str, Path]:
    """diagnosis.md, diagnosis.html and diagnosis.json in `out_dir` (the run directory)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    doc = diag.to_doc()
    files = {"md": root / "diagnosis.md", "html": root / "diagnosis.html", "json": root / "diagnosis.json"}
    files["md"].write_text(render_markdown(doc), encoding="utf-8")
    files["html"].write_text(render_html(doc), encoding="utf-8")
    files["json"].write_text(json.dumps(diag.to_json(), indent=2, default=str) + "\n", encoding="utf-8")
    return files


def diagnosis_text(diag: Diagnosis) -> str:
    return render_text(diag.to_doc())


__all__ = ["Diagnosis", "Finding", "KeyFigure", "diagnose", "diagnosis_text", "write_diagnosis"]
