"""Where the users' time went: every request's end-to-end time cut into causes that sum to it.

    arrived ─ tokenize/admission ─ queue ─ prefill (chunks + waits) ─ [transfer] ─ first token sent
      ─ gap 1 ─ gap 2 ─ ... ─ gap n-1 ─ finished          (gaps: between consecutive sent tokens)

TTFT is tiled by `RequestMetrics.ttft_components_ns()` (docs/metrics.md); each phase maps to one
cause. Each later gap is cut in this order:

1. **transfer**: the part of the gap inside the request's KV transfer window (transfer queued ->
   decode admitted). Disaggregated serving streams the first token from the prefill worker, so the
   transfer usually sits in gap 1, not in TTFT.
2. **kv-capacity**: the part of the gap covered by the request's own KV-capacity spans
   (analysis/kvcapacity.py: readmission wait after a preemption, the recompute chunks). The same
   spans are taken out of TTFT's queue (waiting for blocks) and prefill (readmission between
   chunks, recompute): one cause for the whole mechanism, counted from the record's own
   preemption events.
3. **stall**: the excess of the rest over the request's own baseline pace (the median of its
   *clean* gaps: gaps whose iterations carried no other request's prefill and none of its own
   recomputation), when the gap's iterations carried another request's prefill tokens. The stall
   excess is capped by the durations of those prefill-carrying iterations.
4. **decode-kv / decode-step**: the rest, split by the MEASURED attribution of the sampling
   iteration (analysis/attribution.py: the worker's decode steps fitted against batch and history):
   the K/V reads' share to decode-kv, the weights and per-step overhead to decode-step. Where the
   run lacks the spread to separate them, or without iteration records (a client's run), the rest
   stays unsplit in `decode`.

The iterations "in a gap" are those of the worker that sampled the token with ids in
(iteration of the previous token, iteration of this token]: exact, because a worker's iteration
ids are one counter. After the last token, the tail up to `finished` is overhead.

**Avoidable time** (what the ranking scores): of each cause's seconds, the part over what the same
work costs without the cause, measured from a stated baseline (BASELINES): the queue's wait, a
stall's excess over the stream's own pace, the KV-capacity spans, a transfer, the overhead are
avoidable whole; of prefill, the waits between chunks and the compute of prompt tokens that repeat
an earlier request's beginning (a prefix cache skips them); of decode-kv, the K/V reads (the same
steps with no history would not make them); of the per-step decode cost (decode-step, or decode
where unsplit), each gap's time over the run's normal pace for a step of that batch (the median
step at that batch size, its K/V part aside). Time spent decoding at the engine's normal pace is not
a cause: a machine that runs every step slower (a busy neighbour) slows the pace, not the ranking.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from phaselab.analysis.attribution import DecodeAttribution, attribute_workers
from phaselab.analysis.kvcapacity import KVLoss, Limits, overlap_ns, request_loss
from phaselab.analysis.stats import median
from phaselab.core.timing import IterationRecord, RequestMetrics

# Causes in the order they are presented; their seconds sum to a request's E2E.
CAUSES = ("queue", "prefill", "transfer", "stall", "kv-capacity", "decode-kv", "decode-step", "decode", "overhead")

# TTFT phase (core.timing.TTFT_COMPONENTS) -> cause
TTFT_CAUSE = {
    "tokenize": "overhead", "admission": "overhead", "queue": "queue",
    "schedule_to_prefill": "prefill", "prefill_compute": "prefill", "prefill_wait": "prefill",
    "post_prefill": "prefill", "transfer_queue": "transfer", "transfer": "transfer",
    "decode_admission": "transfer", "delivery": "overhead",
}

STALL_FACTOR = 3.0  # a gap longer than 3 x the stream's baseline is a stall (as `phaselab bench`)

# what each cause's avoidable time is measured from (docs/analysis.md, "Avoidable time")
BASELINES = {
    "queue": "admitted on arrival (no wait)",
    "prefill": "the uncached, unrepeated prompt tokens computed back to back (no waits between chunks, "
               "repeated prefixes served by a prefix cache)",
    "transfer": "colocated serving (no KV moved)",
    "stall": "each stream's own pace (the median gap of its steps that carried no other request's prefill)",
    "kv-capacity": "a cache large enough for the load (no preemption, no wait for blocks)",
    "decode-kv": "the same steps with no history to read (their K/V-read part, measured)",
    "decode-step": "the run's normal pace at each batch size (the median step at that batch, K/V part aside)",
    "decode": "the run's normal pace at each batch size (the median step at that batch)",
    "overhead": "none (tokenization, admission and delivery add nothing to the model's work)",
}


@dataclass
class Gap:
    """One gap between consecutive sent tokens of a request that the accounting looked into."""

    request_id: str
    worker: str
    token_index: int  # the gap ends when this token was sent (1 = the gap after the first token)
    start_ns: int
    end_ns: int
    baseline_s: float
    excess_s: float  # attributed to stall
    cause: str  # "stall"
    iteration_ids: list[int] = field(default_factory=list)  # iterations in the gap that caused it
    culprits: dict[str, int] = field(default_factory=dict)  # request -> prefill tokens in them

    @property
    def gap_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def is_stall(self, factor: float = STALL_FACTOR) -> bool:
        return self.cause == "stall" and self.gap_s > factor * self.baseline_s


@dataclass
class RequestAccount:
    request_id: str
    e2e_s: float
    ttft_s: float | None
    parts: dict[str, float]  # cause -> seconds; sums to e2e_s
    gaps: list[Gap] = field(default_factory=list)  # gaps with a stall excess
    kv: KVLoss = field(default_factory=KVLoss)
    avoidable: dict[str, float] = field(default_factory=dict)  # cause -> seconds over its baseline (<= parts)


@dataclass
class RunAccount:
    requests: list[RequestAccount]
    totals: dict[str, float]  # cause -> seconds summed over requests
    total_s: float  # sum of E2E
    decode_split: bool  # decode time split into decode-kv / decode-step (a separable attribution)
    attribution: dict[str, DecodeAttribution] = field(default_factory=dict)  # per worker
    avoidable: dict[str, float] = field(default_factory=dict)  # cause -> avoidable seconds over requests

    def avoidable_share(self, cause: str) -> float:
        """A cause's avoidable time as a share of the run's summed E2E."""
        return self.avoidable.get(cause, 0.0) / self.total_s if self.total_s > 0 else 0.0

    @property
    def num_preemptions(self) -> int:
        return sum(r.kv.num_preemptions for r in self.requests)

    def kv_seconds(self) -> dict[str, float]:
        """KV-capacity time by kind, summed over requests (the spans, before the tiling clips them)."""
        return {"recompute": sum(r.kv.recompute_s for r in self.requests),
                "readmission": sum(r.kv.readmission_s for r in self.requests),
                "block_wait": sum(r.kv.block_wait_s for r in self.requests)}

    @property
    def shares(self) -> dict[str, float]:
        return {c: (v / self.total_s if self.total_s > 0 else 0.0) for c, v in self.totals.items()}

    @property
    def gaps(self) -> list[Gap]:
        return [g for r in self.requests for g in r.gaps]


class IterationIndex:
    """Iterations by (worker, id), plus what each carried."""

    def __init__(self, iterations: Iterable[IterationRecord]) -> None:
        self.by_key: dict[tuple[str, int], IterationRecord] = {(r.worker, r.iteration_id): r for r in iterations}
        self.ids: dict[str, list[int]] = {}
        for worker, iid in sorted(self.by_key):
            self.ids.setdefault(worker, []).append(iid)
        # the requests each iteration prefilled (computed once: a batch can hold hundreds of chunks)
        self.prefilled: dict[int, frozenset[str]] = {
            id(r): frozenset(c.request_id for c in r.chunks if c.is_prefill) for r in self.by_key.values()}

    def get(self, worker: str, iteration_id: int) -> IterationRecord | None:
        return self.by_key.get((worker, iteration_id))

    def between(self, worker: str, after_id: int, upto_id: int) -> list[IterationRecord]:
        """Recorded iterations of `worker` with after_id < id <= upto_id."""
        import bisect

        ids = self.ids.get(worker, [])
        lo = bisect.bisect_right(ids, after_id)
        hi = bisect.bisect_right(ids, upto_id)
        return [self.by_key[(worker, i)] for i in ids[lo:hi]]

    def __bool__(self) -> bool:
        return bool(self.by_key)


def _sent(m: RequestMetrics) -> list[int]:
    return m.token_sent_ns or m.token_sampled_ns


def _token_worker(m: RequestMetrics, k: int) -> str:
    return m.decode_worker if (m.decode_worker and k >= 1) else m.worker


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def _transfer_window(m: RequestMetrics) -> tuple[int, int] | None:
    start = m.kv_transfer_queued_ns or m.kv_transfer_start_ns
    end = m.decode_admitted_ns or m.kv_transfer_end_ns
    if start is None or end is None or end <= start:
        return None
    return start, end


@dataclass
class _GapView:
    k: int
    start_ns: int
    end_ns: int
    worker: str
    transfer_ns: int
    iters: list[IterationRecord]  # iterations in the gap (same worker for both tokens), else []
    other_prefill: list[IterationRecord]
    own_recompute: bool
    sampler: IterationRecord | None  # the iteration that sampled token k

    @property
    def clean(self) -> bool:
        return bool(self.iters) and not self.other_prefill and not self.own_recompute and self.transfer_ns == 0


def _gap_views(m: RequestMetrics, index: IterationIndex) -> list[_GapView]:
    ts = _sent(m)
    its = m.token_iteration_ids
    window = _transfer_window(m)
    views = []
    for k in range(1, len(ts)):
        a, b = ts[k - 1], ts[k]
        transfer_ns = _overlap(a, b, *window) if window else 0
        worker = _token_worker(m, k)
        iters: list[IterationRecord] = []
        sampler = None
        if index and k < len(its) and _token_worker(m, k - 1) == worker:
            iters = index.between(worker, its[k - 1], its[k])
        if index and k < len(its):
            sampler = index.get(worker, its[k])
        rid = m.request_id
        other = [r for r in iters if index.prefilled[id(r)] - {rid}]
        own = any(rid in index.prefilled[id(r)] for r in iters)
        own = own or any(a < t <= b for t in m.preempted_ns)
        views.append(_GapView(k, a, b, worker, transfer_ns, iters, other, own, sampler))
    return views


class Pace:
    """Each worker's normal pace per batch size: the median decode-only step at that batch, its
    measured K/V part aside where the decode is split (the avoidable per-step time's baseline)."""

    MIN_STEPS = 3

    def __init__(self, index: IterationIndex, attribution: dict[str, DecodeAttribution]) -> None:
        per: dict[str, dict[int, list[float]]] = {}
        for (worker, _), r in index.by_key.items():
            if r.num_prefill_tokens or not r.num_decode_tokens:
                continue
            att = attribution.get(worker)
            f = att.kv_fraction(r) if att is not None and att.separable else 0.0
            per.setdefault(worker, {}).setdefault(r.num_decode_tokens, []).append(r.duration_s * (1 - f))
        self.by_batch = {w: {b: float(median(v) or 0.0) for b, v in bs.items() if len(v) >= self.MIN_STEPS}
                         for w, bs in per.items()}
        self.overall = {w: float(median([x for v in bs.values() for x in v]) or 0.0) for w, bs in per.items()}

    def at(self, worker: str, batch: int) -> float | None:
        """The pace at `batch`, else at the nearest batch measured often enough, else the worker's median step."""
        paces = self.by_batch.get(worker) or {}
        if batch in paces:
            return paces[batch]
        if paces:
            return paces[min(paces, key=lambda b: (abs(b - batch), b))]
        return self.overall.get(worker)


def _prefill_avoidable(m: RequestMetrics, ttft_parts: dict[str, int], prefill_s: float) -> float:
    """The waits between the request's chunks, and the compute of its prompt tokens that repeated an
    earlier request's beginning without a cache hit (at the request's own cost per computed token)."""
    computed = max(0, m.num_prompt_tokens - m.num_cached_tokens)
    repeated = max(0, m.num_repeat_tokens - m.num_cached_tokens)
    frac = min(1.0, repeated / computed) if computed else 0.0
    return min(prefill_s, ttft_parts.get("prefill_wait", 0) / 1e9 + frac * ttft_parts.get("prefill_compute", 0) / 1e9)


def account_request(m: RequestMetrics, index: IterationIndex, worker_baseline: dict[str, float],
                    views: list[_GapView] | None = None, kv: KVLoss | None = None,
                    attribution: dict[str, DecodeAttribution] | None = None,
                    pace: Pace | None = None) -> RequestAccount:
    parts = dict.fromkeys(CAUSES, 0.0)
    avoid = dict.fromkeys(CAUSES, 0.0)
    whole = ("queue", "transfer", "stall", "kv-capacity", "overhead")  # avoidable entirely (BASELINES)
    kv = kv or KVLoss()
    spans = kv.spans()
    ts = _sent(m)
    end_ns = m.finished_ns if m.finished_ns is not None else (ts[-1] if ts else m.arrived_ns)
    e2e = max(0, end_ns - m.arrived_ns) / 1e9
    ttft = m.ttft_s
    if not ts:  # never produced a token (aborted, failed): its time up to the end
        parts["kv-capacity"] = min(e2e, overlap_ns(m.arrived_ns, end_ns, spans) / 1e9)
        spent = parts["kv-capacity"]
        if m.queue_s is not None:
            parts["queue"] = max(0.0, min(m.queue_s - kv.block_wait_s, e2e - spent))
            spent += parts["queue"]
        if m.prefill_chunks:
            parts["prefill"] = max(0.0, min(m.prefill_compute_s, e2e - spent))
            spent += parts["prefill"]
        parts["overhead"] = max(0.0, e2e - spent)
        avoid.update({c: parts[c] for c in whole})
        return RequestAccount(m.request_id, e2e, ttft, parts, kv=kv, avoidable=avoid)

    ttft_parts = m.ttft_components_ns()
    for phase, ns in ttft_parts.items():
        parts[TTFT_CAUSE[phase]] += ns / 1e9
    if spans and m.first_token_sent_ns is not None:
        # the KV-capacity spans inside TTFT leave the phase they fell in: block waits the queue,
        # readmission waits and recompute the prefill region (first chunk start -> first token)
        moved_q = min(parts["queue"], overlap_ns(m.arrived_ns, m.first_token_sent_ns, kv.block_wait) / 1e9)
        moved_p = min(parts["prefill"], overlap_ns(m.arrived_ns, m.first_token_sent_ns,
                                                   kv.readmission + kv.recompute) / 1e9)
        parts["queue"] -= moved_q
        parts["prefill"] -= moved_p
        parts["kv-capacity"] += moved_q + moved_p
    avoid["prefill"] = _prefill_avoidable(m, ttft_parts, parts["prefill"])
    views = _gap_views(m, index) if views is None else views
    clean = [(v.end_ns - v.start_ns) / 1e9 for v in views if v.clean]
    own_median = median([(v.end_ns - v.start_ns - v.transfer_ns) / 1e9 for v in views if v.iters])
    gaps: list[Gap] = []
    for v in views:
        gap = (v.end_ns - v.start_ns) / 1e9
        transfer = v.transfer_ns / 1e9
        parts["transfer"] += transfer
        rest = gap - transfer
        lost = min(rest, overlap_ns(v.start_ns, v.end_ns, spans) / 1e9) if spans else 0.0
        parts["kv-capacity"] += lost
        rest -= lost
        baseline: float = (median(clean) if clean else worker_baseline.get(v.worker, own_median or rest)) or 0.0
        excess = max(0.0, rest - baseline)
        if excess > 0 and v.other_prefill and not v.own_recompute:
            excess = min(excess, sum(r.duration_s for r in v.other_prefill))
            culprits: dict[str, int] = {}
            for r in v.other_prefill:
                for c in r.chunks:
                    if c.is_prefill and c.request_id != m.request_id:
                        culprits[c.request_id] = culprits.get(c.request_id, 0) + c.num_tokens
            parts["stall"] += excess
            gaps.append(Gap(m.request_id, v.worker, v.k, v.start_ns, v.end_ns, baseline, excess, "stall",
                            [r.iteration_id for r in v.other_prefill], culprits))
            rest -= excess
        att = (attribution or {}).get(v.worker)
        # the gap's normal pace: the worker's median step at the batch that sampled the token; without
        # iterations (a client's run) the request's own baseline
        normal = pace.at(v.worker, v.sampler.num_decode_tokens) if pace and v.sampler is not None else None
        normal = baseline if normal is None else normal
        if att is None or not att.separable:
            parts["decode"] += rest
            avoid["decode"] += max(0.0, rest - normal)
        else:
            f = att.kv_fraction(v.sampler) if v.sampler is not None else 0.0
            parts["decode-kv"] += rest * f
            parts["decode-step"] += rest * (1 - f)
            avoid["decode-kv"] += rest * f
            avoid["decode-step"] += max(0.0, rest * (1 - f) - normal)
    parts["overhead"] += max(0, end_ns - ts[-1]) / 1e9
    avoid.update({c: parts[c] for c in whole})
    return RequestAccount(m.request_id, e2e, ttft, parts, gaps, kv, avoid)


def worker_baselines(views: Iterable[list[_GapView]]) -> dict[str, float]:
    """Per worker, the median clean gap over all its requests (the fallback baseline of a request
    that never had a clean gap of its own)."""
    per: dict[str, list[float]] = {}
    for request_views in views:
        for v in request_views:
            if v.clean:
                per.setdefault(v.worker, []).append((v.end_ns - v.start_ns) / 1e9)
    return {w: float(median(vs) or 0.0) for w, vs in per.items()}


def account_run(requests: list[RequestMetrics], iterations: list[IterationRecord],
                config: dict[str, Any] | None = None, bandwidth: float | None = None) -> RunAccount:
    """`bandwidth`: a measured memory bandwidth bounding the decode attribution from below."""
    index = IterationIndex(iterations)
    views = [_gap_views(m, index) for m in requests]
    baselines = worker_baselines(views)
    limits = Limits.from_config(config or {})
    by_worker = {w: [index.by_key[(w, i)] for i in ids] for w, ids in index.ids.items()}
    losses = [request_loss(m, by_worker.get(m.worker, []), limits) for m in requests]
    attribution = attribute_workers(iterations, bandwidth)
    pace = Pace(index, attribution)
    accounts = [account_request(m, index, baselines, v, kv, attribution, pace)
                for m, v, kv in zip(requests, views, losses)]
    totals = dict.fromkeys(CAUSES, 0.0)
    avoidable = dict.fromkeys(CAUSES, 0.0)
    for a in accounts:
        for c, v in a.parts.items():
            totals[c] += v
        for c, v in a.avoidable.items():
            avoidable[c] += v
    return RunAccount(accounts, totals, sum(a.e2e_s for a in accounts),
                      any(a.separable for a in attribution.values()), attribution, avoidable)
