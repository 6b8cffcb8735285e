"""Judging the adaptive budget of a run (--slo-tbt-ms, docs/slo.md): was the target held, and
which iterations missed it and why.

    an iteration that carries decodes is one inter-token gap of every stream in it: it holds the
    TBT target when its measured time (schedule -> outputs handed over) is under the target
    a miss is
        infeasible       the policy knew: even min_chunk (or the decodes alone) was predicted over
                         the target; the hardware cannot hold it with that many decodes
        under-predicted  the policy planned under target x (1 - margin) and the iteration took
                         longer: the online cost model was wrong by more than the margin (noise,
                         another process, a shape it had not learned yet)
    attainment is counted per decode iteration and per inter-token gap of the requests (what
    the streams saw, delivery included); TTFT attainment when --slo-ttft-ms was set

Reads records only (a run directory, real or simulated); imports neither torch nor the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from phaselab.analysis import fmt
from phaselab.analysis.doc import Bullets, Doc, Heading, Para, Table
from phaselab.analysis.stats import median, percentile
from phaselab.core.timing import IterationRecord, RequestMetrics

MAX_LISTED_MISSES = 8


@dataclass
class Miss:
    iteration_id: int
    worker: str
    cause: str  # "infeasible" | "under-predicted"
    measured_s: float
    predicted_s: float | None
    num_decodes: int
    prefill_tokens: int
    prefill_budget: int


@dataclass
class SloJudgement:
    target_s: float
    margin: float | None
    num_decode_iterations: int
    num_held: int  # decode iterations within the target
    decode_iteration_p50_s: float | None
    decode_iteration_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_attainment: float | None  # share of inter-token gaps within the target
    num_infeasible: int  # iterations the policy marked infeasible (with or without decodes)
    prediction_error_p50: float | None  # |predicted - measured| / measured over adaptive iterations
    prediction_error_p90: float | None
    budget_p50: float | None
    budget_at_min_share: float | None  # of decode iterations with prefill pending, at min_chunk
    misses: list[Miss] = field(default_factory=list)
    ttft_target_s: float | None = None
    ttft_attainment: float | None = None

    @property
    def attainment(self) -> float | None:
        return self.num_held / self.num_decode_iterations if self.num_decode_iterations else None

    @property
    def held(self) -> bool:
        """The acceptance's reading: p99 of the decode iterations within +15% of the target."""
        p99 = self.decode_iteration_p99_s
        return p99 is not None and p99 <= 1.15 * self.target_s

    def misses_by_cause(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.misses:
            out[m.cause] = out.get(m.cause, 0) + 1
        return out

    def verdict(self) -> str:
        a = self.attainment
        head = (f"TBT target {fmt.s(self.target_s)}: {'held' if self.held else 'NOT held'} "
                f"({fmt.pct(a)} of {self.num_decode_iterations} decode iterations within it, "
                f"p99 {fmt.s(self.decode_iteration_p99_s)})")
        causes = self.misses_by_cause()
        if not causes:
            return head
        why = []
        if causes.get("infeasible"):
            why.append(f"{causes['infeasible']} infeasible: even the smallest chunk (or the decodes alone) was "
                       "predicted over the target, so this hardware cannot hold it with that many decodes; "
                       "lower --max-num-seqs or raise the target")
        if causes.get("under-predicted"):
            why.append(f"{causes['under-predicted']} under-predicted: the online cost model planned under the "
                       f"target and the iteration took longer (median prediction error "
                       f"{fmt.pct(self.prediction_error_p50)}); raise --slo-margin or look for another process "
                       "on the machine")
        return head + "; misses: " + "; ".join(why)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "attainment": self.attainment, "held": self.held,
                "misses_by_cause": self.misses_by_cause(), "verdict": self.verdict()}


def _target(config: dict[str, Any], iterations: list[IterationRecord]) -> tuple[float | None, float | None]:
    sched = config.get("scheduler") or {}
    margin = sched.get("slo_margin")
    targets = [r.slo_tbt_s for r in iterations if r.slo_tbt_s is not None]
    if targets:
        return max(set(targets), key=targets.count), margin
    ms = sched.get("slo_tbt_ms") or 0
    return (ms / 1e3 if ms > 0 else None), margin


