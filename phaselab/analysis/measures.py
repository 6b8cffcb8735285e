"""The measures of `phaselab diagnose`: one analysis per row of the symptom table, and the run
summary (the compare table's row). Plain numbers from a run directory; the findings that rank and
explain them are findings.py, the Diagnosis that holds both is diagnose.py.

    ttft_breakdown    TTFT tiled into its phases (p50/p90/p99)
    queue_analysis    queue time vs load, admission limits
    prefill_analysis  prefill compute vs input length (slope, R^2, bend)
    decode_analysis   decode step time vs batch and context; MODELED KV bytes read per step
    stall_analysis    gaps of running streams aligned with the iterations that carried other prefill
    disagg_analysis   KV bytes, bandwidth, transfer share, admission waits, busy fraction of each pool
    summarize         RunSummary
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from phaselab.analysis.accounting import Gap, RunAccount
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
from phaselab.obs.rundir import RunData

PERCENTILES = (50, 90, 99)
FIT_R2 = 0.3  # a fit explaining less than this is reported as "no clear dependence"
# arrivals spread over less than this fraction of the run's time per completion (first arrival ->
# last finish, over the requests) came at once: a burst, reported as one, never as a rate
SUSTAINED = 0.5

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
    burst: tuple[int, float] | None = None  # (requests, seconds) when they arrived as one burst

    @property
    def growing(self) -> bool:
        if self.growth is None or self.first_third_s is None or self.last_third_s is None:
            return False
        return self.growth.slope > 0.05 and self.last_third_s > 1.5 * self.first_third_s + 1e-3


def arrival_rate_or_burst(arrivals_ns: list[int], last_end_ns: int | None) -> tuple[float | None, tuple[int, float] | None]:
    """(sustained arrival rate, None), or (None, (requests, window s)) when they came as one burst:
    a rate over a near-zero window (and a slope of queue time over it) says nothing about load."""
    if len(arrivals_ns) < 2:
        return None, None
    arrivals_ns = sorted(arrivals_ns)
    window_s = (arrivals_ns[-1] - arrivals_ns[0]) / 1e9
    run_s = ((last_end_ns if last_end_ns is not None else arrivals_ns[-1]) - arrivals_ns[0]) / 1e9
    # the engine's time per completion over the run: arrivals within half of it came at once
    per_completion_s = run_s / len(arrivals_ns) if run_s > 0 else 0.0
    if window_s <= 0 or window_s < SUSTAINED * per_completion_s:
        return None, (len(arrivals_ns), window_s)
    return (len(arrivals_ns) - 1) / window_s, None


def queue_analysis(run: RunData, ttft: TtftBreakdown | None) -> QueueAnalysis:
    reqs = sorted((m for m in run.requests if m.queue_s is not None), key=lambda m: m.arrived_ns)
    qs: list[float] = [m.queue_s for m in reqs if m.queue_s is not None]
    arrivals = [m.arrived_ns for m in reqs]
    arrival_rate = service_rate = None
    burst = None
    starts = [m.first_scheduled_ns for m in run.requests if m.first_scheduled_ns is not None]
    ends = [m.finished_ns for m in run.requests if m.finished_ns is not None]
    if starts and ends and max(ends) > min(starts):
        service_rate = len(ends) / ((max(ends) - min(starts)) / 1e9)
    growth = None
    arrival_rate, burst = arrival_rate_or_burst(arrivals, max(ends) if ends else None)
    if arrival_rate is not None:
        growth = linear_fit([(a - arrivals[0]) / 1e9 for a in arrivals], qs)
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
        max_kv_usage=max(usage) if usage else None, burst=burst,
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
    # prompt tokens that repeated an earlier request's beginning (counted cache on or off) and were not
    # hits: what prefix caching (on, or with room to keep them) could still skip
    repeat_missed_rate: float | None = None
    prefix_caching: bool | None = None  # the run's engine had it on (None: not recorded)


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
        repeat_missed_rate=sum(max(0, m.num_repeat_tokens - m.num_cached_tokens) for m in run.requests) / prompt
        if prompt else None,
        prefix_caching=_prefix_caching(run.config),
    )


def _prefix_caching(config: dict[str, Any]) -> bool | None:
    from phaselab.obs.rundir import RunDirError, engine_config

    try:
        cache = engine_config(config, "prefill").get("cache") or {}
    except RunDirError:
        return None
    value = cache.get("enable_prefix_caching")
    return None if value is None else bool(value)


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
