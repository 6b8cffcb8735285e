"""Summaries of a run's request records (simulated or real: both are RequestMetrics).

Names follow docs/metrics.md: TTFT = arrived -> first token sent; TBT ("time between tokens",
Sarathi-Serve's name) = every gap between consecutive sent tokens, which phaselab calls ITL;
TPOT = (E2E - TTFT) / (n_out - 1) per request; queue = queued -> first scheduled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from phaselab.core.timing import RequestMetrics


def percentile(values: Sequence[float], q: float) -> float:
    """Linearly interpolated percentile (numpy's default method); NaN without values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values) if values else math.nan, "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values) if values else math.nan}


def transfer_share(m: RequestMetrics) -> float | None:
    """Fraction of TTFT spent in the KV transfer (its queue included); None without a transfer."""
    parts = m.ttft_components_ns()
    total = sum(parts.values())
    if m.kv_transfer_start_ns is None or not total:
        return None
    return (parts["transfer"] + parts["transfer_queue"]) / total


def summarize(requests: Sequence[RequestMetrics], duration_s: float | None = None) -> dict[str, Any]:
    ok = [m for m in requests if m.finish_reason in ("stop", "length") and m.ttft_s is not None]
    ttft = [m.ttft_s for m in ok if m.ttft_s is not None]
    tpot = [m.tpot_s for m in ok if m.tpot_s is not None]
    tbt = [gap for m in ok for gap in m.itl_s]
    queue = [m.queue_s for m in ok if m.queue_s is not None]
    e2e = [m.e2e_s for m in ok if m.e2e_s is not None]
    shares = [s for m in ok if (s := transfer_share(m)) is not None]
    transfer = [m.transfer_s for m in ok if m.transfer_s is not None]
    if duration_s is None and ok:
        duration_s = (max(m.finished_ns or 0 for m in ok) - min(m.arrived_ns for m in ok)) / 1e9
    out_tokens = sum(m.num_output_tokens for m in ok)
    summary: dict[str, Any] = {
        "num_requests": len(requests), "num_completed": len(ok),
        "num_failed": sum(1 for m in requests if m.finish_reason == "error"),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s else math.nan,
        "ttft_s": _dist(ttft), "tpot_s": _dist(tpot), "tbt_s": _dist(tbt), "queue_s": _dist(queue),
        "e2e_s": _dist(e2e),
        "num_preemptions": sum(m.num_preemptions for m in requests),
    }
    if transfer:
        summary["transfer_s"] = _dist(transfer)
        summary["transfer_share_of_ttft"] = _dist(shares) if shares else None
        summary["kv_transfer_bytes_mean"] = sum(m.kv_transfer_bytes or 0 for m in ok) / len(ok)
    return summary


def slo_attainment(requests: Sequence[RequestMetrics], ttft_s: float, tpot_s: float) -> float:
    """DistServe's attainment: the fraction of requests meeting both the TTFT and the TPOT SLO
    (failed requests miss; a one-token request has no TPOT and meets it)."""
    if not requests:
        return math.nan
    good = 0
    for m in requests:
        if m.finish_reason not in ("stop", "length") or m.ttft_s is None or m.ttft_s > ttft_s:
            continue
        if m.tpot_s is not None and m.tpot_s > tpot_s:
            continue
        good += 1
    return good / len(requests)


def format_summary(s: dict[str, Any]) -> str:
    ms = 1e3

    def row(name: str, d: dict[str, float] | None) -> str:
        if not d:
            return ""
        return (f"  {name:<22} p50 {d['p50'] * ms:9.2f} ms   p90 {d['p90'] * ms:9.2f} ms   "
                f"p99 {d['p99'] * ms:9.2f} ms   mean {d['mean'] * ms:9.2f} ms\n")

    text = (f"  requests               {s['num_completed']}/{s['num_requests']} completed in {s['duration_s']:.2f} s"
            f" ({s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s), "
            f"{s['num_preemptions']} preemptions\n")
    text += row("TTFT", s["ttft_s"]) + row("TPOT", s["tpot_s"]) + row("TBT (ITL)", s["tbt_s"])
    text += row("queue", s["queue_s"]) + row("E2E", s["e2e_s"])
    if "transfer_s" in s:
        text += row("KV transfer", s["transfer_s"])
        share = s.get("transfer_share_of_ttft")
        if share:
            text += f"  transfer share of TTFT p50 {share['p50']:.1%}   mean {share['mean']:.1%}\n"
    return text
