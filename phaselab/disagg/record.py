"""Record assembly of disaggregated serving: the one record per request, from the workers' parts.

    router's record:  arrived, tokenized                                (the router's own stamps)
      + prefill worker's record (first prefill):  queued, first scheduled, prefill chunks, cached
      + any later prefill (KV lost) or decode recomputation:  recompute chunks, preemptions
      + tokens sampled (either worker), the KV transfer (decode worker), decode admitted
      + sent stamps and the close (the router's PhaseRecorder)

Every worker stamp is converted to the router's clock with the offset measured at the handshake
(worker = router + offset; 0 on one host, where monotonic_ns is system-wide).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from phaselab.core.timing import IterationRecord, PrefillChunk, RequestMetrics
from phaselab.disagg.messages import TransferEvent


def merge_worker_tokens(m: RequestMetrics, worker: str, role: str, offset_ns: int, record: RequestMetrics | None,
                        sampled_ns: list[int], iteration_ids: list[int]) -> None:
    """A worker reported tokens (and, when the request left it, its record of the request)."""
    rec = shift_metrics(record, offset_ns) if record is not None else None
    if role == "prefill":
        m.worker = worker
        if rec is not None:
            if m.first_token_sampled_ns is None:  # the first prefill of this request
                m.queued_ns, m.first_scheduled_ns = rec.queued_ns, rec.first_scheduled_ns
                m.prefill_chunks = rec.prefill_chunks
                m.recompute_chunks += rec.recompute_chunks
                m.num_cached_tokens = rec.num_cached_tokens
                m.num_repeat_tokens = rec.num_repeat_tokens
            else:  # a re-prefill after the KV was lost: recomputation
                m.recompute_chunks += rec.prefill_chunks + rec.recompute_chunks
            _merge_preemptions(m, rec)
    elif rec is not None:
        m.decode_worker = worker
        m.recompute_chunks += rec.prefill_chunks + rec.recompute_chunks
        _merge_preemptions(m, rec)
    sampled = [t - offset_ns for t in sampled_ns]
    if m.first_token_sampled_ns is None and sampled:
        m.first_token_sampled_ns = sampled[0]
    m.token_sampled_ns += sampled
    m.token_iteration_ids += iteration_ids


def _merge_preemptions(m: RequestMetrics, rec: RequestMetrics) -> None:
    m.preempted_ns += rec.preempted_ns
    m.resumed_ns += rec.resumed_ns
    m.num_preemptions += rec.num_preemptions


def merge_transfer(m: RequestMetrics, ev: TransferEvent, offset_ns: int, export_start_ns: int | None) -> None:
    """The decode worker fetched the KV: its fetch queue and its fetch are recorded where they
    happened (queued -> start: waiting for the transport; start -> end: the wire). `export_start_ns`
    (router clock): a transport that copied the KV out when the request parked (ray-object-store)
    asked for the transfer there, so the transfer is queued from then on; the fetch stays the wire
    time, so KV bytes / transfer_s is the link's bandwidth, not the copy's and the router's too."""
    queued_ns = ev.queued_ns - offset_ns
    if export_start_ns is not None:
        queued_ns = min(queued_ns, export_start_ns)
    m.kv_transfer_queued_ns, m.kv_transfer_start_ns, m.kv_transfer_end_ns = (
        queued_ns, ev.start_ns - offset_ns, ev.end_ns - offset_ns)
    m.kv_transfer_bytes = ev.num_bytes
    m.decode_admitted_ns = None


def observe_router_record(metrics: Any, router_metrics: Any, m: RequestMetrics) -> None:
    """Prometheus of one closed record: the request histograms, and the transfer's own."""
    metrics.observe_finished(m)
    rm = router_metrics
    if m.transfer_s is not None and m.kv_transfer_bytes is not None:
        rm.transfer_bytes_total.inc(m.kv_transfer_bytes)
        if m.transfer_s > 0:
            rm.transfer_bandwidth.observe(m.kv_transfer_bytes / m.transfer_s)
    if m.decode_admission_wait_s is not None:
        rm.decode_admission_wait.observe(m.decode_admission_wait_s)
    if m.first_token_sampled_ns is not None and m.kv_transfer_start_ns is not None:
        rm.transfer_queue.observe((m.kv_transfer_start_ns - m.first_token_sampled_ns) / 1e9)


def shift_metrics(m: RequestMetrics, offset_ns: int) -> RequestMetrics:
    """A worker's record in the router's clock (worker = router + offset)."""
    if not offset_ns:
        return m

    def s(t: int | None) -> int | None:
        return None if t is None else t - offset_ns

    def chunks(cs: list[PrefillChunk]) -> list[PrefillChunk]:
        return [dataclasses.replace(c, start_ns=c.start_ns - offset_ns, end_ns=c.end_ns - offset_ns) for c in cs]

    return dataclasses.replace(
        m, arrived_ns=m.arrived_ns - offset_ns, tokenized_ns=s(m.tokenized_ns), queued_ns=s(m.queued_ns),
        first_scheduled_ns=s(m.first_scheduled_ns), prefill_chunks=chunks(m.prefill_chunks),
        recompute_chunks=chunks(m.recompute_chunks), first_token_sampled_ns=s(m.first_token_sampled_ns),
        kv_transfer_queued_ns=s(m.kv_transfer_queued_ns), kv_transfer_start_ns=s(m.kv_transfer_start_ns),
        kv_transfer_end_ns=s(m.kv_transfer_end_ns), decode_admitted_ns=s(m.decode_admitted_ns),
        token_sampled_ns=[t - offset_ns for t in m.token_sampled_ns],
        token_sent_ns=[t - offset_ns for t in m.token_sent_ns],
        preempted_ns=[t - offset_ns for t in m.preempted_ns], resumed_ns=[t - offset_ns for t in m.resumed_ns],
        finished_ns=s(m.finished_ns))


def shift_iteration(rec: IterationRecord, offset_ns: int) -> IterationRecord:
    if not offset_ns:
        return rec
    return dataclasses.replace(rec, start_ns=rec.start_ns - offset_ns, end_ns=rec.end_ns - offset_ns)
