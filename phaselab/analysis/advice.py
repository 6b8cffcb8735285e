"""Advice with a predicted effect: each finding's suggested change as knobs, simulated on the run
itself (analysis/predict.py), its predicted before/after of the user-facing figures attached, and
its "worked if" threshold taken from that prediction, so it is reachable on the machine that ran it.

A change the prediction says would cost more E2E or throughput than it gains on the figure it
targets is flagged with that cost ("not suggested"); one that costs some is flagged with its cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phaselab.analysis import fmt
from phaselab.analysis.findings import REPEAT_SHARE
from phaselab.analysis.predict import LOWER_IS_BETTER, Change, Prediction, make_predictor

if TYPE_CHECKING:
    from phaselab.analysis.diagnose import Diagnosis
    from phaselab.analysis.findings import Finding
    from phaselab.obs.rundir import RunData

# the symptom figure each cause's change is judged on first (its costs on every other figure are shown
# beside it): a stall is the pause a long prompt imposes on the streams, its longest pause (ITL p99 over
# all tokens also counts the many small pauses chunking adds, and can worsen while every freeze
# shortens); K/V reads slow every step: ITL p50, the typical gap between tokens
TARGET = {"queue": "ttft_p99_s", "prefill": "ttft_p50_s", "stall": "longest_pause_s", "kv-capacity": "ttft_p50_s",
          "decode-kv": "itl_p50_s", "decode-step": "output_tokens_per_s",
          # a transfer delays every token after the first (the prefill worker streams the first itself)
          "transfer": "e2e_mean_s"}
LABEL = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "itl_p50_s": "ITL p50", "itl_p99_s": "ITL p99",
         "longest_pause_s": "longest pause", "e2e_mean_s": "E2E mean",
         "output_tokens_per_s": "output tokens/s"}
WORKED_FRACTION = 0.5  # worked if at least half of the predicted improvement is measured


def _scaled_memory(text: Any, factor: float) -> str:
    from phaselab.engine_args import parse_bytes

    return f"{max(1, int(parse_bytes(text) * factor / 2**20))}MiB"


def suggested_change(d: Diagnosis, f: Finding, run: RunData) -> Change | None:
    """The finding's change as simulator knobs and engine flags, or None (no knob: capacity,
    transport, front end)."""
    sched = d.config.get("scheduler") or {}
    args = d.config.get("engine_args") or {}
    cache = d.config.get("cache") or {}
    seqs, policy, budget = sched.get("max_num_seqs"), sched.get("policy"), sched.get("max_num_batched_tokens")
    peak = max((r.num_running for r in run.iterations), default=0)
    disagg = d.config.get("mode") == "disagg"
    if disagg and f.cause != "transfer":  # the knobs below are one engine's; a pool's change is not simulated
        return None

    def more_kv() -> Change | None:
        if not cache.get("num_blocks") or not args.get("kv_cache_memory"):
            return None
        mem = _scaled_memory(args["kv_cache_memory"], 2)
        return Change({"num_blocks": 2 * int(cache["num_blocks"])}, f"--kv-cache-memory {mem}",
                      {"kv_cache_memory": mem})

    if f.cause == "kv-capacity":
        return more_kv()
    if f.cause == "queue" and d.queue is not None:
        if d.queue.max_kv_usage is not None and d.queue.max_kv_usage > 0.9:
            return more_kv()
        if seqs and (d.queue.frac_at_max_seqs or 0) > 0.5:
            return Change({"max_num_seqs": 2 * seqs}, f"--max-num-seqs {2 * seqs}", {"max_num_seqs": 2 * seqs})
        return None
    if f.cause == "stall":
        if policy == "prefill-first":
            longest = max((m.num_prompt_tokens for m in run.requests), default=512)
            new = max(64, longest // 4)
            return Change({"policy": "chunked", "max_num_batched_tokens": new},
                          f"--policy chunked --max-num-batched-tokens {new}",
                          {"policy": "chunked", "max_num_batched_tokens": new})
        if budget:
            return Change({"max_num_batched_tokens": max(64, budget // 2)},
                          f"--max-num-batched-tokens {max(64, budget // 2)}",
                          {"max_num_batched_tokens": max(64, budget // 2)})
        return None
    if f.cause == "decode-kv" and peak > 1:
        return Change({"max_num_seqs": max(1, peak // 2)}, f"--max-num-seqs {max(1, peak // 2)}",
                      {"max_num_seqs": max(1, peak // 2)})
    if f.cause == "decode-step" and seqs:
        return Change({"max_num_seqs": 2 * seqs}, f"--max-num-seqs {2 * seqs}", {"max_num_seqs": 2 * seqs})
    if f.cause == "transfer" and d.disagg is not None and (d.disagg.transfer_p50_s or 0) >= \
            (d.disagg.admission_wait_p50_s or 0) + (d.disagg.transfer_queue_p50_s or 0):
        # the wire is the cost (not waiting for it): one engine moves no KV; the prediction weighs the
        # transfer it saves against the interference it brings back
        return Change({}, "--mode colocated", {"mode": "colocated"}, {"mode": "colocated"})
    if f.cause == "prefill" and d.prefill is not None and d.prefill.prefix_caching is False and \
            (d.prefill.repeat_missed_rate or 0) >= REPEAT_SHARE:
        return Change({}, "--enable-prefix-caching", {"enable_prefix_caching": True}, {"enable_prefix_caching": True})
    if f.cause == "prefill" and policy == "chunked" and budget and (d.prefill and (d.prefill.wait_share_of_ttft or 0) > 0.2):
        return Change({"max_num_batched_tokens": 2 * budget}, f"--max-num-batched-tokens {2 * budget}",
                      {"max_num_batched_tokens": 2 * budget})
    return None


def prediction_text(p: Prediction) -> list[str]:
    rows = []
    for name, measured, predicted, rel in p.table():
        if measured is None or predicted is None:
            continue
        val = (lambda v: f"{v:.1f}") if name == "output_tokens_per_s" else fmt.s
        span = p.range(name)
        extra = f"; {span[0]:+.0%} to {span[1]:+.0%} over the readings the run allows" if span else ""
        rows.append(f"{LABEL[name]} {val(measured)} -> {val(predicted)} ({rel:+.0%}{extra})" if rel is not None else
                    f"{LABEL[name]} {val(measured)}")
    err = f"; cost model calibrated on this run, mean iteration error {p.cost_model_error:.0%}" \
        if p.cost_model_error is not None else ""
    return [f"predicted with `{p.change.flags}` (simulated with the engine's scheduler{err}): " + ", ".join(rows)] + \
        [f"caveat: {c}" for c in p.caveats]


def _gain(p: Prediction, name: str) -> float:
    r = p.relative(name) or 0.0
    return -r if LOWER_IS_BETTER[name] else r


def attach(d: Diagnosis, findings: list[Finding], run: RunData, path: str | None) -> list[str]:
    """Predict every finding's change; rewrite its check from the prediction. Returns notes."""
    changes = [(f, suggested_change(d, f, run)) for f in findings]
    if not any(c for _, c in changes):
        return []
    predictor, why = make_predictor(path)
    if predictor is None:
        return [f"suggested changes are not simulated: {why}"]
    for f, c in changes:
        if c is None:
            continue
        p = predictor.predict(c)
        f.suggestion, f.prediction = c, p
        target = TARGET[f.cause]
        f.evidence = f.evidence + prediction_text(p)
        gain = _gain(p, target)
        costs = [n for n in p.hurts()]
        cost_text = ", ".join(f"{LABEL[n]} {p.relative(n):+.0%}" for n in costs)
        if gain <= 0:
            f.suggested = False
            f.change = (f"NOT SUGGESTED: `{c.flags}` is predicted not to improve {LABEL[target]} on this run "
                        f"({(p.relative(target) or 0):+.0%})" + (f" and to cost {cost_text}" if costs else "")
                        + ". " + f.change)
            continue
        if costs:
            worst = max(abs(p.relative(n) or 0) for n in costs)
            head = "NOT SUGGESTED" if worst > gain else "FLAGGED"
            f.suggested = worst <= gain
            f.change = f"{head}: `{c.flags}` costs {cost_text} for {LABEL[target]} {p.relative(target):+.0%}. " + f.change
        measured, predicted = p.measured.get(target), p.predicted(target)
        span = p.range(target)
        if span is not None and measured is not None:  # reachable under every reading: the weakest one
            predicted = measured * (1 + (span[1] if LOWER_IS_BETTER[target] else span[0]))
        if measured is not None and predicted is not None:
            threshold = measured + WORKED_FRACTION * (predicted - measured)
            better = "below" if LOWER_IS_BETTER[target] else "above"
            val = (lambda v: f"{v:.1f}") if target == "output_tokens_per_s" else fmt.s
            f.check = (f"{LABEL[target]} {better} {val(threshold)} after `{c.flags}` (now {val(measured)}, predicted "
                       f"{val(predicted)}; the threshold is half the predicted change)")
    return []
