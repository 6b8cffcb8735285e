"""Replay a real run in the simulator: measured iteration times in, the same plans out.

    real run dir ─▶ SchedulerConfig / CacheConfig (config.json), requests (requests.jsonl),
                    iteration times (iterations.jsonl)
                 ─▶ one simulated worker whose cost model returns each iteration's measured time
                 ─▶ its plans, iteration by iteration, compared with the real ones

Why the plans can be equal: the scheduler is the same class, its inputs are the same (prompt
lengths, output lengths and finish points, KV blocks, budgets) and they reach it at the same
iteration boundaries. The real engine adds a request between two iterations; the replay delivers
it at the start of the first real iteration whose start_ns >= its queued_ns, and its virtual clock
starts each iteration when the real one started: an iteration after which requests remained lasts
until the next one started (its measured time plus the engine's gap between iterations); one
after which the engine was empty lasts its measured time, and the worker then idles until the
next arrival. Token ids are synthetic (unique per request, as in every simulation), so a replay
reproduces the real run's decisions only where its prefix-cache hits came from a request's own
blocks (resumes after preemption); `num_cached_tokens > 0` in the real run is reported.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from phaselab.core.config import CacheConfig, SchedulerConfig
from phaselab.core.outputs import SchedulerOutput
from phaselab.core.timing import IterationRecord
from phaselab.errors import PhaselabError
from phaselab.obs.cost import StoredWeights, plan_counts
from phaselab.obs.rundir import RunData, read_run_dir
from phaselab.sim.calibrate import run_model
from phaselab.sim.host import run_hardware
from phaselab.sim.cost import IterationCost, RooflineCostModel
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.loop import SimResult, Simulator
from phaselab.sim.workload import SimRequest
from phaselab.workload.arrivals import ArrivalPlan
from phaselab.workload.rerun import RecordedRequest, recorded_workload

Plan = list[tuple[str, int, bool]]  # (request, tokens, is_prefill) per scheduled request


class ReplayError(PhaselabError, ValueError):
    """The run directory cannot be replayed (several workers, no iterations, ...)."""


class ReplayCostModel:
    """Returns the k-th recorded duration for the k-th plan (modeled counts from `counter`)."""

    def __init__(self, durations_ns: list[int], counter: RooflineCostModel | None = None) -> None:
        self.durations_ns = durations_ns
        self.counter = counter
        self.num_predicted = 0

    def predict(self, plan: SchedulerOutput) -> IterationCost:
        k = self.num_predicted
        self.num_predicted += 1
        duration = self.durations_ns[k] if k < len(self.durations_ns) else (self.durations_ns or [1])[-1]
        modeled = self.counter.modeled_cost(plan_counts(plan)) if self.counter is not None else None
        cost = IterationCost(duration)
        if modeled is not None:
            cost.modeled = modeled
        return cost

    def describe(self) -> dict[str, Any]:
        return {"kind": "replay", "num_durations": len(self.durations_ns),
                "source": "measured iteration cycles of the replayed run"}


def plans_of(iterations: list[IterationRecord]) -> list[Plan]:
    return [[(c.request_id, c.num_tokens, c.is_prefill) for c in rec.chunks] for rec in iterations]


@dataclass
class ReplayResult:
    real: list[Plan]
    simulated: list[Plan]
    result: SimResult
    notes: list[str] = field(default_factory=list)

    @property
    def first_mismatch(self) -> int | None:
        """Index of the first iteration whose plans differ (or where one run has more), else None."""
        for k, (a, b) in enumerate(zip(self.real, self.simulated)):
            if a != b:
                return k
        return None if len(self.real) == len(self.simulated) else min(len(self.real), len(self.simulated))

    @property
    def identical(self) -> bool:
        return self.first_mismatch is None

    def describe(self) -> str:
        k = self.first_mismatch
        if k is None:
            return f"identical: {len(self.real)} iterations, every plan the same (request, tokens, phase)"
        real = self.real[k] if k < len(self.real) else "(none)"
        sim = self.simulated[k] if k < len(self.simulated) else "(none)"
        return f"plans differ from iteration {k}: real {real} vs simulated {sim}"


def replay_inputs(data: RunData, at: str = "iteration") -> tuple[Deployment, list[SimRequest], list[int], list[str]]:
    """The deployment, requests and iteration cycles that replay `data` (see module docstring).

    at="iteration" delivers each request at the start of the first real iteration after it was
    queued (the replay: the same plans at the same boundaries); at="arrival" at its own arrival
    offset, for simulating the run's workload under another configuration (a prediction), whose
    iterations start elsewhere: a request that arrived during a long step then waits for it in the
    simulation too (queue, as the measured TTFT counts it), and is not delayed to where the recorded
    run's iterations happened to start. At "arrival" the workload is read as `diagnose --verify`
    reruns it (workload/rerun.py): a closed-loop request is released by its predecessor's end, and
    prompts that hit the prefix cache share one prefix group."""
    assert at in ("iteration", "arrival"), at
    workers = {rec.worker for rec in data.iterations}
    if len(workers) != 1:
        raise ReplayError(f"replay needs a run of one worker; this one has {sorted(workers) or 'none'}")
    cfg = data.config
    if cfg.get("simulated"):
        raise ReplayError("this run directory is itself simulated; replay a real run")
    iters = sorted(data.iterations, key=lambda r: r.start_ns)
    sched = SchedulerConfig(**cfg["scheduler"])
    cache = cfg["cache"]
    cache_cfg = CacheConfig(cache["block_size"], cache["num_blocks"], cache["enable_prefix_caching"])
    model, dtype_bytes = run_model(cfg)
    rc = RoleConfig(tp=1, policy=sched.policy, max_num_batched_tokens=sched.max_num_batched_tokens,
                    max_num_seqs=sched.max_num_seqs, long_prefill_token_threshold=sched.long_prefill_token_threshold,
                    max_num_partial_prefills=sched.max_num_partial_prefills, num_blocks=cache_cfg.num_blocks,
                    # an adaptive run replays with the same policy; its budgets follow the replay's own
                    # online fit (warm-up shapes priced by the replay), so its plans may part from the real ones
                    slo_tbt_ms=sched.slo_tbt_ms, slo_ttft_ms=sched.slo_ttft_ms, slo_margin=sched.slo_margin,
                    slo_min_chunk=sched.slo_min_chunk)
    deployment = Deployment(model, run_hardware(cfg), colocated=rc, dtype_bytes=dtype_bytes,
                            stored_weights=StoredWeights.from_linear(cfg.get("linear")),
                            block_size=cache_cfg.block_size, enable_prefix_caching=cache_cfg.enable_prefix_caching,
                            max_model_len=sched.max_model_len)
    cycles = []
    for k, rec in enumerate(iters):
        still_busy = rec.num_running + rec.num_waiting > 0
        if still_busy and k + 1 < len(iters):
            cycles.append(iters[k + 1].start_ns - rec.start_ns)
        else:
            cycles.append(rec.end_ns - rec.start_ns)
    starts = [rec.start_ns for rec in iters]
    t0 = starts[0] if starts else 0
    notes = []
    requests = []
    # queue order: queued_ns (distinct in a real engine), ties by the id's natural order ("r2" < "r10")
    order = sorted(data.requests, key=lambda m: (m.queued_ns or m.arrived_ns, _natural(m.request_id)))
    rerun: dict[str, RecordedRequest] = {}
    if at == "arrival":
        t0 = min([m.arrived_ns for m in order if m.queued_ns is not None] + starts[:1])
        # the workload as a rerun reads it: its shared prefix, and what a closed-loop client released
        recorded, rerun_notes = recorded_workload(order)
        rerun = {r.request_id: r for r in recorded}
        notes += rerun_notes
    for i, m in enumerate(order):
        if m.finish_reason in ("abort", "error") or m.queued_ns is None:
            notes.append(f"request {m.request_id} ({m.finish_reason}) is not replayed")
            continue
        k = bisect.bisect_left(starts, m.queued_ns)
        if k == len(starts):
            notes.append(f"request {m.request_id} was queued after the last iteration; not replayed")
            continue
        r = rerun.get(m.request_id)
        if m.num_cached_tokens > 0 and r is None:
            notes.append(f"request {m.request_id} had {m.num_cached_tokens} prefix-cache hit tokens in the real run; "
                         "synthetic tokens may not reproduce them")
        n_out = m.num_output_tokens
        requests.append(SimRequest(m.request_id, m.num_prompt_tokens, max_tokens=n_out,
                                   output_len=n_out if m.finish_reason == "stop" else None, index=i,
                                   arrival_ns=(starts[k] if at == "iteration" else m.arrived_ns) - t0,
                                   prefix_group=0 if r is not None and r.shared_prefix else None,
                                   prefix_len=r.shared_prefix if r is not None else 0,
                                   after_finished=r.after_finished if r is not None else None))
    return deployment, requests, cycles, notes


def _natural(text: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part]


def replay(path: str | PathLike[str], record_iterations: bool = True) -> ReplayResult:
    data = read_run_dir(path)
    deployment, requests, cycles, notes = replay_inputs(data)
    counter = RooflineCostModel(deployment.model, deployment.hardware, tp=1, dtype_bytes=deployment.dtype_bytes,
                                stored=deployment.stored_weights)
    replayer = ReplayCostModel(cycles, counter)
    sim = Simulator(deployment, requests, ArrivalPlan(self_timed=True), cost_model_factory=lambda *_: replayer,
                    record_iterations=record_iterations, workload_info={"kind": "replay", "run": str(path)})
    result = sim.run()
    real = plans_of(sorted(data.iterations, key=lambda r: r.start_ns))
    return ReplayResult(real, plans_of(result.iterations), result, notes)
