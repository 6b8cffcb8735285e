"""Metrics derived after the run from the client's raw timestamps (docs/glossary.md names each one).

Per request (client view; all from `time.monotonic_ns()` stamps):

    TTFT   sent -> first content chunk received
    ITL    every gap between consecutive content chunks (one token per chunk on phaselab and vLLM)
    TPOT   (E2E - TTFT) / (n_out - 1); undefined for n_out < 2 (goodput counts it as 0, as vLLM does)
    E2E    sent -> response complete ([DONE], or the end of the body)
    stalls max gap; gaps longer than stall_factor x the stream's own median gap

n_out is the server's `usage.completion_tokens` when it sent usage, else the number of content
chunks (flagged `output_tokens_source: "chunks"`). Aggregates use successful requests only, as
vLLM's `bench serve` does; failed and incomplete requests are counted, with their errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phaselab.bench.client import STATUS_FAILED, STATUS_INCOMPLETE, STATUS_OK, RequestRecord, classify, parse_stream

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# The distributions reported with mean/median/std/percentiles, under vLLM's key stems.
STAT_METRICS = ("ttft", "tpot", "itl", "e2el", "max_gap", "client_queue_time")


@dataclass
class RequestResult:
    """One request's derived numbers (seconds). None where the event did not happen."""

    request_id: str
    group: str
    warmup: bool
    status: str  # ok | failed | incomplete
    error: str | None
    start_s: float | None  # sent, seconds after the run's start
    client_queue_s: float | None  # scheduled -> sent (waiting for a --max-concurrency slot)
    ttft_s: float | None
    itl_s: list[float]
    tpot_s: float | None
    e2e_s: float | None
    num_prompt_tokens: int | None  # usage.prompt_tokens, else the builder's count
    num_prompt_tokens_requested: int | None
    num_output_tokens: int
    output_tokens_source: str  # "usage" | "chunks"
    num_chunks: int
    finish_reason: str | None
    server_request_id: str | None
    max_gap_s: float | None  # the longest ITL of the stream
    median_gap_s: float | None
    num_stalls: int  # gaps > stall_factor x median gap
    stall_s: float  # time in those gaps beyond the median
    sent_ns: int | None = None  # raw monotonic stamps, for cross-request analysis
    token_ns: list[int] = field(repr=False, default_factory=list)  # content chunk arrivals

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def derive(rec: RequestRecord, t0_ns: int, stall_factor: float = 3.0) -> RequestResult:
    """Everything about one request from its raw record; `t0_ns` is the run's start."""
    parsed = parse_stream(rec)
    status, error = classify(rec, parsed)
    sent = rec.sent_ns
    token_ns = parsed.token_ns
    ttft = (token_ns[0] - sent) / 1e9 if token_ns and sent is not None else None
    itls = [(b - a) / 1e9 for a, b in zip(token_ns, token_ns[1:])]
    e2e = (rec.end_ns - sent) / 1e9 if status == STATUS_OK and rec.end_ns is not None and sent is not None else None
    if parsed.usage_completion_tokens is not None:
        n_out, source = int(parsed.usage_completion_tokens), "usage"
    else:
        n_out, source = parsed.token_counts_in_chunks, "chunks"
    tpot = (e2e - ttft) / (n_out - 1) if e2e is not None and ttft is not None and n_out > 1 else None
    max_gap, median_gap, num_stalls, stall_s = stall_stats(itls, stall_factor)
    n_prompt = parsed.usage_prompt_tokens if parsed.usage_prompt_tokens is not None else rec.num_prompt_tokens_requested
    return RequestResult(
        request_id=rec.request_id, group=rec.group, warmup=rec.warmup, status=status, error=error,
        start_s=(sent - t0_ns) / 1e9 if sent is not None else None,
        client_queue_s=(sent - rec.scheduled_ns) / 1e9 if sent is not None else None,
        ttft_s=ttft, itl_s=itls, tpot_s=tpot, e2e_s=e2e,
        num_prompt_tokens=n_prompt, num_prompt_tokens_requested=rec.num_prompt_tokens_requested,
        num_output_tokens=n_out, output_tokens_source=source, num_chunks=parsed.token_counts_in_chunks,
        finish_reason=parsed.finish_reason, server_request_id=parsed.server_request_id,
        max_gap_s=max_gap, median_gap_s=median_gap, num_stalls=num_stalls, stall_s=stall_s,
        sent_ns=sent, token_ns=list(token_ns),
    )


