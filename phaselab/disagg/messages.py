"""Plain-data messages between the router and the workers (they pickle through Ray).

    router ──WorkerRequest──▶ prefill worker ──TokenEvent(kv=KVSource)──▶ router
    router ──TransferSpec─▶ decode worker  ──TransferEvent, AdmittedEvent, TokenEvent...──▶ router
    any worker ──FailureEvent──▶ router          router ◀── WorkerReport (poll): events, iterations, stats

Timestamps in messages are the *sender's* `time.monotonic_ns()`; the router converts them with
the offset it measured at the handshake (0 between processes of one boot of one host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phaselab.core.outputs import TokenLogprobs
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import IterationRecord, RequestMetrics
from phaselab.disagg.connector import KVLayout, KVSource


@dataclass
class WorkerRequest:
    """Router -> prefill worker: compute prompt (+ outputs already streamed) and sample one token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrived_ns: int  # worker clock
    output_token_ids: list[int] = field(default_factory=list)  # a re-prefill after the KV was lost
    attempt: int = 0  # the router's routing attempt: events carry it back, stale ones are dropped


@dataclass
class TransferSpec:
    """Router -> decode worker: fetch the KV from `source`, admit, continue decoding."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # all sampled so far; the K/V of all but the last are in the source
    params: SamplingParams
    source: KVSource
    arrived_ns: int  # worker clock
    attempt: int = 0
    sampler_state: bytes | None = None  # the request's random generator after its last draw


@dataclass
class TokenEvent:
    """New tokens of one request. From a prefill worker exactly one per WorkerRequest: parked (kv
    set) or finished. `text` is the request's whole output text so far."""

    request_id: str
    worker: str
    new_token_ids: list[int]
    sampled_ns: list[int]
    iteration_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    kv: KVSource | None = None
    record: RequestMetrics | None = None  # the worker's own record, when its part of the request ended
    attempt: int = 0
    # prefill, parked: the request's random generator state (token state travels with the KV, so a
    # sampled request continues the same random stream on the decode worker)
    sampler_state: bytes | None = None


@dataclass
class TransferEvent:
    """Decode worker: the KV arrived and was acknowledged (the source frees it)."""

    request_id: str
    worker: str
    queued_ns: int
    start_ns: int
    end_ns: int
    num_bytes: int
    attempt: int = 0


@dataclass
class AdmittedEvent:
    request_id: str
    worker: str
    admitted_ns: int
    attempt: int = 0


@dataclass
class FailureEvent:
    """A worker could not serve a request. `kv_lost`: the request's KV is gone (recoverable by a
    re-prefill); otherwise the request itself is at fault (the message says why)."""

    request_id: str
    worker: str
    kind: str  # "kv_unavailable" | "admission_timeout" | "invalid" | "engine_error"
    message: str
    kv_lost: bool = False
    attempt: int = 0


@dataclass
class WorkerStats:
    name: str
    role: str
    now_ns: int
    started_ns: int
    busy_ns: int  # sum of this worker's iteration durations
    num_iterations: int
    num_running: int
    num_waiting: int
    num_parked: int  # prefill: requests whose KV awaits pickup (leases)
    num_transfer_queue: int  # decode: transfers not started
    num_staged: int  # decode: KV received, waiting for blocks
    num_blocks_used: int
    num_blocks_total: int
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def busy_fraction(self) -> float:
        elapsed = self.now_ns - self.started_ns
        return self.busy_ns / elapsed if elapsed > 0 else 0.0


@dataclass
class WorkerReport:
    events: list[Any]
    iterations: list[IterationRecord]
    stats: WorkerStats


@dataclass
class WorkerInfo:
    """The handshake answer: who the worker is, its KV layout, its clock."""

    name: str
    role: str
    layout: KVLayout
    max_model_len: int
    vocab_size: int
    monotonic_ns: int
    boot_id: str
    hostname: str
    node_id: str
    pid: int
    run_config: dict[str, Any]
    model_config: Any = None  # phaselab.modelinfo.model_config.ModelConfig
