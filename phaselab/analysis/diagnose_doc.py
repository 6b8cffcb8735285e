"""The diagnosis as a document (rendered to the terminal, diagnosis.md and diagnosis.html)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phaselab.analysis import fmt
from phaselab.analysis.accounting import CAUSES
from phaselab.analysis.doc import Bullets, Doc, Heading, Para, Table
from phaselab.analysis.findings import HEALTHY_SHARE
from phaselab.analysis.slo_judgement import slo_section

if TYPE_CHECKING:
    from phaselab.analysis.diagnose import Diagnosis

MAX_VERDICTS = 6
MIN_VERDICT_SHARE = 0.01


def _run_line(d: Diagnosis) -> str:
    c = d.config
    s = d.summary
    sched = c.get("scheduler") or {}
    what = []
    if c.get("mode") == "disagg":
        roles = [w.get("role") for w in (c.get("workers") or {}).values()]
        what.append(f"disaggregated {roles.count('prefill')}P{roles.count('decode')}D")
    if sched:
        what.append(f"policy {sched.get('policy')}, budget {sched.get('max_num_batched_tokens')} tokens, "
                    f"max_num_seqs {sched.get('max_num_seqs')}")
    if c.get("source") == "client":
        what.append(f"client measurements of {(c.get('target') or {}).get('base_url', 'a server')}")
    if not s.num_requests:
        return "No request was recorded in this run: nothing to diagnose."
    return (f"{s.num_requests} requests over {fmt.s(s.duration_s)}" + "".join("; " + w for w in what)
            + f". TTFT p50 {fmt.s(s.ttft_p50_s)}, p99 {fmt.s(s.ttft_p99_s)}; ITL p50 {fmt.s(s.itl_p50_s)}, "
            f"p99 {fmt.s(s.itl_p99_s)}; output {fmt.num(s.output_throughput, 1)} tokens/s.")


def diagnosis_doc(d: Diagnosis) -> Doc:
    doc = Doc(f"phaselab diagnosis: {d.path or 'run'}")
    doc.add(Para(_run_line(d)))
    if d.healthy:
        doc.add(Para(f"Healthy: no cause has avoidable time above {fmt.pct(HEALTHY_SHARE, 0)} of the users' time "
                     f"(the largest, {d.top.cause if d.top else '—'}, "
                     f"{fmt.pct(d.top.avoidable_share if d.top else 0.0)}); the time is the work itself at this "
                     "machine's pace.", "verdict"))
    elif d.top is not None:
        doc.add(Para(f"Top cause: **{d.top.cause}** ({d.top.title}): {fmt.s(d.top.avoidable_s)} avoidable, "
                     f"{fmt.pct(d.top.avoidable_share)} of all request time, over {d.top.baseline}. "
                     f"{d.top.verdict}.", "verdict"))

    doc.add(Heading("Ranked causes: avoidable time", anchor="ranking"))
    doc.add(Table(["#", "cause", "avoidable time", "avoidable share", "measured from", "symptom figure"],
                  [[str(i + 1), f.cause, fmt.s(f.avoidable_s), fmt.pct(f.avoidable_share), f.baseline, f.key.text()]
                   for i, f in enumerate(d.findings)],
                  caption="Ranked by avoidable time: a cause's seconds over what the same work costs without it, "
                          "measured from the baseline named (docs/analysis.md, 'Avoidable time'); the symptom "
                          "figure is the one each cause's change is judged on.",
                  css="ranking", align_left=4))
    doc.add(Heading("Where the time went (raw shares)", anchor="time"))
    doc.add(Table(["cause", "seconds (all requests)", "share", "of which avoidable"],
                  [[c, f"{d.account.totals[c]:.3f}", fmt.pct(d.account.shares[c]),
                    f"{d.account.avoidable.get(c, 0.0):.3f}"] for c in CAUSES if d.account.totals[c] > 0]
                  + [["total (sum of E2E)", f"{d.account.total_s:.3f}", "100.0%",
                      f"{sum(d.account.avoidable.values()):.3f}"]],
                  caption="Each request's end-to-end time cut into causes that sum to it; a cause's raw share is its "
                          "part of the summed E2E of all requests, avoidable or not."))

    doc.add(Heading("Verdicts", anchor="verdicts"))
    shown = [f for f in d.findings if max(f.avoidable_share, f.share) >= MIN_VERDICT_SHARE][:MAX_VERDICTS] \
        or d.findings[:1]
    decode_shown = False
    for i, f in enumerate(shown):
        doc.add(Heading(f"{i + 1}. {f.cause}: {f.title} ({fmt.pct(f.avoidable_share)} avoidable, "
                        f"{fmt.pct(f.share)} of the time)", level=3))
        doc.add(Para(f.verdict + ".", "verdict"))
        if f.cause in ("decode-kv", "decode-step") and decode_shown:
            doc.add(Bullets(["the decode evidence is listed under the other decode verdict above"]))
        elif f.evidence:
            doc.add(Bullets(f.evidence))
        decode_shown = decode_shown or f.cause in ("decode-kv", "decode-step")
        doc.add(Para(f.change, "change"), Para(f.check, "check"))

    _ttft_section(d, doc)
    _decode_section(d, doc)
    _stall_section(d, doc)
    _disagg_section(d, doc)
    slo_section(d.slo, doc)
    if d.external:
        _external_section(d, doc)
    if d.notes:
        doc.add(Heading("Notes"))
        doc.add(Bullets(d.notes))
    return doc


def _ttft_section(d: Diagnosis, doc: Doc) -> None:
    t = d.ttft
    if t is None:
        return
    doc.add(Heading("First token: TTFT by phase", anchor="ttft"))
    heads = ["phase", "all requests"] + [f"p{p} ({t.at[p][0]}, {fmt.s(t.at[p][1])})" for p in t.at]
    rows = []
    for k in t.components:
        cells = [fmt.pct(t.share(k))] + [fmt.pct(t.shares_at(p)[k]) for p in t.at]
        if all(c == "0.0%" for c in cells):
            continue
        rows.append([k] + cells)
    rows.append(["total", fmt.pct(sum(t.share(k) for k in t.components))]
                + [fmt.pct(sum(t.shares_at(p).values())) for p in t.at])
    doc.add(Table(heads, rows, caption="Shares of TTFT. 'all requests': each phase summed over requests / TTFT "
                                       "summed; pXX: the request at that TTFT percentile (nearest rank)."))
    p = d.prefill
    if p and p.points:
        buckets: dict[int, list[float]] = {}
        for n, s in p.points:
            buckets.setdefault(n, []).append(s)
        rows = [[str(n), str(len(v)), fmt.s(sum(v) / len(v)),
                 fmt.s(p.fit.predict(n)) if p.fit else "—"] for n, v in sorted(buckets.items())]
        if len(rows) > 16:  # many distinct lengths: show a spread of them
            step = len(rows) / 16
            rows = [rows[int(i * step)] for i in range(16)] + [rows[-1]]
        cap = ("Prefill time against uncached input length (an iteration shared with other requests is "
               "apportioned by tokens)")
        if p.fit:
            cap += (f": {p.fit.slope_text(1e3, 'ms/token')} + {p.fit.intercept * 1e3:.1f} ms, R^2 {p.fit.r2:.2f}"
                    + ("; bends upward at long inputs" if p.bends_upward else ""))
        doc.add(Table(["input tokens", "requests", "prefill (mean)", "line"], rows, caption=cap))


def _decode_section(d: Diagnosis, doc: Doc) -> None:
    x = d.decode
    if x is None or not x.buckets:
        return
    doc.add(Heading("Later tokens: decode steps", anchor="decode"))
    doc.add(Table(["batch", "steps", "step time (mean)", "context tokens", "KV read / step (MODELED)",
                   "achieved bandwidth"],
                  [[f"{b.batch_lo}-{b.batch_hi}", str(b.steps), fmt.s(b.step_s), f"{b.context:.0f}",
                    fmt.nbytes(b.kv_read_bytes), fmt.rate(b.bandwidth)] for b in x.buckets],
                  caption=f"Decode-only iterations. {'Machine' if d.ceilings.kind != 'simulated' else 'Simulated'} "
                          f"bandwidth {fmt.rate(d.ceilings.bandwidth_bytes_per_s)} ({d.ceilings.label()}).",
                  align_left=1))


def _stall_section(d: Diagnosis, doc: Doc) -> None:
    st = d.stalls
    if st is None or not st.culprits:
        return
    doc.add(Heading("Streams paused by other requests' prefill", anchor="stalls"))
    doc.add(Table(["iteration", "worker", "duration", "prefill tokens", "requests prefilled", "streams waiting",
                   "longest gap"],
                  [[str(c.iteration_id), c.worker, fmt.s(c.duration_s), str(c.prefill_tokens),
                    ", ".join(sorted(c.requests)[:6]) + (" ..." if len(c.requests) > 6 else ""),
                    str(len(c.streams)), fmt.s(c.max_gap_s)] for c in st.culprits[:15]],
                  caption="Iterations that carried other requests' prefill tokens inside a running stream's gap, "
                          "most harmful first (streams waiting x duration).", align_left=0))


def _disagg_section(d: Diagnosis, doc: Doc) -> None:
    x = d.disagg
    if x is None:
        return
    doc.add(Heading("Disaggregated serving: moving state", anchor="disagg"))
    doc.add(Table(["transfers", "bytes", "per request", "transfer p50", "p99", "bandwidth", "transport wait p50",
                   "admission wait p50", "share of TTFT", "share of first gap"],
                  [[str(x.num_transfers), fmt.nbytes(x.bytes_total), fmt.nbytes(x.bytes_mean), fmt.s(x.transfer_p50_s),
                    fmt.s(x.transfer_p99_s), fmt.rate(x.bandwidth), fmt.s(x.transfer_queue_p50_s),
                    fmt.s(x.admission_wait_p50_s), fmt.pct(x.share_of_ttft), fmt.pct(x.share_of_first_gap)]],
                  align_left=0))
    if x.pools:
        doc.add(Table(["pool", "workers", "busy (mean)"],
                      [[p.role, ", ".join(f"{w} {fmt.pct(v)}" for w, v in p.workers.items()), fmt.pct(p.mean)]
                       for p in x.pools],
                      caption="Busy: time in iterations / the run's window (first arrival to last finish)"
                              + (f"; imbalance {x.imbalance:.2f}x" if x.imbalance else "") + ".", align_left=2))


def _external_section(d: Diagnosis, doc: Doc) -> None:
    e = d.external or {}
    doc.add(Heading("The server's own metrics (/metrics scrapes)", anchor="server-metrics"))
    rows = [[k, v.get("metric", "—"), fmt.s(v.get("mean_s")) if "mean_s" in v else str(v.get("value")),
             str(v.get("count", ""))] for k, v in (e.get("metrics") or {}).items()]
    if rows:
        doc.add(Table(["concept", "metric used", "mean / value", "count"], rows, align_left=2,
                      caption="phaselab's metric when the server exports it, else vLLM's (docs/metrics.md maps them)."))
    for n in e.get("notes") or []:
        doc.add(Para(n, "note"))
