"""`phaselab diagnose RUN_DIR`: which phase is slow, why, and what would fix it.

Works through the symptom table (docs/design.md, "Two phases, two remedies"), row by row, on a run directory
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
(`analysis/accounting.py`): queue, prefill, transfer, stall, kv-capacity, decode-kv, decode-step,
overhead. A cause's score is its avoidable time: the part of its seconds over what the same work
costs without it, from a stated baseline (accounting.BASELINES: a stall over the stream's own pace,
a decode step over the run's normal pace at that batch, ...), so time spent decoding at the
engine's normal pace ranks no cause, however slow the machine. The raw shares of the summed E2E are
kept beside it. Each finding carries its avoidable time and baseline, its symptom (key) figure, the
evidence, the change it suggests and the number that would show the change worked.

    measures.py   the analyses of each symptom row and the run summary (numbers)
    findings.py   KeyFigure, Finding, one finding per cause, the ranking
    diagnose.py   Diagnosis (the measures and the ranked findings of one run), diagnose(), writing
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from phaselab.analysis.accounting import RunAccount, account_run
from phaselab.analysis.doc import Doc, render_html, render_markdown, render_text
from phaselab.analysis.findings import Finding, KeyFigure, rank_findings
from phaselab.analysis.machine import Ceilings, at_least_achieved, load_ceilings, simulated_ceilings
from phaselab.analysis.measures import (
    DecodeAnalysis,
    DisaggAnalysis,
    PrefillAnalysis,
    QueueAnalysis,
    RunSummary,
    StallAnalysis,
    TtftBreakdown,
    decode_analysis,
    disagg_analysis,
    prefill_analysis,
    queue_analysis,
    stall_analysis,
    summarize,
    ttft_breakdown,
)
from phaselab.analysis.slo_judgement import SloJudgement, judge_slo
from phaselab.obs.rundir import RunData, read_run_dir


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
    slo: SloJudgement | None = None  # the adaptive budget's TBT target (analysis/slo_judgement.py)

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def healthy(self) -> bool:
        """No cause has avoidable time above HEALTHY_SHARE of the users' time."""
        from phaselab.analysis.findings import HEALTHY_SHARE

        return all(f.avoidable_share <= HEALTHY_SHARE for f in self.findings)

    def finding(self, cause: str) -> Finding | None:
        return next((f for f in self.findings if f.cause == cause), None)

    def to_doc(self) -> Doc:
        from phaselab.analysis.diagnose_doc import diagnosis_doc

        return diagnosis_doc(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "source": self.source,
            "healthy": self.healthy,
            "ranking": [{"rank": i + 1, "cause": f.cause, "title": f.title, "avoidable_s": f.avoidable_s,
                         "avoidable_share": f.avoidable_share, "baseline": f.baseline, "symptom": asdict(f.key),
                         "share": f.share, "seconds": f.seconds, "key_figure": asdict(f.key), "verdict": f.verdict, "evidence": f.evidence,
                         "change": f.change, "check": f.check,
                         "prediction": f.prediction.to_json() if f.prediction else None}
                        for i, f in enumerate(self.findings)],
            "time_shares": self.account.shares, "time_seconds": self.account.totals,
            "avoidable_seconds": self.account.avoidable,
            "decode_split": {w: {"method": a.method, "separable": a.separable, "reason": a.reason,
                                 "shares": a.shares} for w, a in self.account.attribution.items()},
            "summary": asdict(self.summary),
            "ttft": None if self.ttft is None else {
                "total_s": self.ttft.total_s, "ttft_total_s": self.ttft.ttft_total_s,
                "shares": {k: self.ttft.share(k) for k in self.ttft.components},
                "at": {str(p): {"request_id": rid, "ttft_s": t, "parts_s": parts,
                                "shares": self.ttft.shares_at(p)} for p, (rid, t, parts) in self.ttft.at.items()}},
            "ceilings": asdict(self.ceilings), "notes": self.notes, "external": self.external,
            "slo": self.slo.to_json() if self.slo is not None else None,
        }


def diagnose(run: RunData | str | PathLike[str], ceilings: Ceilings | None = None,
             roofline: str | None = None, predict: bool = True) -> Diagnosis:
    """Diagnose a run directory (path) or an already read RunData. `predict`: simulate each
    suggested change on the run (a real one-engine run directory; analysis/advice.py)."""
    path = None
    if not isinstance(run, RunData):
        path = str(run)
        run = read_run_dir(run)
    if run.config.get("source") == "client":
        from phaselab.analysis.external import diagnose_client_run

        return diagnose_client_run(run, path, ceilings or load_ceilings(roofline))
    # a real run: its own host's ceilings (recorded or cached for its CPU) unless a roofline is given
    ceilings = ceilings or simulated_ceilings(run.config) or at_least_achieved(
        load_ceilings(roofline, config=run.config), run.iterations)
    account = account_run(run.requests, run.iterations, run.config,
                          ceilings.bandwidth_bytes_per_s if ceilings.measured else None)
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
    diag.slo = judge_slo(run.requests, run.iterations, run.config)
    if predict:
        from phaselab.analysis.advice import attach

        diag.notes += attach(diag, diag.findings, run, path)
    return diag


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
