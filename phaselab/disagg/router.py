"""The router of disaggregated serving: LLMEngine's surface over prefill and decode worker pools.

    add_request ─▶ pick a prefill worker (core/routing) ─▶ WorkerRequest
    step():  poll every worker (one outstanding Ray call each) ─▶ events
             prefill TokenEvent: stream the first token now; parked? pick a decode worker ─▶ TransferSpec
             decode TransferEvent / AdmittedEvent / TokenEvent: transfer stamps, tokens, finish
             a worker that died (or stayed silent) ─▶ re-route / re-prefill / fail its requests
             ─▶ RequestOutputs of the requests that progressed (as LLMEngine.step returns them)

Per request, in the router:

    prefill ──first token (streamed)──▶ decode ──tokens (streamed)──▶ finished
       ▲  │ prefill worker died               │ decode worker died, KV still leased on the prefill
       │  └─▶ re-prefill elsewhere            │   worker ─▶ re-route to another decode worker
       │                                      │ KV lost (decode died after the transfer, lease
       └──────── re-prefill (prompt + tokens ◀┘   expired, prefill worker gone before the fetch)
                 streamed so far; the next token is sampled there)

A request fails with a clear error only when no worker of the role it needs is left, when
`recover_lost_kv` is off and its KV was lost, when the decode pool stays full past
`decode_admission_timeout_s`, or when it outlives `request_timeout_s`. Every wait is bounded.

The router keeps the one phase record per request (core/timing.RequestMetrics): its own arrival
and tokenization, the prefill worker's queue/prefill/first token, the decode worker's transfer,
admission and tokens, all converted to the router's clock with the offset measured at the
handshake (0 on one host: monotonic_ns is system-wide there), and the send times it stamps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from typing import Any

from phaselab.engine_args import EngineArgs
from phaselab.core.outputs import EngineStats
from phaselab.core.prompt import validate_prompt
from phaselab.core.recorder import PhaseRecorder
from phaselab.core.routing import RoutingPolicy, make_routing_policy
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import IterationRecord, RequestMetrics
from phaselab.disagg.disagg_config import DisaggConfig
from phaselab.disagg.disagg_metrics import MergedEngineMetrics, RouterMetrics
from phaselab.disagg.messages import AdmittedEvent, FailureEvent, TokenEvent, TransferEvent, WorkerReport
from phaselab.disagg.placement import Placement, RoutedRequest
from phaselab.disagg.pool import describe_workers, ensure_ray, handshake_workers, start_workers
from phaselab.disagg.process import WorkerHandle, boot_id, checkpoint_to_wire
from phaselab.disagg.record import merge_transfer, merge_worker_tokens, observe_router_record, shift_iteration
from phaselab.engine.request_output import CompletionOutput, RequestOutput
from phaselab.errors import InvalidRequestError
from phaselab.obs.prometheus import EngineMetrics
from phaselab.obs.rundir import write_run_dir

logger = logging.getLogger("phaselab.disagg")


class DisaggEngine:
    """Disaggregated prefill/decode serving with LLMEngine's methods (add_request, step,
    abort_request, has_unfinished_requests, tokenizer, write_record), so `LLM` and the CLI drive
    it unchanged. `prefill_overrides` / `decode_overrides` change EngineArgs fields per pool
    (e.g. policy, budget, KV memory: each pool is tuned on its own). `checkpoint`: an already
    loaded LoadedCheckpoint, shared with the workers through the object store (loaded once)."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        config: DisaggConfig | None = None,
        *,
        prefill_policy: RoutingPolicy | None = None,
        decode_policy: RoutingPolicy | None = None,
        prefill_overrides: dict[str, Any] | None = None,
        decode_overrides: dict[str, Any] | None = None,
        checkpoint: Any = None,
        keep_records: bool = True,
    ) -> None:
        import ray

        self.args = args = args or EngineArgs(mode="disagg")
        self.config = config = config or DisaggConfig()
        self.prefill_policy = prefill_policy or make_routing_policy(args.routing_policy)
        self.decode_policy = decode_policy or make_routing_policy(args.routing_policy)
        self.worker, self.role = "router", "router"
        self.stamp_sent = True
        self.router_metrics = RouterMetrics()
        # request metrics of the one record per request; render() merges every worker's registry too
        self.metrics = MergedEngineMetrics(EngineMetrics(labels={"worker": "router", "role": "router"}),
                                           self.router_metrics)
        # the one record per request, assembled here from the workers' (record.py); without
        # keep_records (a server without --record) closed records and iterations are only observed
        self.recorder = PhaseRecorder("router", "router", keep=keep_records,
                                      on_finished=lambda m: observe_router_record(self.metrics, self.router_metrics, m))
        self._requests: dict[str, RoutedRequest] = {}
        self._next_id = 0
        self._boot_id = boot_id()

        from phaselab.modelinfo.bundled import default_model_path
        from phaselab.modelinfo.tokenizer import load_tokenizer

        if checkpoint is not None:
            self.tokenizer = checkpoint.tokenizer
        else:
            self.tokenizer = load_tokenizer(args.tokenizer or args.model or default_model_path())
        self._owns_ray = not ray.is_initialized()  # started here: shut down with the engine
        ensure_ray(args.ray_address, config)
        ckpt_ref = None
        if checkpoint is not None:
            ckpt_ref = ray.put(checkpoint_to_wire(checkpoint))
        self.workers = start_workers(args, config, ckpt_ref, prefill_overrides, decode_overrides)
        try:
            handshake_workers(self.workers, config, self._boot_id)
        except BaseException:
            self.shutdown()
            raise
        self.placement = Placement(self.workers)  # which worker holds each request, their loads
        infos = [w.info for w in self.workers.values() if w.info is not None]
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = infos[0].vocab_size
        self.layout = infos[0].layout
        self.model_config = infos[0].model_config
        model = infos[0].run_config.get("model", {})
        self.checkpoint_path, self.checkpoint_format = model.get("path"), model.get("format")
        self.started_ns = time.monotonic_ns()

    # -- LLMEngine's surface ---------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        rid = str(self._next_id)
        self._next_id += 1
        return rid

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrived_ns: int | None = None, *,
                    tokenized_ns: int | None = None, queued_ns: int | None = None,
                    prompt_text: str | None = None) -> str:
        """As LLMEngine.add_request. `queued_ns` is not the router's to stamp: the record's queue
        is the prefill worker's (from when the request reached it), whatever the caller passes."""
        del queued_ns
        arrived_ns = arrived_ns or time.monotonic_ns()
        params = params or SamplingParams()
        rid = request_id or self.new_request_id()
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        ids = self.tokenize(prompt)
        tokenized_ns = tokenized_ns or time.monotonic_ns()
        self.validate_prompt(ids)
        m = self.recorder.open(rid, len(ids), arrived_ns=arrived_ns, tokenized_ns=tokenized_ns, queued_ns=None,
                               worker="")
        timeout = self.config.request_timeout_s
        r = RoutedRequest(rid, ids, params, prompt if isinstance(prompt, str) else prompt_text, m,
                          None if timeout is None else arrived_ns + int(timeout * 1e9),
                          logprobs=[] if params.logprobs is not None else None)
        self._requests[rid] = r
        self._to_prefill(r, cause=None)
        return rid

    def tracked(self, request_id: str) -> RoutedRequest | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outs = []
        for rid in request_ids:
            r = self._requests.get(rid)
            if r is None or r.phase == "finished":
                continue
            self.placement.release(r)
            r.finish_reason = "abort"
            r.phase = "finished"
            out = self._output(r)
            self._close(r, time.monotonic_ns())
            outs.append(out)
        return outs

    def step(self) -> list[RequestOutput]:
        """Wait up to poll_interval_s for worker reports, apply them, and return the outputs of
        the requests that progressed (cumulative token ids and text, as LLMEngine.step)."""
        self._pump(self.config.poll_interval_s)
        self._check_deadlines()
        outputs, finished = [], []
        for r in self._requests.values():
            if r.dirty:
                r.dirty = False
                outputs.append(self._output(r))
                if r.phase == "finished":
                    finished.append(r)
        sent_ns = time.monotonic_ns()
        if self.stamp_sent:
            for out in outputs:
                self.recorder.stamp_sent(out.metrics, sent_ns)
        for r in finished:
            self._close(r, sent_ns if self.stamp_sent else None)
        self.refresh_gauges()
        return outputs

    def mark_delivered(self, request_id: str, sent_ns: int) -> None:
        self.recorder.mark_delivered(request_id, sent_ns)

    def stats(self) -> EngineStats:
        """Queues over the router's requests (waiting: not decoding yet, i.e. queued, prefilling or
        waiting for the KV transfer), KV usage over every live worker (from their last reports)."""
        reqs = self._requests.values()
        stats = [w.stats for w in self.workers.values() if w.alive and w.stats]
        total = sum(s.num_blocks_total for s in stats)
        used = sum(s.num_blocks_used for s in stats)
        return EngineStats(sum(1 for r in reqs if r.phase == "prefill"), sum(1 for r in reqs if r.phase == "decode"),
                           len(self._requests), used / total if total else 0.0, used, self.recorder.stats(),
                           unavailable=self.unavailable_reason())

    def unavailable_reason(self) -> str | None:
        """A role without a live worker (None: new requests can be served); the server answers
        /health 503 and refuses new work with it, before any prefill is spent."""
        for role in ("prefill", "decode"):
            if not any(w.alive for w in self.workers.values() if w.role == role):
                return f"no live {role} worker ({self.placement.deaths(role)})"
        return None

    def heartbeat(self) -> None:
        self._pump(0.0)  # idle: poll the workers anyway, so a death shows before a request needs one
        self.refresh_gauges()

    def refresh_gauges(self) -> None:  # the router's own: its requests by phase, blocks of live workers
        s = self.stats()
        self.metrics.set_gauges(s.num_running, s.num_waiting, s.kv_usage, s.num_blocks_used)

    @property
    def finished_requests(self) -> list[RequestMetrics]:
        return self.recorder.requests

    @property
    def iterations(self) -> list[IterationRecord]:
        return self.recorder.iterations

    @property
    def recording(self) -> bool:
        return self.recorder.enabled

    @recording.setter
    def recording(self, on: bool) -> None:
        self.recorder.enabled = on

    # -- polling -------------------------------------------------------------------------------------------------
    def _pump(self, wait_s: float) -> None:
        import ray

        cfg = self.config
        now = time.monotonic_ns()
        for w in self.workers.values():
            if w.alive and w.poll_ref is None:
                w.poll_ref, w.poll_issued_ns = w.actor.poll.remote(cfg.poll_interval_s), now
        refs = {w.poll_ref: w for w in self.workers.values() if w.alive and w.poll_ref is not None}
        if not refs:
            time.sleep(wait_s)
            return
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=wait_s)
        if ready:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            w = refs[ref]
            w.poll_ref = None
            try:
                report: WorkerReport = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - actor died, or its loop failed: the worker is gone
                self._worker_died(w, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}")
                continue
            self._apply(w, report)
        self.metrics.refresh(self.workers.values())  # worker texts for /metrics, without blocking
        now = time.monotonic_ns()
        for w in self.workers.values():  # a worker that stays silent is as good as dead
            if w.alive and w.poll_ref is not None and now - w.poll_issued_ns > (
                    cfg.poll_interval_s + cfg.worker_timeout_s) * 1e9:
                ray.kill(w.actor)
                self._worker_died(w, f"no answer for {cfg.worker_timeout_s:g} s (worker_timeout_s)")

    def _apply(self, w: WorkerHandle, report: WorkerReport) -> None:
        w.stats = report.stats
        for rec in report.iterations:
            self.recorder.add_iteration(shift_iteration(rec, w.clock_offset_ns))
        for ev in report.events:
            r = self._requests.get(ev.request_id)
            if isinstance(ev, TokenEvent):
                self._on_tokens(w, r, ev)
            elif r is None or not r.is_current(w, ev.attempt):
                continue
            elif isinstance(ev, TransferEvent):
                self._on_transfer(w, r, ev)
            elif isinstance(ev, AdmittedEvent):
                r.metrics.decode_admitted_ns = ev.admitted_ns - w.clock_offset_ns
            elif isinstance(ev, FailureEvent):
                self._on_failure(w, r, ev)

    def _on_tokens(self, w: WorkerHandle, r: RoutedRequest | None, ev: TokenEvent) -> None:
        if r is None or not r.is_current(w, ev.attempt):
            if ev.kv is not None:  # a stale prefill (re-routed meanwhile): free its KV there
                w.actor.release_kv.remote(ev.request_id, "released", ev.kv.attempt)
            return
        if w.role == "prefill":
            self.placement.unload(r, w.name)
        merge_worker_tokens(r.metrics, w.name, w.role, w.clock_offset_ns, ev.record, ev.sampled_ns, ev.iteration_ids)
        r.output_token_ids += ev.new_token_ids
        r.text = ev.text
        if r.logprobs is not None and ev.logprobs:
            r.logprobs += ev.logprobs
        r.dirty = True
        if ev.finish_reason is not None:
            self._finish(r, ev.finish_reason, ev.stop_reason)
        elif ev.kv is not None:
            r.kv, r.sampler_state = ev.kv, ev.sampler_state
            self._to_decode(r)

    def _on_transfer(self, w: WorkerHandle, r: RoutedRequest, ev: TransferEvent) -> None:
        src = r.kv
        export_start_ns = None
        if src is not None and src.export_start_ns is not None:
            export_start_ns = src.export_start_ns - self.workers[src.worker].clock_offset_ns
        merge_transfer(r.metrics, ev, w.clock_offset_ns, export_start_ns)
        r.kv = None  # acknowledged: the prefill worker frees it, the decode worker holds it now

    def _on_failure(self, w: WorkerHandle, r: RoutedRequest, ev: FailureEvent) -> None:
        self.placement.unload(r, w.name)
        if ev.kv_lost:
            r.kv = None
            self._kv_lost(r, f"{ev.message}", cause=ev.kind)
        else:
            self._fail(r, f"request {r.request_id!r} failed on {w.name}: {ev.message}", cause=ev.kind)

    # -- routing (placement.py) ----------------------------------------------------------------------------
    def _to_prefill(self, r: RoutedRequest, cause: str | None) -> None:
        name = self.placement.pick(self.prefill_policy, "prefill", r)
        if name is None:
            why = "" if cause is None else f" (it was being recomputed: {cause})"
            self._fail(r, f"request {r.request_id!r}: no prefill worker is alive{why}; "
                          f"{self.placement.deaths('prefill')}", cause="no_prefill_worker")
            return
        if cause is not None:
            self.router_metrics.reprefills.labels(cause=cause).inc()
            r.num_reprefills += 1
        self.placement.to_prefill(r, name)

    def _to_decode(self, r: RoutedRequest, reroute: bool = False) -> None:
        assert r.kv is not None
        name = self.placement.pick(self.decode_policy, "decode", r)
        if name is None:
            self._fail(r, f"request {r.request_id!r}: no decode worker is alive to continue it after its first "
                          f"token; {self.placement.deaths('decode')}", cause="no_decode_worker")
            return
        if reroute:
            self.router_metrics.reroutes.inc()
            r.num_reroutes += 1
        self.placement.to_decode(r, name)

    def _kv_lost(self, r: RoutedRequest, why: str, cause: str) -> None:
        if self.config.recover_lost_kv:
            logger.warning("request %s: %s; prefilling it again", r.request_id, why)
            self._to_prefill(r, cause=cause)
        else:
            self._fail(r, f"request {r.request_id!r} lost its KV cache ({why}) and recover_lost_kv is off",
                       cause=cause)

    # -- failures --------------------------------------------------------------------------------------------------
    def _worker_died(self, w: WorkerHandle, why: str) -> None:
        if not w.alive:
            return
        w.alive, w.death, w.poll_ref = False, why, None
        self.placement.loads[w.name].alive = False
        try:  # a worker whose loop failed may still be running: make sure it is gone
            import ray

            ray.kill(w.actor)
        except Exception as e:  # noqa: BLE001 - already dead
            logger.debug("kill %s: %r", w.name, e)
        self.router_metrics.worker_failures.labels(worker=w.name, role=w.role).inc()
        logger.error("%s worker %s is gone: %s", w.role, w.name, why)
        for r in list(self._requests.values()):
            if r.phase == "finished":
                continue
            if w.role == "prefill" and r.phase == "prefill" and r.prefill_worker == w.name:
                self.placement.unload(r, w.name)
                self._to_prefill(r, cause="prefill_worker_died")
            elif w.role == "prefill" and r.phase == "decode" and r.kv is not None and r.kv.worker == w.name:
                # its KV was leased there and not yet acknowledged: the decode worker's fetch fails
                # (or already failed) and reports it; tell it now rather than after a timeout
                self.placement.abort_on(r, r.decode_worker)
                self.placement.unload(r, r.decode_worker)
                r.kv = None
                self._kv_lost(r, f"prefill worker {w.name} died before the KV transfer", cause="prefill_worker_died")
            elif w.role == "decode" and r.phase == "decode" and r.decode_worker == w.name:
                self.placement.unload(r, w.name)
                src = self.workers.get(r.kv.worker) if r.kv is not None else None
                if src is not None and src.alive:
                    logger.warning("request %s: decode worker %s died before the transfer completed; %s still "
                                   "holds the KV: re-routing", r.request_id, w.name, src.name)
                    self._to_decode(r, reroute=True)
                else:
                    self._kv_lost(r, f"decode worker {w.name} died ({why}) after the transfer", cause="decode_worker_died")

    def _fail(self, r: RoutedRequest, message: str, cause: str) -> None:
        logger.error("%s", message)
        self.router_metrics.request_failures.labels(cause=cause).inc()
        self.placement.release(r)
        r.finish_reason, r.error, r.phase, r.dirty = "error", message, "finished", True

    def _finish(self, r: RoutedRequest, reason: str, stop_reason: int | str | None) -> None:
        r.finish_reason, r.stop_reason, r.phase = reason, stop_reason, "finished"  # its worker ended it: no abort
        self.placement.release(r)

    def _check_deadlines(self) -> None:
        now = time.monotonic_ns()
        for r in list(self._requests.values()):
            if r.deadline_ns is not None and r.phase != "finished" and now > r.deadline_ns:
                self._fail(r, f"request {r.request_id!r} did not finish within request_timeout_s="
                              f"{self.config.request_timeout_s:g} s (it was in {r.phase})", cause="timeout")

    # -- outputs and records -----------------------------------------------------------------------------------------
    def _output(self, r: RoutedRequest) -> RequestOutput:
        c = CompletionOutput(index=0, text=r.text, token_ids=list(r.output_token_ids), finish_reason=r.finish_reason,
                             stop_reason=r.stop_reason, logprobs=list(r.logprobs) if r.logprobs is not None else None,
                             error=r.error)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             outputs=[c], finished=r.phase == "finished", metrics=r.metrics,
                             num_cached_tokens=r.metrics.num_cached_tokens)

    def _close(self, r: RoutedRequest, finished_ns: int | None) -> None:
        self._requests.pop(r.request_id, None)
        self.recorder.finish(r.request_id, r.finish_reason, len(r.output_token_ids), finished_ns, error=r.error)

    # -- observation -----------------------------------------------------------------------------------------------
    def worker_stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Fresh WorkerStats of every live worker (name -> stats)."""
        import ray

        alive = [w for w in self.workers.values() if w.alive]
        refs = [w.actor.stats.remote() for w in alive]
        out = {}
        for w, ref in zip(alive, refs):
            try:
                out[w.name] = w.stats = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001
                self._worker_died(w, f"{type(e).__name__} while asked for stats")
        return out

    def render_metrics(self, timeout_s: float = 10.0) -> bytes:
        """One Prometheus text: the router's registries and every live worker's (fetched now), merged."""
        return self.metrics.render_now(self.workers.values(), timeout_s)

    def run_config(self) -> dict[str, Any]:
        import phaselab

        return {
            "mode": "disagg",
            "worker": "router",
            "role": "router",
            "engine_args": dataclasses.asdict(self.args),
            "disagg": dataclasses.asdict(self.config),
            "kv_layout": dataclasses.asdict(self.layout),
            "routing": {"prefill": type(self.prefill_policy).__name__, "decode": type(self.decode_policy).__name__},
            "workers": describe_workers(self.workers),
            "versions": {"phaselab": phaselab.__version__, "python": platform.python_version()},
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        }

    def write_record(self, path: str) -> None:
        """The run directory: every finished request's one record, every worker's iterations."""
        self.worker_stats()
        iterations = sorted(self.iterations, key=lambda rec: (rec.worker, rec.start_ns))
        write_run_dir(path, list(self.finished_requests), iterations, self.run_config(), self.render_metrics())

    def busy_fractions(self) -> dict[str, float]:
        """Per worker: time in iterations / time since the worker started (from its last stats)."""
        return {n: w.stats.busy_fraction for n, w in self.workers.items() if w.stats is not None}

    # -- shutdown ------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        import ray

        for w in self.workers.values():
            try:
                ray.kill(w.actor)
            except Exception as e:  # noqa: BLE001 - already gone
                logger.debug("kill %s: %r", w.name, e)
            w.alive = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def kill_worker(self, name: str) -> None:
        """Fault injection (tests): kill a worker's actor; the next step notices."""
        import ray

        ray.kill(self.workers[name].actor)
