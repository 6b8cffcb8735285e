"""Prefill and decode workers: an LLMEngine with a role, inside a Ray actor.

    RPC threads (a threaded actor)                  loop thread: the only one that touches the engine
    ──────────────────────────────                  ──────────────────────────────────────────────────
    add_request / admit / abort / release_kv ─cmd─▶ apply commands; expire leases (prefill);
    read_kv: copy a parked request's blocks         admit staged KV while blocks allow (decode);
    poll(timeout) ◀── events, iterations, stats ──  step(); outputs -> TokenEvents
                                                    transfer thread (decode): fetch KV FIFO, ack, stage

Prefill worker. Each request is added `prefill_only`: after its prefill samples a token it parks
(Scheduler.parked): never scheduled again, its blocks kept. The worker then opens a *lease* on the
KV and reports the token with a KVSource. The lease ends when the decode side acknowledges the
transfer (`release_kv`), the router releases it (the request finished, failed, was re-routed or
aborted), or it expires after `kv_lease_timeout_s`; then the blocks are freed. A `read_kv` in
progress pins the lease: an ending lease is freed only once its readers are done, so a block is
never reused while its K/V are being copied out.

Decode worker. `admit(TransferSpec)` queues the request for the transfer thread (kv transfer
queued); that thread fetches the KV through the connector (start/end), acknowledges it (the
prefill worker frees its blocks) and stages it in memory (at most `max_staged_kv_bytes`, then
transfers wait, with the KV still leased on the prefill side). Between steps the loop admits
staged requests in order once their blocks can be allocated (`LLMEngine.add_prefilled_request`:
decode admitted); until then the request waits: that is backpressure, recorded as the decode
admission wait, bounded by `decode_admission_timeout_s`.

The bookkeeping of both hand-off sides (leases, the staged KV, cancelled transfers, the newest
routing attempt per request) is kv_handoff.py's; this module drives it, the engine and the events.

Thread settings: the actor is started with OMP_NUM_THREADS / OMP_WAIT_POLICY=PASSIVE in its
runtime_env, so OpenMP reads them before torch loads (docs/design.md, "Threads on a small machine").
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import time
import traceback
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phaselab.engine_args import EngineArgs
from phaselab.core.timing import RequestMetrics
from phaselab.disagg.disagg_config import DisaggConfig
from phaselab.disagg.connector import (
    KVLayout,
    KVLayoutMismatchError,
    KVSource,
    KVUnavailableError,
    handshake,
    make_transport,
    pack,
)
from phaselab.disagg.disagg_metrics import WorkerPrometheus
from phaselab.disagg.kv_handoff import KVInbox, KVLease, KVLeases, StagedKV
from phaselab.disagg.process import boot_id, checkpoint_from_wire, current_actor
from phaselab.disagg.messages import (
    AdmittedEvent,
    FailureEvent,
    WorkerRequest,
    TokenEvent,
    TransferEvent,
    TransferSpec,
    WorkerInfo,
    WorkerReport,
    WorkerStats,
)
from phaselab.errors import InvalidRequestError

ROLES = ("prefill", "decode")


@dataclass
class _Progress:
    """What a worker already reported of one request."""

    num_tokens: int  # output tokens the router knows (given + reported)
    attempt: int = 0
    num_stamped: int = 0  # entries of the engine record's token_sampled_ns reported
    num_logprobs: int = 0


class DisaggWorker:
    """One engine with a role. `DisaggEngine` wraps it with `ray.remote`; tests also drive it in-process."""

    def __init__(self, name: str, role: str, args: EngineArgs, config: DisaggConfig,
                 checkpoint: dict[str, Any] | None = None) -> None:
        assert role in ROLES, role
        from phaselab.engine.engine import LLMEngine

        self.name, self.role, self.config = name, role, config
        ckpt = checkpoint_from_wire(checkpoint) if checkpoint is not None else None
        # the router keeps the one record per request: this engine stamps its part, closes none
        self.engine = LLMEngine(args, checkpoint=ckpt, worker=name, role=role, closes_records=False)
        del ckpt
        self.started_ns = time.monotonic_ns()  # busy fraction counts from here (model loaded)
        self.fault_transfer_delay_s = config.fault_transfer_delay_s
        self.layout = KVLayout.of_engine(self.engine)
        self.transport = make_transport(args.kv_transport)  # prefill: how this worker exports
        self._transports: dict[str, Any] = {}  # decode: fetch with the transport each source names
        self.handle = current_actor() or self  # in-process (tests): peers call this object directly
        self.counters: Tally[str] = Tally()
        self.busy_ns = 0
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._events: list[Any] = []
        self._events_cv = threading.Condition()
        self._fatal: str | None = None
        self._stop = threading.Event()
        self._progress: dict[str, _Progress] = {}
        self._leases = KVLeases()  # prefill: the KV of parked requests, held for pickup
        # decode: transfers in the pipeline, staged KV; both: the newest routing attempt per request
        self._inbox = KVInbox()
        self._transfer_q: queue.Queue[tuple[TransferSpec, int] | None] = queue.Queue()
        self._prom = WorkerPrometheus(name, role)
        self._loop_thread = threading.Thread(target=self._loop, name=f"{name}-loop", daemon=True)
        self._loop_thread.start()
        if role == "decode":
            threading.Thread(target=self._transfer_loop, name=f"{name}-transfer", daemon=True).start()

    # -- RPCs ------------------------------------------------------------------------------------------
    def handshake(self) -> WorkerInfo:
        import ray

        return WorkerInfo(
            name=self.name, role=self.role, layout=self.layout, max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_config.vocab_size, monotonic_ns=time.monotonic_ns(),
            boot_id=boot_id(), hostname=socket.gethostname(),
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local", pid=os.getpid(),
            run_config=self.engine.run_config(), model_config=self.engine.model_config)

    def add_request(self, spec: WorkerRequest) -> None:
        assert self.role == "prefill"
        received_ns = time.monotonic_ns()  # queued here: the wait for the step boundary is queueing
        self._commands.put(lambda: self._add(spec, received_ns))

    def admit(self, spec: TransferSpec) -> None:
        assert self.role == "decode"
        self._inbox.note_attempt(spec.request_id, spec.attempt)
        self._inbox.enter_transfer((spec.request_id, spec.attempt))
        self._transfer_q.put((spec, time.monotonic_ns()))

    def abort(self, request_ids: list[str], attempt: int) -> None:
        """Abort these requests' `attempt` here (an abort of an older attempt than the newest this
        worker has seen is stale and ignored: Ray may deliver calls of a threaded actor out of order)."""
        if self.role == "decode":
            self._inbox.cancel(request_ids, attempt)
        self._commands.put(lambda: self._abort(request_ids, attempt))

    def release_kv(self, request_id: str, reason: str = "released", attempt: int | None = None) -> None:
        self._commands.put(lambda: self._end_lease(request_id, reason, attempt))

    def read_kv(self, request_id: str, attempt: int | None = None) -> Any:
        """The KV of a parked request as bytes (ray-actor transport). Pins the lease meanwhile."""
        lease = self._leases.pin(request_id, attempt)
        if lease is None:
            raise KVUnavailableError(
                f"{self.name} holds no KV of request {request_id!r} any more (its lease ended: acknowledged, "
                f"released, or expired after kv_lease_timeout_s={self.config.kv_lease_timeout_s:g} s)")
        try:
            self.counters["kv_reads"] += 1
            return pack(self.engine.executor.read_blocks(lease.block_ids))  # type: ignore[attr-defined]
        finally:
            self._leases.unpin(lease)
            self._commands.put(self._settle_leases)

    def poll(self, timeout_s: float) -> WorkerReport:
        """Events since the last poll (waits up to timeout_s for one), new iteration records, stats."""
        with self._events_cv:
            if not self._events and self._fatal is None:
                self._events_cv.wait(timeout_s)
            events, self._events = self._events, []
        if self._fatal is not None and not events:
            raise RuntimeError(f"worker {self.name} failed:\n{self._fatal}")
        its = self.engine.iterations
        n = len(its)
        iterations = its[:n]
        del its[:n]  # appends by the loop thread go after n: nothing is lost (GIL-atomic list ops)
        return WorkerReport(events, iterations, self.stats())

    def stats(self) -> WorkerStats:
        sched = self.engine.scheduler
        pool = sched.kv_cache_manager.block_pool
        s = WorkerStats(
            name=self.name, role=self.role, now_ns=time.monotonic_ns(), started_ns=self.started_ns,
            busy_ns=self.busy_ns, num_iterations=sched.iteration_id + 1, num_running=sched.num_running,
            num_waiting=sched.num_waiting, num_parked=len(self._leases), num_transfer_queue=self._transfer_q.qsize(),
            num_staged=len(self._inbox.staged), num_blocks_used=pool.num_used_blocks, num_blocks_total=pool.num_blocks,
            counters=dict(self.counters))
        self._prom.set_stats(s)
        return s

    def metrics_text(self) -> bytes:
        self.stats()
        self.engine.refresh_gauges()  # an idle worker runs no iteration that would refresh them
        return self.engine.metrics.render() + self._prom.render()

    def held(self) -> dict[str, int]:
        """Per-request state this worker still holds (a leak check: all 0 once every request it saw
        finished, failed or was aborted, and the loop ran a step since; benchmarks/soak.py)."""
        eng = self.engine
        with self._inbox.cv:
            attempts, cancelled = len(self._inbox.attempts), len(self._inbox.cancelled)
        return {"progress": len(self._progress), "attempts": attempts, "leases": len(self._leases),
                "staged": len(self._inbox.staged), "cancelled": cancelled, "engine_tracked": len(eng._tracked),
                "scheduler_requests": len(eng.scheduler.requests),
                "kv_tables": len(eng.scheduler.kv_cache_manager.req_to_blocks),
                "sampler_generators": eng.executor.sampler.num_generators,  # type: ignore[attr-defined]
                **{f"recorder_{k}": v for k, v in eng.recorder.stats().items()}}

    def check_invariants(self) -> None:
        """Test helper: the scheduler's invariants, run on the loop thread between steps."""
        done = threading.Event()
        errors: list[BaseException] = []

        def check() -> None:
            try:
                self.engine.scheduler.check_invariants()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            done.set()

        self._commands.put(check)
        if not done.wait(30):
            raise TimeoutError(f"{self.name}: the loop thread did not answer")
        if errors:
            raise errors[0]

    def set_kv_transport(self, name: str) -> None:
        """Prefill: export the KV of requests parked from now on with this transport (decode
        workers fetch with whichever transport a KVSource names)."""
        self._commands.put(lambda: setattr(self, "transport", make_transport(name)))

    def set_fault_transfer_delay(self, seconds: float) -> None:
        """FAULT INJECTION (tests): sleep this long inside every KV fetch from now on."""
        self.fault_transfer_delay_s = seconds

    def shutdown(self) -> None:
        self._stop.set()
        self._transfer_q.put(None)
        self._commands.put(lambda: None)

    # -- the loop thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.engine.scheduler
        try:
            while not self._stop.is_set():
                idle = not sched.has_schedulable_requests() and not self._inbox.staged
                self._apply_commands(self.config.poll_interval_s if idle else 0.0)
                if self.role == "prefill":
                    self._expire_leases()
                else:
                    self._admit_staged()
                if sched.has_schedulable_requests():
                    t0 = time.monotonic_ns()
                    outputs = self.engine.step()
                    self.busy_ns += time.monotonic_ns() - t0
                    self._publish(outputs)
        except BaseException:  # noqa: BLE001 - a broken engine: the router treats the worker as dead
            self._fatal = traceback.format_exc()
            with self._events_cv:
                self._events_cv.notify_all()

    def _apply_commands(self, wait_s: float) -> None:
        try:
            command = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _emit(self, *events: Any) -> None:
        with self._events_cv:
            self._events.extend(events)
            self._events_cv.notify_all()

    # prefill side ------------------------------------------------------------------------------------------
    def _add(self, spec: WorkerRequest, received_ns: int) -> None:
        rid = spec.request_id
        self._inbox.note_attempt(rid, spec.attempt)
        if rid in self._leases:  # a re-prefill of a request whose old lease is still open here
            self._end_lease(rid, "replaced")
            if rid in self._leases:  # pinned by a read in progress: retry once it is done
                threading.Timer(0.01, lambda: self._commands.put(lambda: self._add(spec, received_ns))).start()
                return
        elif self.engine.tracked(rid) is not None:
            self.engine.abort_request([rid])
        try:
            # queued from when the request reached this worker: the wait for the step boundary is queueing
            self.engine.add_request(spec.prompt_token_ids, spec.params, request_id=rid, arrived_ns=spec.arrived_ns,
                                    queued_ns=received_ns, prefill_only=True,
                                    output_token_ids=spec.output_token_ids)
        except InvalidRequestError as e:
            self._inbox.forget(rid, spec.attempt)
            self._emit(FailureEvent(rid, self.name, "invalid", str(e), attempt=spec.attempt))
            return
        self._progress[rid] = _Progress(len(spec.output_token_ids), spec.attempt)

    def _open_lease(self, rid: str, attempt: int) -> KVSource:
        eng = self.engine
        block_ids = eng.parked_block_ids(rid)
        num_tokens = eng.scheduler.parked[rid].num_computed_tokens
        t0 = time.monotonic_ns()
        handle = self.transport.export(lambda: eng.executor.read_blocks(block_ids))  # type: ignore[attr-defined]
        t1 = time.monotonic_ns()
        lease = KVLease(rid, block_ids if self.transport.holds_blocks else None, handle,
                       time.monotonic_ns() + int(self.config.kv_lease_timeout_s * 1e9), attempt)
        if not self.transport.holds_blocks:
            eng.release_parked(rid)  # the KV lives in the object store now
        self._leases.add(lease)
        self.counters["leases_opened"] += 1
        copied = not self.transport.holds_blocks
        return KVSource(self.transport.name, rid, self.name, self.handle, self.layout, num_tokens, len(block_ids),
                        handle, attempt, t0 if copied else None, t1 if copied else None)

    def _end_lease(self, rid: str, reason: str, attempt: int | None = None) -> None:
        """Loop thread. Frees the lease's blocks now, or once its readers are done."""
        lease = self._leases.end(rid, reason, attempt)
        if lease is None:
            return  # none, or pinned by a read: _settle_leases finishes it
        self._inbox.forget_request(rid)  # done here: forget its attempt (else one entry per request, forever)
        if lease.block_ids is not None:
            self.engine.release_parked(rid)
        self.counters[f"leases_{lease.reason}"] += 1
        self._prom.lease_ended(lease.reason)

    def _settle_leases(self) -> None:
        for rid in self._leases.settled():
            self._end_lease(rid, "")

    def _expire_leases(self) -> None:
        if not self._leases:
            return
        for rid in self._leases.expired(time.monotonic_ns()):
            self._end_lease(rid, "expired")

    # decode side -------------------------------------------------------------------------------------------
    def _transfer_loop(self) -> None:
        cfg = self.config
        while True:
            item = self._transfer_q.get()
            if item is None or self._stop.is_set():
                return
            spec, queued_ns = item
            rid, source, key = spec.request_id, spec.source, (spec.request_id, spec.attempt)
            if not self._inbox.wait_for_room(key, source.num_bytes, cfg.max_staged_kv_bytes, self._stop):
                continue  # cancelled meanwhile
            start_ns = time.monotonic_ns()
            try:
                handshake(source.layout, self.layout, source.worker, self.name)
                if self.fault_transfer_delay_s:
                    time.sleep(self.fault_transfer_delay_s)
                kv = self._transport(source.transport).fetch(source, cfg.transfer_timeout_s)
            except KVLayoutMismatchError as e:
                self._inbox.drop_transfer(key)
                self._emit(FailureEvent(rid, self.name, "engine_error", str(e), attempt=spec.attempt))
                continue
            except KVUnavailableError as e:
                self._inbox.drop_transfer(key)
                self.counters["transfers_failed"] += 1
                self._prom.transfer("failed")
                self._emit(FailureEvent(rid, self.name, "kv_unavailable", str(e), kv_lost=True, attempt=spec.attempt))
                continue
            end_ns = time.monotonic_ns()
            self._transport(source.transport).ack(source)
            self.counters["transfers"] += 1
            self.counters["transfer_bytes"] += source.num_bytes
            self._prom.transfer("ok")
            self._emit(TransferEvent(rid, self.name, queued_ns, start_ns, end_ns, source.num_bytes, spec.attempt))
            if not self._inbox.stage(StagedKV(spec, kv, queued_ns, start_ns, end_ns, source.num_bytes)):
                continue  # cancelled during the fetch
            self._commands.put(lambda: None)  # wake the loop

    def _transport(self, name: str) -> Any:
        if name not in self._transports:
            self._transports[name] = make_transport(name)
        return self._transports[name]

    def _admit_staged(self) -> None:
        while self._inbox.staged:
            st = self._inbox.staged[0]
            spec = st.spec
            rid = spec.request_id
            if not self._inbox.is_cancelled((rid, spec.attempt)):
                if self.engine.tracked(rid) is not None:  # an older attempt whose abort is still on its way
                    self.engine.abort_request([rid])
                m = RequestMetrics(
                    arrived_ns=spec.arrived_ns, request_id=rid, num_prompt_tokens=len(spec.prompt_token_ids),
                    worker=self.name, kv_transfer_queued_ns=st.queued_ns, kv_transfer_start_ns=st.start_ns,
                    kv_transfer_end_ns=st.end_ns, kv_transfer_bytes=st.num_bytes)
                try:
                    admitted = self.engine.add_prefilled_request(
                        rid, spec.prompt_token_ids, spec.output_token_ids, spec.params, st.kv, m)
                except InvalidRequestError as e:
                    self._inbox.unstage(failed=True)
                    self._emit(FailureEvent(rid, self.name, "invalid", str(e), attempt=spec.attempt))
                    continue
                now = time.monotonic_ns()
                if not admitted:
                    waited = (now - st.end_ns) / 1e9
                    if waited <= self.config.decode_admission_timeout_s:
                        return  # backpressure: wait for blocks; later ones wait behind it (FIFO)
                    self._inbox.unstage(failed=True)
                    self.counters["admission_timeouts"] += 1
                    self._emit(FailureEvent(
                        rid, self.name, "admission_timeout",
                        f"{self.name} had no free KV blocks for request {rid!r} for {waited:.1f} s "
                        f"(decode_admission_timeout_s={self.config.decode_admission_timeout_s:g}); the decode pool is "
                        "full: add decode workers or KV memory", attempt=spec.attempt))
                    continue
                if spec.sampler_state is not None:
                    self._restore_sampler_state(rid, spec.sampler_state)
                self._progress[rid] = _Progress(len(spec.output_token_ids), spec.attempt)
                self.counters["admitted"] += 1
                self._emit(AdmittedEvent(rid, self.name, m.decode_admitted_ns or now, spec.attempt))
            self._inbox.unstage()

    def _sampler_state(self, rid: str) -> bytes | None:
        gen = getattr(self.engine.executor, "sampler", None)
        gen = gen._generators.get(rid) if gen is not None else None
        return bytes(gen.get_state().numpy()) if gen is not None else None

    def _restore_sampler_state(self, rid: str, state: bytes) -> None:
        import torch

        sampler = self.engine.executor.sampler  # type: ignore[attr-defined]
        gen = torch.Generator()
        gen.set_state(torch.tensor(list(state), dtype=torch.uint8))
        sampler._generators[rid] = gen

    # both --------------------------------------------------------------------------------------------------
    def _abort(self, request_ids: list[str], attempt: int) -> None:
        request_ids = self._inbox.current(request_ids, attempt)  # not stale
        for rid in request_ids:
            if rid in self._leases:  # parked: freed through its lease (never under a reader)
                self._end_lease(rid, "aborted")
            elif self.engine.tracked(rid) is not None:
                self.engine.abort_request([rid])
            self._progress.pop(rid, None)
            self._inbox.forget(rid, attempt)
        if self.role == "decode":
            self._inbox.drop_cancelled()

    def _publish(self, outputs: list[Any]) -> None:
        events = []
        for out in outputs:
            rid = out.request_id
            progress = self._progress.get(rid)
            if progress is None:
                continue
            m = out.metrics
            new_tokens = out.token_ids[progress.num_tokens:]
            new_logprobs = None
            if out.logprobs is not None:
                new_logprobs = out.logprobs[progress.num_logprobs:]
                progress.num_logprobs = len(out.logprobs)
            ev = TokenEvent(
                request_id=rid, worker=self.name, new_token_ids=list(new_tokens),
                sampled_ns=m.token_sampled_ns[progress.num_stamped:],
                iteration_ids=m.token_iteration_ids[progress.num_stamped:], text=out.text,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason, logprobs=new_logprobs,
                attempt=progress.attempt)
            progress.num_tokens, progress.num_stamped = len(out.token_ids), len(m.token_sampled_ns)
            if self.role == "prefill" and self.engine.is_parked(rid):
                ev.kv = self._open_lease(rid, progress.attempt)
                ev.sampler_state = self._sampler_state(rid)
            if out.finished or ev.kv is not None:
                ev.record = dataclasses.replace(m, token_sent_ns=[])
                del self._progress[rid]
                if out.finished:
                    self._inbox.forget_request(rid)
            events.append(ev)
        if events:
            self._emit(*events)
