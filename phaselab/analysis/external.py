"""Diagnosing a server from outside: a `phaselab bench --record DIR --scrape-metrics` client run
against any OpenAI-compatible server (phaselab, vLLM, ...), read with the server's /metrics.

The client sees only when it sent each request and when each content chunk arrived. The server's
scrapes (before/after the run) add what happened inside: mean queue time and mean prefill time
(phaselab's metric names, else vLLM's; `promtext.py` lists them). So the accounting here is per run,
not per request:

    client TTFT (summed)  = queue (server mean x requests) + prefill (server mean x requests)
                            + the rest: network, HTTP, tokenization, detokenization (overhead)
    after the first token = stall (gaps over 3x the stream's own median that overlap another
                            request's wait for its first token: that request's prefill, most likely)
                            + decode (the rest; not split without iteration records)

vLLM's `request_prefill_time_seconds` runs from scheduled to the first token (it includes waits
between chunks); phaselab's prefill compute excludes them. The diagnosis names the metric used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phaselab.analysis import promtext
from phaselab.analysis.accounting import CAUSES, STALL_FACTOR, Gap, RequestAccount, RunAccount
from phaselab.analysis.machine import Ceilings
from phaselab.analysis.stats import linear_fit, median, percentile, upward_bend
from phaselab.core.timing import RequestMetrics
from phaselab.obs.rundir import RunData


def _raw_lines(path: str | None) -> dict[str, dict[str, Any]]:
    """Client-only fields (status, warmup, group) that RequestMetrics does not carry."""
    out: dict[str, dict[str, Any]] = {}
    if not path:
        return out
    f = Path(path) / "requests.jsonl"
    if f.is_file():
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                d = json.loads(line)
                out[str(d.get("request_id"))] = d
    return out


def _read(path: str | None, name: str) -> str | None:
    if not path:
        return None
    f = Path(path) / name
    return f.read_text(encoding="utf-8") if f.is_file() else None


def _client_gaps(reqs: list[RequestMetrics]) -> list[Gap]:
    """Stalls as the client sees them, aligned with other requests' waits for their first token."""
    windows = [(m.request_id, m.arrived_ns, m.token_sent_ns[0], m.num_prompt_tokens) for m in reqs if m.token_sent_ns]
    gaps = []
    for m in reqs:
        ts = m.token_sent_ns
        d = [(b - a) / 1e9 for a, b in zip(ts, ts[1:])]
        base = median(d)
        if not d or not base:
            continue
        for k, g in enumerate(d, start=1):
            if g <= STALL_FACTOR * base:
                continue
            a, b = ts[k - 1], ts[k]
            culprits = {rid: n for rid, s, e, n in windows if rid != m.request_id and s < b and e > a}
            if culprits:
                gaps.append(Gap(m.request_id, "client", k, a, b, base, g - base, "stall", [], culprits))
    return gaps