def stall_stats(gaps: Sequence[float], stall_factor: float) -> tuple[float | None, float | None, int, float]:
    """(max gap, median gap, gaps over stall_factor x median, seconds of those gaps beyond the median).

    The threshold is relative to the stream's own median, so a slow-but-steady stream has no
    stalls and a fast stream that freezes once has one."""
    if not gaps:
        return None, None, 0, 0.0
    median = float(np.median(gaps))
    over = [g for g in gaps if g > stall_factor * median]
    return max(gaps), median, len(over), sum(g - median for g in over)


# -- aggregation --------------------------------------------------------------------------------------------
def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), as vLLM's --goodput."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in GOODPUT_METRICS or ms < 0:
            raise ValueError(
                f"goodput SLO {pair!r}: write NAME:MILLISECONDS with NAME one of {list(GOODPUT_METRICS)} "
                "(e.g. --goodput ttft:500 tpot:50)"
            )
        slos[name] = ms
    return slos


def is_good(m: RequestResult, slos: dict[str, float]) -> bool:
    """vLLM's goodput rule: a successful request meeting every SLO given (value <= SLO). A request
    with fewer than two output tokens has TPOT 0; one with no token at all fails a TTFT SLO."""
    if not m.ok:
        return False
    values = {"ttft": m.ttft_s, "tpot": m.tpot_s if m.tpot_s is not None else 0.0, "e2el": m.e2e_s}
    for name, slo_ms in slos.items():
        v = values[name]
        if v is None or v * 1000.0 > slo_ms:
            return False
    return True


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return "p" + (str(int(p)) if int(p) == p else str(p))


