"""One benchmark run, start to finish:

    build the workload (tokenizer, exact-length prompts)  ─▶  scrape /metrics (before)
      ─▶ warm-up requests (not measured)  ─▶  t0 ─ measured requests ─ all done  ─▶  scrape (after)
      ─▶ derive per-request metrics  ─▶  summarize  ─▶  table, JSON, JSONL, run directory

Everything that needs the network is async on one event loop; everything else (prompt building,
metric derivation, file writing) runs before or after the measured window.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

from phaselab.bench.sender import drive
from phaselab.bench.client import ClientConfig, RequestRecord, RequestSpec, StreamingClient, fetch_metrics_text
from phaselab.bench.client_metrics import DEFAULT_PERCENTILES, interference_report, summarize
from phaselab.bench.client_metrics import derive as derive_metrics
from phaselab.bench.bench_report import Progress
from phaselab.workload.arrivals import ArrivalPlan, arrival_offsets, workload_seeds


@dataclass
class RunOutcome:
    """Raw records and derived results of a run; `result` is the summary dict (result.json)."""

    records: list[RequestRecord]  # warm-ups first, then measured, in request order
    warmup_records: list[RequestRecord]
    result: dict[str, Any]
    results: list[Any]  # RequestResult per measured record
    warmup_results: list[Any]
    metrics_before: str | None = None
    metrics_after: str | None = None
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunSettings:
    plan: ArrivalPlan
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput: dict[str, float] | None = None
    stall_factor: float = 3.0
    scrape_metrics: bool = False
    progress: bool = True


async def run_specs(
    client_cfg: ClientConfig,
    specs: list[RequestSpec],
    warmups: list[RequestSpec],
    settings: RunSettings,
) -> RunOutcome:
    """Send warm-ups, then the measured requests, and derive every metric."""
    plan = settings.plan
    notes: list[str] = []
    metrics_before = metrics_after = None
    progress = Progress(enabled=settings.progress)
    interrupted = False
    started: list[RequestRecord] = []
    warm_records: list[RequestRecord] = []
    async with StreamingClient(client_cfg) as client:
        if warmups:
            width = plan.concurrency or plan.max_concurrency or len(warmups)
            progress.start(len(warmups), "warm-up")
            try:
                warm_records = await drive(warmups, client.send, ArrivalPlan(concurrency=min(width, len(warmups))),
                                           on_done=progress.advance)
            finally:
                progress.stop()
        if settings.scrape_metrics:  # after the warm-ups: the difference covers the measured run only
            try:
                metrics_before = await fetch_metrics_text(client_cfg.base_url, client_cfg.api_key)
            except Exception as e:  # a server without /metrics still gets benchmarked
                notes.append(f"--scrape-metrics: GET /metrics failed before the run ({type(e).__name__}: {e})")
        offsets = None
        if plan.mode == "open":
            rng = workload_seeds(settings.seed)[1]
            offsets = arrival_offsets(len(specs), plan.request_rate, plan.burstiness, rng)
        progress.start(len(specs), "benchmark")
        t0 = time.monotonic_ns()
        try:
            records = await drive(specs, client.send, plan, offsets=offsets, on_done=progress.advance,
                                  started=started)
        except asyncio.CancelledError:
            interrupted, records = True, started
            notes.append("interrupted: the requests still streaming are counted as incomplete")
        finally:
            progress.stop()
        t_end = time.monotonic_ns()
    if settings.scrape_metrics and not interrupted:
        try:
            metrics_after = await fetch_metrics_text(client_cfg.base_url, client_cfg.api_key)
        except Exception as e:
            notes.append(f"--scrape-metrics: GET /metrics failed after the run ({type(e).__name__}: {e})")
    results = [derive_metrics(r, t0, settings.stall_factor) for r in records]
    warm_results = [derive_metrics(r, t0, settings.stall_factor) for r in warm_records]
    result = summarize(results, (t_end - t0) / 1e9, settings.percentiles, settings.goodput, settings.stall_factor)
    result["num_warmups"] = len(warm_records)
    result["arrivals"] = plan.describe()
    if any(r.group == "long" for r in results) and any(r.group == "stream" for r in results):
        result["interference"] = interference_report(results, settings.stall_factor)
    if metrics_before is not None and metrics_after is not None:
        from phaselab.bench.bench_report import metrics_diff

        result["server_metrics_diff"] = metrics_diff(metrics_before, metrics_after)
    result["notes"] = notes
    return RunOutcome(
        records=warm_records + records, warmup_records=warm_records, result=result, results=results,
        warmup_results=warm_results, metrics_before=metrics_before, metrics_after=metrics_after,
        interrupted=interrupted, notes=notes,
    )


def plan_from(concurrency: int | None, request_rate: float, burstiness: float, max_concurrency: int | None,
              self_timed: bool, time_scale: float = 1.0) -> ArrivalPlan:
    if concurrency is not None and concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if concurrency is not None and (not math.isinf(request_rate) or self_timed):
        raise ValueError("--concurrency (closed loop) excludes --request-rate and self-timed workloads "
                         "(trace, interference); use --max-concurrency to cap those")
    return ArrivalPlan(concurrency=concurrency, request_rate=request_rate, burstiness=burstiness,
                       max_concurrency=max_concurrency, self_timed=self_timed, time_scale=time_scale)