def diagnose_client_run(run: RunData, path: str | None, ceilings: Ceilings) -> Any:
    from phaselab.analysis.diagnose import Diagnosis
    from phaselab.analysis.findings import rank_findings
    from phaselab.analysis.measures import (DecodeAnalysis, PrefillAnalysis, QueueAnalysis, StallAnalysis,
                                            arrival_rate_or_burst, summarize)

    raw = _raw_lines(path)
    reqs = [m for m in run.requests if not raw.get(m.request_id, {}).get("warmup")
            and raw.get(m.request_id, {}).get("status", "ok") == "ok" and m.token_sent_ns]
    before = promtext.parse(_read(path, "server_metrics_before.prom"))
    after = promtext.parse(_read(path, "server_metrics_after.prom"))
    notes: list[str] = []
    metrics: dict[str, dict[str, Any]] = {}
    for concept in ("ttft", "queue", "prefill", "decode", "itl", "tpot", "e2e"):
        h = promtext.histogram(concept, before, after)
        if h is not None and h.count > 0:
            metrics[concept] = {"metric": h.name, "mean_s": h.mean, "count": int(h.count)}
    for concept in ("preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens"):
        found = promtext.counter(concept, before, after)
        if found is not None:
            metrics[concept] = {"metric": found[0], "value": found[1]}
    for concept in ("kv_usage", "waiting", "running"):
        g = promtext.gauge(concept, after)
        if g is not None:
            metrics[concept] = {"metric": g[0], "value": g[1]}
    if not metrics:
        notes.append("no /metrics scrapes in the run directory (bench --scrape-metrics): the first token is not "
                      "split into queue and prefill")

    n = len(reqs)
    ttft_sum = sum(m.ttft_s or 0.0 for m in reqs)
    queue_mean = (metrics.get("queue") or {}).get("mean_s") or 0.0
    prefill_mean = (metrics.get("prefill") or {}).get("mean_s") or 0.0
    queue_est, prefill_est = queue_mean * n, prefill_mean * n
    if queue_est + prefill_est > ttft_sum > 0:  # the server's definitions overlap the client's TTFT: scale down
        scale = ttft_sum / (queue_est + prefill_est)
        queue_est, prefill_est = queue_est * scale, prefill_est * scale
        notes.append("the server's queue + prefill means exceed the client's TTFT (different start points, "
                     "warm-ups in the scrape): both were scaled to fit")
    gaps = _client_gaps(reqs)
    totals = dict.fromkeys(CAUSES, 0.0)
    accounts = []
    for m in reqs:
        parts = dict.fromkeys(CAUSES, 0.0)
        ttft = m.ttft_s or 0.0
        share = ttft / ttft_sum if ttft_sum > 0 else 0.0
        parts["queue"], parts["prefill"] = queue_est * share, prefill_est * share
        parts["overhead"] = ttft - parts["queue"] - parts["prefill"]
        mine = [g for g in gaps if g.request_id == m.request_id]
        parts["stall"] = sum(g.excess_s for g in mine)
        e2e = m.e2e_s or 0.0
        parts["decode"] = max(0.0, e2e - ttft - parts["stall"])
        # avoidable (accounting.BASELINES): the server's prefill has no repeat counts here; decode is the
        # gaps over the request's own median gap (a stalled gap's excess is the stall's)
        stalled = {g.token_index for g in mine}
        ts = m.token_sent_ns
        d = [(b - a) / 1e9 for a, b in zip(ts, ts[1:])]
        pace = median(d) or 0.0
        avoid = {c: (parts[c] if c in ("queue", "stall", "overhead") else 0.0) for c in CAUSES}
        avoid["decode"] = sum(max(0.0, g - pace) for k, g in enumerate(d, start=1) if k not in stalled)
        accounts.append(RequestAccount(m.request_id, e2e, m.ttft_s, parts, mine, avoidable=avoid))
        for cause, v in parts.items():
            totals[cause] += v
    avoidable = {c: sum(a.avoidable[c] for a in accounts) for c in CAUSES}
    account = RunAccount(accounts, totals, sum(a.e2e_s for a in accounts), False, avoidable=avoidable)

    arrivals = sorted(m.arrived_ns for m in reqs)
    ends = [m.finished_ns for m in reqs if m.finished_ns]
    arrival_rate, burst = arrival_rate_or_burst(arrivals, max(ends) if ends else None)
    service = n / ((max(ends) - arrivals[0]) / 1e9) if ends and max(ends) > arrivals[0] else None
    qshare = queue_est / ttft_sum if ttft_sum > 0 else None
    queue = QueueAnalysis(qshare, None, None, arrival_rate, service, None, None, None,
                          None, None,
                          (metrics.get("kv_usage") or {}).get("value"), burst)
    pts = [(m.num_prompt_tokens, m.ttft_s or 0.0) for m in reqs if m.num_prompt_tokens]
    fit = linear_fit([p[0] for p in pts], [p[1] for p in pts])
    bend = upward_bend([p[0] for p in pts], [p[1] for p in pts])
    queries = (metrics.get("prefix_cache_queries") or {}).get("value")
    hits = (metrics.get("prefix_cache_hits") or {}).get("value")
    prefill = PrefillAnalysis(prefill_est / ttft_sum if ttft_sum > 0 else None, pts, fit,
                              bend.ratio if bend else None, bool(bend and bend.bends_upward), None, None, None, None,
                              hits / queries if queries and hits is not None else None)
    itls = [g for m in reqs for g in m.itl_s]
    tpots = [m.tpot_s for m in reqs if m.tpot_s is not None]
    decode = DecodeAnalysis(0, None, None, None, None, None, None, None, None, [],
                            percentile(itls, 50), percentile(itls, 99), percentile(tpots, 50))
    stall_gaps = [g for g in gaps if g.cause == "stall"]
    stalls = StallAnalysis(stall_gaps, stall_gaps, sum(g.excess_s for g in stall_gaps),
                           max((g.gap_s for g in stall_gaps), default=0.0), [])
    client_run = RunData(reqs, [], run.config, None)
    summary = summarize(client_run, account, None, stalls, None)
    if ttft_sum > 0:
        summary.ttft_shares = {"queue": queue_est / ttft_sum, "prefill": prefill_est / ttft_sum,
                               "overhead": 1 - (queue_est + prefill_est) / ttft_sum}
    notes.append("client measurements: TTFT, ITL and E2E are the client's (network included); server phases come "
                 "from the /metrics means, so the split is per run, not per request")
    notes.append(f"machine ceilings: {ceilings.label()} (they describe this machine, not necessarily the server's)")
    diag = Diagnosis(path, "client", run.config, summary, account, [], None, queue, prefill, decode, stalls, None,
                     ceilings, notes, {"metrics": metrics, "notes": []})
    diag.findings = rank_findings(diag)
    return diag