def describe(values_s: Sequence[float], percentiles: Sequence[float], stem: str) -> dict[str, float | None]:
    """mean/median/std/pXX of `values_s`, in ms, under vLLM's keys (mean_ttft_ms, p99_itl_ms, ...).
    Population std (numpy's default), linear-interpolated percentiles, as vLLM. None when empty."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    empty = arr.size == 0
    out[f"mean_{stem}_ms"] = None if empty else float(arr.mean())
    out[f"median_{stem}_ms"] = None if empty else float(np.median(arr))
    out[f"std_{stem}_ms"] = None if empty else float(arr.std())
    for p in percentiles:
        out[f"{percentile_key(p)}_{stem}_ms"] = None if empty else float(np.percentile(arr, p))
    out[f"max_{stem}_ms"] = None if empty else float(arr.max())
    return out


def summarize(
    ms: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput: dict[str, float] | None = None,
    stall_factor: float = 3.0,
    per_request_lists: bool = True,
) -> dict[str, Any]:
    """The run's result: vLLM `bench serve` keys where the metric is the same, phaselab keys beyond.

    `ms` are the measured requests (warm-ups excluded by the caller), in request order. The
    per-request lists (ttfts, itls, latencies, ...) hold None where a request has no value.
    """
    ok = [m for m in ms if m.ok]
    by_status = Counter(m.status for m in ms)
    total_input = sum(m.num_prompt_tokens or 0 for m in ok)
    total_output = sum(m.num_output_tokens for m in ok)

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": by_status[STATUS_OK],
        "failed": by_status[STATUS_FAILED],
        "incomplete": by_status[STATUS_INCOMPLETE],
        "num_requests": len(ms),
        "completed_without_tokens": sum(1 for m in ok if not m.token_ns),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "output_tokens_from_usage": sum(1 for m in ok if m.output_tokens_source == "usage"),
        "output_tokens_from_chunks": sum(1 for m in ok if m.output_tokens_source == "chunks"),
        "input_len_mismatches": sum(
            1 for m in ok if m.num_prompt_tokens_requested is not None and m.num_prompt_tokens is not None
            and m.num_prompt_tokens != m.num_prompt_tokens_requested),
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(sum(1 for m in ok if is_good(m, goodput))) if goodput else None,
        "goodput_slos_ms": dict(goodput) if goodput else None,
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "stall_factor": stall_factor,
        "total_stalls": sum(m.num_stalls for m in ok),
        "percentiles": list(percentiles),
    }
    values = {
        "ttft": [m.ttft_s for m in ok if m.ttft_s is not None],
        "tpot": [m.tpot_s for m in ok if m.tpot_s is not None],
        "itl": [g for m in ok for g in m.itl_s],
        "e2el": [m.e2e_s for m in ok if m.e2e_s is not None],
        "max_gap": [m.max_gap_s for m in ok if m.max_gap_s is not None],
        "client_queue_time": [m.client_queue_s for m in ok if m.client_queue_s is not None],
    }
    for stem in STAT_METRICS:
        result.update(describe(values[stem], percentiles, stem))
    result["errors_summary"] = dict(Counter(m.error for m in ms if m.error).most_common(20))
    groups = sorted({m.group for m in ms})
    if len(groups) > 1:
        result["groups"] = {
            g: summarize([m for m in ms if m.group == g], duration_s, percentiles, goodput, stall_factor,
                         per_request_lists=False)
            for g in groups
        }
    if per_request_lists:
        result.update({
            "request_ids": [m.request_id for m in ms],
            "statuses": [m.status for m in ms],
            "input_lens": [m.num_prompt_tokens for m in ms],
            "output_lens": [m.num_output_tokens if m.ok else 0 for m in ms],
            "ttfts": [m.ttft_s for m in ms],
            "itls": [m.itl_s for m in ms],
            "tpots": [m.tpot_s for m in ms],
            "latencies": [m.e2e_s for m in ms],
            "start_times": [m.start_s for m in ms],
            "queue_times": [m.client_queue_s for m in ms],
            "max_gaps": [m.max_gap_s for m in ms],
            "num_stalls": [m.num_stalls for m in ms],
            "errors": [m.error for m in ms],
        })
    return result


def interference_report(ms: Sequence[RequestResult], stall_factor: float = 3.0,
                        stream_group: str = "stream", long_group: str = "long") -> dict[str, Any]:
    """For each long prompt, the worst gap the streams suffered while it waited for its first token
    (a gap counts when it overlaps [long sent, long first token]), against the streams' median gap
    outside every such window. This is the "a new long prompt freezes other streams" number."""
    streams = [m for m in ms if m.group == stream_group and m.token_ns]
    longs = [m for m in ms if m.group == long_group]
    windows: list[tuple[int, int]] = []
    rows = []
    for lm in longs:
        if lm.sent_ns is None or not lm.token_ns:
            rows.append({"request_id": lm.request_id, "status": lm.status, "ttft_ms": None,
                         "max_stream_gap_ms": None, "num_streams_stalled": 0})
            continue
        sent, first = lm.sent_ns, lm.token_ns[0]
        windows.append((sent, first))
        worst, stalled = 0.0, 0
        for sm in streams:
            gaps = [(b - a) / 1e9 for a, b in zip(sm.token_ns, sm.token_ns[1:]) if a < first and b > sent]
            if gaps:
                worst = max(worst, max(gaps))
                if sm.median_gap_s and max(gaps) > stall_factor * sm.median_gap_s:
                    stalled += 1
        rows.append({"request_id": lm.request_id, "status": lm.status, "ttft_ms": (first - sent) / 1e6,
                     "max_stream_gap_ms": worst * 1e3, "num_streams_stalled": stalled})
    quiet = [
        (b - a) / 1e9
        for sm in streams for a, b in zip(sm.token_ns, sm.token_ns[1:])
        if not any(a < f and b > s for s, f in windows)
    ]
    return {
        "num_streams": len([m for m in ms if m.group == stream_group]),
        "median_stream_gap_outside_long_prefills_ms": float(np.median(quiet)) * 1e3 if quiet else None,
        "long_prompts": rows,
    }
