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

from phaselab.core.config import SchedulerConfig
from phaselab.core.outputs import SchedulerOutput
from phaselab.core.timing import IterationRecord
from phaselab.errors import PhaselabError
from phaselab.cost.formulas import StoredWeights, plan_counts
from phaselab.obs.rundir import RunData, engine_config, read_run_dir
from phaselab.cost.record_fit import iteration_cycles, run_model
from phaselab.cost.catalog import LinkSpec
from phaselab.cost.host import run_hardware
from phaselab.cost.pricing import IterationCost, RooflineCostModel
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
    cfg = data.config
    disagg = cfg.get("mode") == "disagg"
    workers = {rec.worker for rec in data.iterations}
    if not disagg and len(workers) != 1:
        raise ReplayError(f"replay needs a run of one worker; this one has {sorted(workers) or 'none'}")
    if cfg.get("simulated"):
        raise ReplayError("this run directory is itself simulated; replay a real run")
    if disagg and at != "arrival":
        raise ReplayError("a disaggregated run is simulated at its arrivals (a prediction), not replayed "
                          "iteration by iteration: its workers' plans interleave")
    iters = sorted(data.iterations, key=lambda r: r.start_ns)
    deployment = _disagg_deployment(data) if disagg else _deployment(cfg)
    cycles = iteration_cycles(iters)
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


def _role_config(cfg: dict[str, Any]) -> RoleConfig:
    """The simulator's pool config of one engine's recorded scheduler and cache."""
    sched = SchedulerConfig(**cfg["scheduler"])
    return RoleConfig(tp=1, policy=sched.policy, max_num_batched_tokens=sched.max_num_batched_tokens,
                      max_num_seqs=sched.max_num_seqs, long_prefill_token_threshold=sched.long_prefill_token_threshold,
                      max_num_partial_prefills=sched.max_num_partial_prefills, num_blocks=cfg["cache"]["num_blocks"],
                      # an adaptive run replays with the same policy; its budgets follow the replay's own
                      # online fit (warm-up shapes priced by the replay), so its plans may part from the real ones
                      slo_tbt_ms=sched.slo_tbt_ms, slo_ttft_ms=sched.slo_ttft_ms, slo_margin=sched.slo_margin,
                      slo_min_chunk=sched.slo_min_chunk)


def _deployment(cfg: dict[str, Any], **kw: Any) -> Deployment:
    """One engine as its config.json records it (kw: the Deployment fields of a disaggregated one)."""
    model, dtype_bytes = run_model(cfg)
    cache = cfg["cache"]
    return Deployment(model, run_hardware(cfg), colocated=_role_config(cfg), dtype_bytes=dtype_bytes,
                      stored_weights=StoredWeights.from_linear(cfg.get("linear")),
                      block_size=cache["block_size"], enable_prefix_caching=cache["enable_prefix_caching"],
                      max_model_len=cfg["scheduler"]["max_model_len"], **kw)


def measured_link(data: RunData) -> LinkSpec:
    """A disaggregated run's KV link as its transfers measured it: bandwidth = KV bytes / wire time
    (fetch start -> end, summed over the transfers), latency = the median of what each transfer's
    span from the first token's sampling to the decode worker's admission held beyond its bytes at
    that bandwidth (transport queue, Ray's fetch set-up, the router's hops, admission), so that a
    simulated transfer of the same bytes takes the span the run measured."""
    moved = [m for m in data.requests if m.kv_transfer_bytes and m.kv_transfer_start_ns is not None
             and m.kv_transfer_end_ns is not None and m.kv_transfer_end_ns > m.kv_transfer_start_ns]
    if not moved:
        raise ReplayError("this disaggregated run recorded no completed KV transfer; its link cannot be measured")
    nbytes = sum(m.kv_transfer_bytes for m in moved)
    wire_s = sum(m.kv_transfer_end_ns - m.kv_transfer_start_ns for m in moved) / 1e9
    bw = nbytes / wire_s
    extra = sorted(max(0.0, (m.decode_admitted_ns - m.first_token_sampled_ns) / 1e9 - m.kv_transfer_bytes / bw)
                   for m in moved if m.decode_admitted_ns is not None and m.first_token_sampled_ns is not None)
    latency = extra[len(extra) // 2] if extra else 0.0
    return LinkSpec("measured", bw, latency, per_gpu=False,
                    description=f"the run's KV link: {bw / 1e6:.2f} MB/s over {len(moved)} transfers, "
                                f"{latency * 1e3:.0f} ms besides the wire per transfer",
                    sources={"bandwidth": "KV bytes / wire time of the run's transfers",
                             "latency_s": "median transfer span (first token sampled -> decode admitted) beyond "
                                          "the bytes at that bandwidth"})


def _disagg_deployment(data: RunData) -> Deployment:
    """A disaggregated run as the simulator's disagg deployment: its pools' recorded schedulers, the
    measured link (measured_link), the prefill worker streaming the first token (phaselab's router);
    `colocated` is the one engine the run's engine args make (a prediction's `--mode colocated`)."""
    cfg = data.config
    roles = [w.get("role") for w in (cfg.get("workers") or {}).values()]
    p_cfg, d_cfg = engine_config(cfg, "prefill"), engine_config(cfg, "decode")
    return _deployment(p_cfg, mode="disagg", num_prefill=max(1, roles.count("prefill")),
                       num_decode=max(1, roles.count("decode")), prefill=_role_config(p_cfg),
                       decode=_role_config(d_cfg), transfer_link=measured_link(data), first_token_from="prefill",
                       routing_policy=(cfg.get("engine_args") or {}).get("routing_policy") or "least-outstanding")


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
