"""The findings of `phaselab diagnose`: one per cause of the accounting (analysis/accounting.py),
each with its avoidable time and the baseline it is measured from, its key (symptom) figure,
evidence, the change it suggests and the number that would show the change worked; `rank_findings`
orders them by avoidable time (the raw share of the run's summed E2E breaks ties and is kept beside
it). They read the measures (measures.py) held by a Diagnosis (diagnose.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phaselab.analysis import fmt
from phaselab.analysis.accounting import BASELINES, CAUSES, STALL_FACTOR
from phaselab.analysis.measures import FIT_R2
from phaselab.analysis.predict import Change, Prediction

if TYPE_CHECKING:
    from phaselab.analysis.diagnose import Diagnosis

TITLES = {
    "queue": "first token slow: requests wait in the queue",
    "prefill": "first token slow: prefill compute",
    "transfer": "disaggregated servers spend time moving KV state",
    "stall": "a new prompt pauses the other streams",
    "kv-capacity": "KV capacity: requests wait for blocks, are preempted and recompute",
    "decode-kv": "later tokens slow down as the history grows (KV reads)",
    "decode-step": "later tokens: the per-step cost (weights read every step)",
    "decode": "later tokens: decode time (not split into K/V reads and per-step cost)",
    "overhead": "tokenization, admission and delivery overhead",
}
HEALTHY_SHARE = 0.10  # no cause with avoidable time above this share of the users' time: a healthy run


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
    share: float  # raw: the cause's seconds as a share of the run's summed E2E
    seconds: float  # raw: the cause's seconds summed over requests
    key: KeyFigure
    verdict: str
    evidence: list[str]
    change: str
    check: str
    suggestion: Change | None = None  # the change as knobs (analysis/advice.py)
    prediction: Prediction | None = None  # its simulated effect on this run
    suggested: bool = True  # False: the prediction says the change would not help, or costs more than it gains
    avoidable_s: float = 0.0  # the ranking score: seconds over the baseline (accounting.BASELINES)
    avoidable_share: float = 0.0  # of the run's summed E2E
    baseline: str = ""  # what avoidable_s is measured from


def _policy(config: dict[str, Any]) -> tuple[str | None, int | None]:
    sched = config.get("scheduler") or {}
    if not sched and config.get("workers"):  # disaggregated: the prefill workers' scheduler
        for w in config["workers"].values():
            if w.get("role") == "prefill" and (w.get("engine") or {}).get("scheduler"):
                sched = w["engine"]["scheduler"]
                break
    return sched.get("policy"), sched.get("max_num_batched_tokens")


def rank_findings(d: Diagnosis) -> list[Finding]:
    builders = {"queue": _queue_finding, "prefill": _prefill_finding, "transfer": _transfer_finding,
                "stall": _stall_finding, "kv-capacity": _kv_capacity_finding, "decode-kv": _decode_kv_finding,
                "decode-step": _decode_step_finding, "decode": _decode_finding, "overhead": _overhead_finding}
    out = []
    acc = d.account
    shares = acc.shares
    for cause in CAUSES:
        if acc.totals[cause] <= 0:
            continue
        f = builders[cause](d)
        f.share, f.seconds = shares[cause], acc.totals[cause]
        f.avoidable_s, f.avoidable_share = acc.avoidable.get(cause, 0.0), acc.avoidable_share(cause)
        f.baseline = BASELINES[cause]
        out.append(f)
    out.sort(key=lambda f: (f.avoidable_s, f.share), reverse=True)
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
    elif q.burst is not None:
        ev.append(f"a burst: {q.burst[0]} requests arrived within {fmt.s(q.burst[1])} (no sustained arrival rate)"
                  + (f"; completions {q.service_rate:.2f} req/s while busy" if q.service_rate is not None else ""))
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


REPEAT_SHARE = 0.1  # repeated prompt tokens computed again: above this share, prefix caching is the change


def _prefill_finding(d: Diagnosis) -> Finding:
    p = d.prefill
    assert p is not None
    ev = [f"prefill (compute + waits between chunks) is {fmt.pct(p.share_of_ttft)} of TTFT"]
    if p.fit is not None:
        what = "client TTFT against input length" if d.source == "client" else \
            "prefill time against uncached input length"
        if not p.fit.slope_significant:
            ev.append(f"{what}: no measurable slope over {p.fit.n} requests "
                      f"({p.fit.slope_text(1e3, 'ms/token')}: the inputs' lengths do not spread enough)")
        else:
            icpt = (f"intercept {p.fit.intercept * 1e3:.1f} +- {p.fit.intercept_ci * 1e3:.1f} ms"
                    if p.fit.intercept_plausible else "intercept below 0 (an extrapolation far outside the "
                    "measured lengths; not meaningful)")
            ev.append(f"{what}: {p.fit.slope_text(1e3, 'ms/token')}, {icpt}, R^2 {p.fit.r2:.2f} "
                      f"over {p.fit.n} requests")
    if p.bend_ratio is not None:
        ev.append(f"at the longest inputs prefill takes {p.bend_ratio:.2f}x the line through the shorter half"
                  + (" — it bends upward (attention grows with the square of the length)" if p.bends_upward
                     else " — within the noise: no bend claimed" if p.bend_ratio > 1.15 else " — no upward bend"))
    if p.tokens_per_s:
        gemm = d.ceilings.gemm_flops_per_s
        ev.append(f"prefill-only iterations: {p.tokens_per_s:.0f} tokens/s; MODELED "
                  f"{fmt.rate(p.achieved_flops, 'FLOP/s')}"
                  f" = {fmt.pct((p.achieved_flops or 0) / gemm)} of {_ceiling_owner(d)} GEMM rate "
                  f"({d.ceilings.adjective} {fmt.rate(gemm, 'FLOP/s')})")
    if p.mean_chunks:
        ev.append(f"chunks per prompt: {p.mean_chunks:.1f}; waits between chunks {fmt.pct(p.wait_share_of_ttft)} "
                  "of TTFT")
    if p.prefix_hit_rate:
        ev.append(f"prefix cache served {fmt.pct(p.prefix_hit_rate)} of prompt tokens")
    repeats = (p.repeat_missed_rate or 0) >= REPEAT_SHARE
    if p.repeat_missed_rate:
        ev.append(f"{fmt.pct(p.repeat_missed_rate)} of prompt tokens repeated the beginning of an earlier request "
                  "and were computed again" + (" (prefix caching is off)" if p.prefix_caching is False else
                                              " (evicted before they were reused, or computed by requests admitted "
                                              "together)"))
    policy, budget = _policy(d.config)
    if repeats and p.prefix_caching is False:
        change = (f"prompts repeat each other's beginnings ({fmt.pct(p.repeat_missed_rate)} of prompt tokens) and "
                  "prefix caching is off: turn it on (--enable-prefix-caching) so each repeat is computed once")
    elif p.wait_share_of_ttft and p.wait_share_of_ttft > 0.2 and policy == "chunked":
        change = (f"chunks wait between iterations ({fmt.pct(p.wait_share_of_ttft)} of TTFT): raise "
                  f"--max-num-batched-tokens (now {budget}) or --max-num-partial-prefills")
    else:
        change = (f"prefill compute is the TTFT on {d.ceilings.where}: send fewer uncached prompt tokens "
                  "(shared prefixes "
                  "hit the prefix cache), give prefill its own capacity (disaggregated prefill workers, a faster "
                  "device); chunking does not shorten it")
        if p.bends_upward:
            change += "; long inputs cost more than linearly: cap or split the longest prompts"
    slope = p.fit.slope * 1e3 if p.fit and p.fit.slope_significant and p.fit.slope > 0 else None
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
             f"machine memory bandwidth {fmt.rate(d.ceilings.bandwidth_bytes_per_s)} ({d.ceilings.adjective})"),
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
        change = ("the KV transfer itself is slow: serve colocated (--mode colocated) where the transfer costs more "
                  "than the interference it removes (its prediction weighs the two on this run), or use a "
                  "faster transport (--kv-transport; shared memory or RDMA/NCCL between hosts), or overlap it with "
                  "prefill layer by layer")
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
    excess = sorted(g.excess_s for g in st.gaps)
    p99 = excess[min(len(excess) - 1, int(0.99 * len(excess)))] if excess else 0.0
    ev.insert(1, f"symptom: longest pause {fmt.s(st.max_stall_s)}; p99 of the pauses over the stream's own pace "
                 f"{fmt.s(p99)} (pace {fmt.s(base)})")
    check = (f"longest pause of a running stream below {fmt.s(STALL_FACTOR * base)} ({STALL_FACTOR:g}x its pace; "
             f"now {fmt.s(st.max_stall_s)}); ITL p99 over all tokens may rise as chunks add small pauses "
             f"(now {fmt.s(d.summary.itl_p99_s)})")
    verdict = (f"other requests' prefill paused running streams for {fmt.s(st.total_excess_s)} in all; the longest "
               f"gap was {fmt.s(st.max_stall_s)}")
    return _f("stall", KeyFigure("longest stall", st.max_stall_s, "s"), verdict, ev, change, check)


def _kv_capacity_finding(d: Diagnosis) -> Finding:
    acc = d.account
    kinds = acc.kv_seconds()
    n = acc.num_preemptions
    victims = sum(1 for r in acc.requests if r.kv.num_preemptions)
    ev = [f"{n} preemptions (the scheduler's own events) of {victims} requests",
          f"recompute compute {fmt.s(kinds['recompute'])}, readmission wait {fmt.s(kinds['readmission'])}, "
          f"first admission waiting for free blocks {fmt.s(kinds['block_wait'])}"]
    if d.queue and d.queue.max_kv_usage is not None:
        ev.append(f"peak KV usage {fmt.pct(d.queue.max_kv_usage)}")
    sched = d.config.get("scheduler") or {}
    change = ("the KV cache is too small for the load: raise --kv-cache-memory; or lower --max-num-seqs "
              f"(now {sched.get('max_num_seqs')}) / max_model_len so fewer sequences hold blocks at once — "
              "not more concurrency, which makes the shortage worse")
    check = f"preemptions 0 (now {n}) and KV-capacity time near 0 (now {fmt.s(acc.totals['kv-capacity'])})"
    verdict = (f"the KV cache ran out: {n} preemptions, and {fmt.s(acc.totals['kv-capacity'])} of the users' time "
               "went to waiting for blocks and rebuilding lost KV")
    return _f("kv-capacity", KeyFigure("preemptions", float(n), "events"), verdict, ev, change, check)


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
                  f"{fmt.rate(bw)} ({d.ceilings.adjective})"
                  + (" — a memory-bound signature" if frac > 0.5 else
                     " — well below the memory roof: per-step overheads and compute dominate"))
    for w, att in sorted(d.account.attribution.items()):
        who = f"{w}: " if len(d.account.attribution) > 1 else ""
        if not att.separable:
            ev.append(f"{who}decode time not separable into weights, K/V reads and overhead: {att.reason}")
            continue
        sh = att.shares or {}
        if att.method == "timers":
            ev.append(f"{who}MEASURED by the engine's kernel timers over {att.num_steps} decode steps "
                      f"(iterations.jsonl attention_ns / linear_ns): attention (K/V reads) {fmt.pct(sh.get('kv'))}, "
                      f"linear layers (weights) {fmt.pct(sh.get('weights'))}, the rest (elementwise kernels, "
                      f"scheduling, sampling, Python) {fmt.pct(sh.get('overhead'))} of decode-step time; attention "
                      f"{att.per_kv_token_s * 1e6:.3f} ms per 1000 history tokens, linear layers "
                      f"{fmt.s(att.per_step_s)} per step")
            continue
        a_ci, b_ci, c_ci = att.ci
        ev.append(f"{who}MEASURED (regression: no kernel timers) over {att.num_steps} decode steps: step = {att.per_step_s * 1e3:.2f} +- "
                  f"{a_ci * 1e3:.2f} ms per step (weights {att.weights_s * 1e3:.2f} ms at "
                  f"{'the measured bandwidth' if att.bounded else 'no measured bandwidth: not split off'}) + "
                  f"{att.per_seq_s * 1e3:.3f} +- {b_ci * 1e3:.3f} ms per sequence + {att.per_kv_token_s * 1e6:.3f} +- "
                  f"{c_ci * 1e6:.3f} ms per 1000 history tokens (R^2 {att.r2:.2f}, error {fmt.s(att.rmse_s)} per step); "
                  f"shares of decode-step time: weights {fmt.pct(sh.get('weights'))}, K/V reads "
                  f"{fmt.pct(sh.get('kv'))}, per-step and per-sequence overhead {fmt.pct(sh.get('overhead'))}")
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


def measured_kv_share(d: Diagnosis) -> float | None:
    """Share of the users' decode time (split part) that the measured attribution gives K/V reads."""
    t = d.account.totals
    split = t["decode-kv"] + t["decode-step"]
    return t["decode-kv"] / split if split > 0 else None


