"""The discrete-event simulation: core's own Scheduler per worker, a cost model per iteration.

    arrival ──router (core.routing)──▶ worker.inbox
    STEP_START (worker idle, work waiting):
        inbox ─▶ scheduler.add_request;  staged KV ─▶ scheduler.add_prefilled_request (decode side)
        plan = scheduler.schedule()                     # the engine's scheduler, unchanged
        result = executor.execute(plan)                 # CostModelExecutor: tokens + predicted duration
        STEP_END at now + duration
    STEP_END:
        deltas = scheduler.update(plan, result)         # the engine's update, unchanged
        phase stamps and IterationRecord: the engine's own PhaseRecorder (core/recorder.py)
        disagg prefill: a parked request ─▶ KV flow on the network ─▶ decode worker's staged queue
        next STEP_START at once if work remains, else idle until something arrives

Every worker runs the same schedule -> execute -> update cycle as `LLMEngine.step()`, on a virtual
clock (phaselab/sim/events.py) instead of `time.monotonic_ns()`. What a request sees is stamped with
the same rules as the engine (docs/metrics.md): a chunk spans its whole iteration, a token is
sampled at the iteration's end and sent `delivery_s` later (0: the offline engine's "handed to
the caller"). Disaggregated requests follow phaselab's router: the prefill worker parks the
request with its blocks, the KV moves as a flow (phaselab/sim/transfer.py), the prefill worker
frees its blocks when the last byte arrived, and the decode worker admits the request once it has
room (`add_prefilled_request`; the wait is the decode admission wait).

    after-prefill:   flow of the request's whole KV (block granularity) starts when the token is sampled
    layer-by-layer:  one flow per prefill chunk, started with the chunk's iteration and capped at the
                     rate the iteration produces K/V (bytes / iteration time); uncapped once it ends
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import phaselab
from phaselab.core.kv_cache_manager import cdiv
from phaselab.core.outputs import SchedulerOutput, StepResult
from phaselab.core.prompt import prompt_too_long
from phaselab.core.recorder import PhaseRecorder
from phaselab.core.request import Request, RequestStatus
from phaselab.core.routing import WorkerLoad, make_routing_policy
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.scheduler import Scheduler
from phaselab.core.timing import IterationRecord, RequestMetrics
from phaselab.errors import InvalidRequestError
from phaselab.obs.rundir import write_run_dir
from phaselab.cost.pricing import IterationCost, RooflineCostModel
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.noise import IterationNoise
from phaselab.sim.events import ARRIVAL, STEP_END, STEP_START, EventQueue
from phaselab.sim.sim_worker import NS, CostModel, CostModelExecutor, SimWorker
from phaselab.sim.transfer import Flow, Network
from phaselab.sim.workload import EOS_TOKEN, SimRequest
from phaselab.workload.arrivals import ArrivalPlan
from phaselab.workload.driver import ended_set

# The virtual clock starts here, not at 0, so no timestamp is ever falsy.
EPOCH_NS = NS
EOS_IDS = frozenset({EOS_TOKEN})


@dataclass
class _Track:
    """Simulator-side state of one request (the scheduler's Request holds its counters)."""

    spec: SimRequest
    metrics: RequestMetrics
    request: Request
    worker: SimWorker
    decode_worker: SimWorker | None = None
    prefill_done: bool = False  # disagg: first token sampled on the prefill worker
    flows_pending: int = 0  # disagg: KV flows not yet arrived
    kv_tokens_sent: int = 0  # layer-by-layer: prompt tokens whose K/V have a flow
    first_sent: bool = False


@dataclass
class SimResult:
    requests: list[RequestMetrics]
    iterations: list[IterationRecord]
    config: dict[str, Any]
    process_names: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    num_events: int = 0
    sim_duration_s: float = 0.0
    worker_stats: list[dict[str, Any]] = field(default_factory=list)

    def write(self, path: str) -> None:
        """The same run directory as a real run (docs/run-directory.md), marked simulated."""
        write_run_dir(path, self.requests, self.iterations, self.config, process_names=self.process_names)


CostModelFactory = Callable[[str, str, RoleConfig], CostModel]


class Simulator:
    def __init__(self, deployment: Deployment, requests: Sequence[SimRequest], arrivals: ArrivalPlan | None = None,
                 cost_model_factory: CostModelFactory | None = None, record_iterations: bool = True,
                 workload_info: dict[str, Any] | None = None, check_invariants: bool = False,
                 noise: IterationNoise | None = None) -> None:
        self.d = deployment
        self.noise = noise  # a noisy machine's iteration times (sim/noise.py); None: the cost model's own
        self.check_invariants = check_invariants  # tests: the scheduler's invariants after every step
        self.specs = list(requests)
        # the open-loop plans' triggered requests (SimRequest.after_finished): request id -> the requests
        # waiting for its end, and each waiting request -> the ends it still waits for
        self._dependents: dict[str, list[SimRequest]] = {}
        self._waiting_on: dict[str, set[str]] = {}
        ids = {s.request_id for s in self.specs}
        for s in self.specs:
            parents = {r for r in ended_set(s.after_finished) if r in ids}
            if parents:
                self._waiting_on[s.request_id] = parents
                for r in parents:
                    self._dependents.setdefault(r, []).append(s)
        self.arrivals = arrivals or ArrivalPlan(self_timed=True)
        self.record_iterations = record_iterations
        self.workload_info = workload_info or {}
        self.events = EventQueue(EPOCH_NS)
        self.network = Network(self.events)
        self.stop_at: dict[str, int] = {s.request_id: s.output_len for s in self.specs if s.output_len is not None}
        self.max_model_len = deployment.resolved_max_model_len()
        self.transfer_link = deployment.transfer_link_spec()
        make_cost = cost_model_factory or self._default_cost_model
        self.workers: dict[str, list[SimWorker]] = {}
        for role, count, rc in deployment.roles():
            pool = []
            for i in range(count):
                name = f"{role}-{i}" if deployment.mode == "disagg" else f"replica-{i}"
                sched = Scheduler(deployment.scheduler_config(rc), deployment.cache_config(rc))
                executor = CostModelExecutor(make_cost(name, role, rc), self.stop_at, noise,
                                             lambda: self.events.now - EPOCH_NS, name)
                w = SimWorker(name, role, rc, sched, executor)
                pool.append(w)
                if deployment.mode == "disagg":
                    ports = rc.tp if self.transfer_link.per_gpu else 1
                    self.network.add_port("tx:" + name, self.transfer_link.bandwidth * ports)
                    self.network.add_port("rx:" + name, self.transfer_link.bandwidth * ports)
            self.workers[role] = pool
        self.by_name = {w.name: w for pool in self.workers.values() for w in pool}
        self.loads = {role: [WorkerLoad(w.name, role) for w in pool] for role, pool in self.workers.items()}
        self.policy = {role: make_routing_policy(deployment.routing_policy) for role in self.workers}
        self.kv_per_token = deployment.model.kv_bytes_per_token(deployment.dtype_bytes)
        self.tracks: dict[str, _Track] = {}
        # one recorder for every simulated worker (each record names its worker): the same stamps
        # as the engine's; every record is kept (the result is a run directory)
        self.recorder = PhaseRecorder("sim", "colocated", keep=True)
        self._params_cache: dict[int, SamplingParams] = {}
        self._next_closed = 0
        self.delivery_ns = round(deployment.delivery_s * NS)

    def _default_cost_model(self, name: str, role: str, rc: RoleConfig) -> CostModel:
        d = self.d
        return RooflineCostModel(d.model, d.hardware, d.cost_params, rc.tp, d.dtype_bytes,
                                 d.tp_link_spec() if rc.tp > 1 else None, stored=d.stored_weights)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        if self.arrivals.concurrency is not None:
            for _ in range(min(self.arrivals.concurrency, len(self.specs))):
                self._release_next_closed(EPOCH_NS)
        else:
            for s in sorted(self.specs, key=lambda s: s.offset_ns):  # stable: equal times keep workload order
                if s.request_id not in self._waiting_on:
                    self.events.push(EPOCH_NS + s.offset_ns, ARRIVAL, self._arrive, s)
        gc_enabled = gc.isenabled()
        gc.disable()  # millions of short-lived plan objects, no cycles worth collecting: ~10% faster
        try:
            self.events.run()
        finally:
            if gc_enabled:
                gc.enable()
        wall = time.perf_counter() - t0
        assert not self.tracks, f"{len(self.tracks)} requests never finished (e.g. {next(iter(self.tracks))})"
        finished = self.recorder.requests
        end = max([m.finished_ns or 0 for m in finished] + [EPOCH_NS])
        return SimResult(finished, self.recorder.iterations, self._config(), self._process_names(), wall,
                         self.events.num_events, (end - EPOCH_NS) / NS, self._worker_stats(end))

    def _release_next_closed(self, now: int) -> None:
        if self._next_closed < len(self.specs):
            s = self.specs[self._next_closed]
            self._next_closed += 1
            self.events.push(now, ARRIVAL, self._arrive, s)

    # -- arrivals and routing ----------------------------------------------------------------------------
    def _params(self, max_tokens: int) -> SamplingParams:
        p = self._params_cache.get(max_tokens)
        if p is None:
            p = self._params_cache[max_tokens] = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return p

    def _pick(self, role: str, num_tokens: int) -> SimWorker:
        loads = self.loads[role]
        name = self.policy[role].pick(loads, num_tokens)
        assert name is not None
        return self.by_name[name]

    def _load(self, role: str, worker: SimWorker) -> WorkerLoad:
        return self.loads[role][self.workers[role].index(worker)]

    def _arrive(self, spec: SimRequest) -> None:
        now = self.events.now
        rid = spec.request_id
        disagg = self.d.mode == "disagg"
        role = "prefill" if disagg else "colocated"
        why = prompt_too_long(spec.num_prompt_tokens, self.max_model_len)
        if why is not None:  # the engine's validate_prompt: refused before it is queued
            self.recorder.open(rid, spec.num_prompt_tokens, arrived_ns=now, tokenized_ns=now, queued_ns=now, worker="")
            self.recorder.finish(rid, "error", 0, now, error=why)
            self._on_request_done(now, rid)
            return
        worker = self._pick(role, spec.num_prompt_tokens)
        self._load(role, worker).add(spec.num_prompt_tokens)
        request = Request(rid, spec.token_ids(), self._params(spec.max_tokens), arrival_time=now / NS,
                          eos_token_ids=EOS_IDS, max_model_len=self.max_model_len, prefill_only=disagg)
        assert rid not in self.tracks, f"request id {rid!r} is used twice"
        m = self.recorder.open(rid, spec.num_prompt_tokens, arrived_ns=now, tokenized_ns=now, queued_ns=now,
                               request=request, worker=worker.name)
        self.tracks[rid] = _Track(spec, m, request, worker)
        worker.inbox.append(request)
        self._kick(worker)

    def _kick(self, w: SimWorker) -> None:
        if not w.busy and not w.kicked:
            w.kicked = True
            self.events.push(self.events.now, STEP_START, self._step_start, w)

    # -- one iteration ---------------------------------------------------------------------------------
    def _step_start(self, w: SimWorker) -> None:
        w.kicked = False
        if w.busy:
            return
        now = self.events.now
        sched = w.scheduler
        if w.inbox:
            for request in w.inbox:
                try:
                    sched.add_request(request)
                except InvalidRequestError as e:
                    self._fail(self.tracks[request.request_id], str(e), now)
            w.inbox.clear()
        while w.staged:
            request = w.staged[0]
            try:
                if sched.add_prefilled_request(request) is None:
                    break  # backpressure: no seat or blocks yet; retried at the next boundary
            except InvalidRequestError as e:  # can never fit this worker
                w.staged.popleft()
                self._fail(self.tracks[request.request_id], str(e), now)
                continue
            w.staged.popleft()
            t = self.tracks[request.request_id]
            t.request = request
            self.recorder.admit(t.metrics, request, now)
            if not t.first_sent:
                self._send_first(t, now + self.delivery_ns)
        if not sched.has_schedulable_requests():
            return  # idle until an arrival, a transfer or a release kicks it
        plan = sched.schedule(now / NS)  # the clock of the requests' arrival_time
        if plan.is_empty:
            return  # e.g. a prefill worker whose blocks are all parked: a release will kick it
        result = w.executor.execute(plan)
        cost = w.executor.last_cost
        duration = result.prepare_ns + result.forward_ns + result.sample_ns
        w.busy = True
        if w.role == "prefill" and self.d.transfer_mode == "layer-by-layer":
            self._start_layer_flows(w, plan, duration)
        self.events.push(now + duration, STEP_END, self._step_end, w, plan, result, cost, now)

    def _step_end(self, w: SimWorker, plan: SchedulerOutput, result: StepResult, cost: IterationCost,
                  start: int) -> None:
        end = self.events.now
        sched = w.scheduler
        deltas = sched.update(plan, result)
        predicted = None
        if w.learner is not None:  # learn from the iteration's time, as LLMEngine.step does
            predicted = w.learner.observe(plan, (end - start) / NS)
            sched.set_cost_coefficients(w.learner.planning_coefficients)
        if self.check_invariants:
            sched.check_invariants()
        w.busy = False
        w.busy_ns += end - start
        w.num_iterations += 1
        for flow in w.open_flows:  # the iteration that produced their K/V is over
            self.network.set_cap(flow, None)
        w.open_flows.clear()
        tracks = self.tracks
        firsts = self.recorder.stamp_step(plan, deltas, start, end)
        for rid in plan.preempted_request_ids:
            t = tracks.get(rid)
            if t is not None:
                t.kv_tokens_sent = 0
        sent = end + self.delivery_ns
        for d in deltas:
            t = tracks.get(d.request_id)
            if t is None:
                continue
            if firsts and d.request_id in firsts:
                if w.role != "prefill" or d.finish_reason is not None or self.d.first_token_from == "prefill":
                    self._send_first(t, sent)
                if w.role == "prefill":
                    self._load("prefill", w).remove(t.spec.num_prompt_tokens)
                    t.prefill_done = True
                    if d.finish_reason is None:
                        self._prefill_parked(t, w)
            else:
                self.recorder.stamp_sent(t.metrics, sent)
            if d.finish_reason is not None:
                self._finish(t, d.finish_reason, sent)
        if self.record_iterations:
            self.recorder.iteration(
                plan, start_ns=start, end_ns=end, prepare_ns=result.prepare_ns, forward_ns=result.forward_ns,
                sample_ns=result.sample_ns, num_running=sched.num_running, num_waiting=sched.num_waiting,
                modeled=cost.modeled, worker=w.name, role=w.role, predicted_s=predicted)
        if w.has_work:
            self._kick(w)

    def _send_first(self, t: _Track, sent: int) -> None:
        t.first_sent = True
        self.recorder.stamp_sent(t.metrics, sent)

    # -- finishing ------------------------------------------------------------------------------------------
    def _finish(self, t: _Track, reason: str, now: int) -> None:
        m = t.metrics
        rid = m.request_id
        self.recorder.finish(rid, reason, len(m.token_sampled_ns), now, metrics=m)
        if t.decode_worker is not None:
            self._load("decode", t.decode_worker).remove(t.spec.num_prompt_tokens + 1)
        elif self.d.mode == "colocated":
            self._load("colocated", t.worker).remove(t.spec.num_prompt_tokens)
        if t.flows_pending == 0:
            del self.tracks[rid]
        self._on_request_done(now, rid)

    def _fail(self, t: _Track, message: str, now: int) -> None:
        t.metrics.error = message
        self._finish(t, "error", now)

    def _on_request_done(self, now: int, rid: str) -> None:
        if self.arrivals.concurrency is not None:
            self._release_next_closed(now)
        else:
            for s in self._dependents.pop(rid, ()):
                waiting = self._waiting_on[s.request_id]
                waiting.discard(rid)
                if not waiting:
                    del self._waiting_on[s.request_id]
                    self.events.push(now, ARRIVAL, self._arrive, s)

    # -- disaggregation: the KV transfer ----------------------------------------------------------------------
    def _choose_decode(self, t: _Track) -> SimWorker:
        if t.decode_worker is None:
            w = self._pick("decode", t.spec.num_prompt_tokens + 1)
            self._load("decode", w).add(t.spec.num_prompt_tokens + 1)
            t.decode_worker = w
            t.metrics.decode_worker = w.name
        return t.decode_worker

    def _kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_per_token

    def _start_flow(self, t: _Track, src: SimWorker, num_bytes: int, cap: float | None = None) -> Flow:
        m = t.metrics
        dst = self._choose_decode(t)
        now = self.events.now
        if m.kv_transfer_queued_ns is None:
            m.kv_transfer_queued_ns = m.kv_transfer_start_ns = now
            m.kv_transfer_bytes = 0
        m.kv_transfer_bytes = (m.kv_transfer_bytes or 0) + num_bytes
        t.flows_pending += 1
        return self.network.start("tx:" + src.name, "rx:" + dst.name, num_bytes, self._flow_done,
                                  self.transfer_link.latency_s, cap, tag=(t, src))

    def _prefill_parked(self, t: _Track, w: SimWorker) -> None:
        """The prefill worker sampled the first token and parked the request with its blocks."""
        num_kv = t.request.num_computed_tokens  # prompt (+ earlier outputs): all but the sampled token
        padded = cdiv(num_kv, self.d.block_size) * self.d.block_size  # whole blocks, as the connector sends
        if self.d.transfer_mode == "after-prefill":
            self._start_flow(t, w, self._kv_bytes(padded))
        else:
            rest = padded - t.kv_tokens_sent  # the last block's padding (and anything not yet sent)
            t.kv_tokens_sent = padded
            if rest > 0 or t.flows_pending == 0:
                self._start_flow(t, w, self._kv_bytes(rest))

    def _start_layer_flows(self, w: SimWorker, plan: SchedulerOutput, duration_ns: int) -> None:
        """Layer by layer: each prefill chunk's K/V leave as the iteration computes them."""
        seconds = duration_ns / NS
        for s in plan.scheduled:
            if not s.is_prefill:
                continue
            t = self.tracks.get(s.request_id)
            if t is None:
                continue
            context = s.start_position + len(s.token_ids)
            new_tokens = context - t.kv_tokens_sent  # prefix-cache hits go with the first chunk
            if new_tokens <= 0:
                continue
            t.kv_tokens_sent = context
            num_bytes = self._kv_bytes(new_tokens)
            w.open_flows.append(self._start_flow(t, w, num_bytes, cap=num_bytes / seconds if seconds > 0 else None))

    def _flow_done(self, flow: Flow) -> None:
        t, src = flow.tag  # type: ignore[misc]
        t.flows_pending -= 1
        m = t.metrics
        m.kv_transfer_end_ns = flow.done_ns
        if t.flows_pending > 0 or not t.prefill_done:
            return
        rid = m.request_id
        if m.finish_reason is not None:  # finished with its first token: nothing to decode
            self.tracks.pop(rid, None)
            return
        # the source frees the parked blocks (the ack), the decode side admits when it has room
        src.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
        if src.has_work:
            self._kick(src)
        prefill_req = t.request
        request = Request(rid, prefill_req.prompt_token_ids, prefill_req.sampling_params,
                          arrival_time=prefill_req.arrival_time, eos_token_ids=EOS_IDS,
                          max_model_len=self.max_model_len)
        for token_id in prefill_req.output_token_ids:
            request.append_output_token(token_id)
        dst = t.decode_worker
        assert dst is not None
        dst.staged.append(request)
        self._kick(dst)

    # -- outputs ----------------------------------------------------------------------------------------
    def _process_names(self) -> dict[str, str]:
        names = {}
        for role, _, rc in self.d.roles():
            for w in self.workers[role]:
                names[w.name] = f"{w.name} ({role}, {self.d.hardware.name} x TP{rc.tp}, simulated)"
        return names

    def _worker_stats(self, end: int) -> list[dict[str, Any]]:
        span = max(1, end - EPOCH_NS)
        return [{"worker": w.name, "role": w.role, "tp": w.rc.tp, "num_iterations": w.num_iterations,
                 "busy_s": w.busy_ns / NS, "busy_fraction": w.busy_ns / span,
                 "num_blocks": w.scheduler.cache_config.num_blocks,
                 "num_preemptions": w.scheduler.num_preemptions_total}
                for pool in self.workers.values() for w in pool]

    def _config(self) -> dict[str, Any]:
        d = self.d
        first_role = d.roles()[0][2]
        return {
            "simulated": True,
            "simulator": {"phaselab": phaselab.__version__, "clock": "virtual (ns)", "epoch_ns": EPOCH_NS},
            "model": {"name": d.model.name, "spec": dataclasses.asdict(d.model)},
            "dtype": {1: "int8/fp8", 2: "bfloat16", 4: "float32"}[d.dtype_bytes],
            "hardware": dataclasses.asdict(d.hardware),
            "deployment": d.to_json(),
            "role": "colocated" if d.mode == "colocated" else "disagg",
            "worker": ",".join(self.by_name),
            "scheduler": dataclasses.asdict(d.scheduler_config(first_role)),
            "schedulers": {role: dataclasses.asdict(d.scheduler_config(rc)) for role, _, rc in d.roles()},
            "cache": {**dataclasses.asdict(d.cache_config(first_role)),
                      "kv_bytes_per_token": self.kv_per_token},
            "cost_model": {role: _describe_cost_model(self.workers[role][0].executor.cost_model)
                           for role, _, _ in d.roles()},
            "slo": {w.name: {"tbt_s": w.scheduler.scheduler_config.slo_tbt_ms / 1e3,
                             "cost_model": w.learner.to_json()}
                    for pool in self.workers.values() for w in pool if w.learner is not None} or None,
            "transfer": ({"link": dataclasses.asdict(self.transfer_link), "mode": d.transfer_mode,
                          "first_token_from": d.first_token_from} if d.mode == "disagg" else None),
            "workload": {**self.workload_info, "num_requests": len(self.specs), "arrivals": self.arrivals.describe()},
        }


def _describe_cost_model(cm: Any) -> dict[str, Any]:
    describe = getattr(cm, "describe", None)
    return describe() if callable(describe) else {"kind": type(cm).__name__}


def simulate(deployment: Deployment, requests: Sequence[SimRequest], arrivals: ArrivalPlan | None = None,
             **options: Any) -> SimResult:
    return Simulator(deployment, requests, arrivals, **options).run()