def judge_slo(requests: list[RequestMetrics], iterations: list[IterationRecord], config: dict[str, Any],
              tbt_target_s: float | None = None) -> SloJudgement | None:
    """The judgement of a run against its TBT target (that of its records, or `tbt_target_s` to
    judge a fixed-budget run against a target it was not told); None without one."""
    target, margin = _target(config, iterations)
    target = tbt_target_s or target
    if not target:
        return None
    decode_iters = [r for r in iterations if r.num_decode_tokens]
    times = [r.duration_s for r in decode_iters]
    misses = []
    for r in decode_iters:
        if r.duration_s <= target or r.prefill_budget is None:
            continue
        misses.append(Miss(r.iteration_id, r.worker, "infeasible" if r.slo_feasible is False else "under-predicted",
                           r.duration_s, r.predicted_ns / 1e9 if r.predicted_ns is not None else None,
                           r.num_decode_tokens, r.num_prefill_tokens, r.prefill_budget))
    adaptive = [r for r in iterations if r.predicted_ns is not None and r.end_ns > r.start_ns]
    errors = [abs(r.predicted_ns / 1e9 - r.duration_s) / r.duration_s for r in adaptive]  # type: ignore[operator]
    budgets = [r.prefill_budget for r in decode_iters if r.prefill_budget is not None]
    min_chunk = (config.get("scheduler") or {}).get("slo_min_chunk")
    pending = [r for r in decode_iters if r.prefill_budget is not None and r.budget_reason != "no-prefill"]
    gaps = [g for m in requests for g in m.itl_s]
    j = SloJudgement(
        target_s=target, margin=margin, num_decode_iterations=len(decode_iters),
        num_held=sum(1 for t in times if t <= target),
        decode_iteration_p50_s=percentile(times, 50), decode_iteration_p99_s=percentile(times, 99),
        itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
        itl_attainment=sum(1 for g in gaps if g <= target) / len(gaps) if gaps else None,
        num_infeasible=sum(1 for r in iterations if r.slo_feasible is False),
        prediction_error_p50=median(errors), prediction_error_p90=percentile(errors, 90),
        budget_p50=median([float(b) for b in budgets]),
        budget_at_min_share=(sum(1 for r in pending if r.prefill_budget == min_chunk) / len(pending)
                             if pending and min_chunk else None),
        misses=misses)
    ttft_ms = (config.get("scheduler") or {}).get("slo_ttft_ms") or 0
    if ttft_ms > 0:
        ttfts = [m.ttft_s for m in requests if m.ttft_s is not None]
        j.ttft_target_s = ttft_ms / 1e3
        j.ttft_attainment = sum(1 for t in ttfts if t <= j.ttft_target_s) / len(ttfts) if ttfts else None
    return j


def slo_section(j: SloJudgement | None, doc: Doc) -> None:
    """The diagnosis' section on the adaptive budget."""
    if j is None:
        return
    doc.add(Heading("The TBT target (adaptive budget)", anchor="slo"))
    doc.add(Para(j.verdict() + ".", "verdict"))
    rows = [["decode iterations within the target", fmt.pct(j.attainment)],
            ["decode iteration p50 / p99", f"{fmt.s(j.decode_iteration_p50_s)} / {fmt.s(j.decode_iteration_p99_s)}"],
            ["ITL p50 / p99 (what the streams saw)", f"{fmt.s(j.itl_p50_s)} / {fmt.s(j.itl_p99_s)}"],
            ["inter-token gaps within the target", fmt.pct(j.itl_attainment)],
            ["iterations marked infeasible", str(j.num_infeasible)],
            ["prediction error p50 / p90 (|predicted - measured| / measured)",
             f"{fmt.pct(j.prediction_error_p50)} / {fmt.pct(j.prediction_error_p90)}"],
            ["prefill budget p50 (decode iterations)", fmt.num(j.budget_p50, 0)],
            ["budget at min_chunk while prefill waited", fmt.pct(j.budget_at_min_share)]]
    if j.ttft_target_s is not None:
        rows.append([f"TTFT within {fmt.s(j.ttft_target_s)}", fmt.pct(j.ttft_attainment)])
    doc.add(Table(["", "value"], rows, caption="Measured times are schedule -> outputs handed over; predictions "
                                               "are the online cost model's before it learned from the iteration."))
    if j.misses:
        worst = sorted(j.misses, key=lambda m: m.measured_s, reverse=True)[:MAX_LISTED_MISSES]
        doc.add(Bullets([f"iteration {m.iteration_id} ({m.worker}): {fmt.s(m.measured_s)} measured, "
                         f"{fmt.s(m.predicted_s)} predicted; {m.num_decodes} decodes + {m.prefill_tokens} prefill "
                         f"tokens (budget {m.prefill_budget}): {m.cause}" for m in worst]))