def _decode_kv_finding(d: Diagnosis) -> Finding:
    x = d.decode
    kv = measured_kv_share(d)
    max_seqs = (d.config.get("scheduler") or {}).get("max_num_seqs")
    change = (f"the history is what later tokens pay for: lower --max-num-seqs (now {max_seqs}) so each step reads "
              "less KV (fewer tokens per second in total), cap output lengths / max_model_len, or add decode capacity "
              "(another replica, or more decode workers in a disaggregated deployment)")
    step = x.step_p50_s if x else None
    check = (f"decode step p50 below {fmt.s((step or 0) * 0.7)} (now {fmt.s(step)}) with the measured K/V share of "
             f"decode time below {fmt.pct((kv or 0) * 0.6)} (now {fmt.pct(kv)})")
    how = ", ".join(sorted({a.describe() for a in d.account.attribution.values() if a.separable})) or "—"
    verdict = f"K/V-cache reads take {fmt.pct(kv)} of decode time (split by {how})" + (
        ": the history slows the tokens" if (kv or 0) >= 0.3 else "; the history costs little per step here")
    return _f("decode-kv", KeyFigure("K/V reads' share of decode time (measured)", kv or 0.0, "share"), verdict,
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
               f"{'' if d.ceilings.kind == 'simulated' else ' ' + d.ceilings.adjective} bandwidth {fmt.s(floor)})")
    return _f("decode-step", KeyFigure("decode step p50", (x.step_p50_s or 0.0) if x else 0.0, "s"), verdict,
              _decode_evidence(d), change, check)


def _decode_finding(d: Diagnosis) -> Finding:
    s = d.summary
    verdict = f"time after the first token: ITL p50 {fmt.s(s.itl_p50_s)}, p99 {fmt.s(s.itl_p99_s)}"
    reasons = [a.reason for a in d.account.attribution.values() if not a.separable]
    change = (("decode time is not split (" + "; ".join(sorted(set(reasons))) + "): vary the batch and the "
               "history lengths in the workload to measure K/V vs per-step cost; meanwhile: fewer concurrent "
               "streams shorten each step") if reasons else
              "record the server's iterations (phaselab serve --record) to split decode time into KV reads and the "
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
