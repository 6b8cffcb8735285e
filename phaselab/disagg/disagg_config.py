"""Options of disaggregated serving beyond EngineArgs: every bound on a wait, Ray placement, and the
fault-injection knob the tests use. Frozen, with help text, no I/O; `phaselab serve` and `generate`
make a flag of each field (cliargs.add_fields: --<name without _s>)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from phaselab.engine_args import parse_bytes
from phaselab.errors import ConfigError


@dataclass(frozen=True)
class DisaggConfig:
    kv_lease_timeout_s: float = field(default=60.0, metadata={
        "metavar": "SECONDS", "help": "a prefill worker frees a parked request's KV if no decode worker acknowledged it within this"})
    transfer_timeout_s: float = field(default=30.0, metadata={
        "metavar": "SECONDS", "help": "longest one KV fetch may take before the decode worker gives up on the source"})
    decode_admission_timeout_s: float = field(default=120.0, metadata={
        "metavar": "SECONDS", "help": "longest received KV may wait for free blocks on a decode worker before the request fails"})
    worker_timeout_s: float = field(default=30.0, metadata={
        "metavar": "SECONDS", "help": "a worker that answers no poll for this long is declared dead (and killed)"})
    worker_start_timeout_s: float = field(default=300.0, metadata={
        "metavar": "SECONDS", "help": "longest a worker may take to start (load the model) and answer the handshake"})
    request_timeout_s: float | None = field(default=None, metadata={
        "metavar": "SECONDS", "help": "fail a request that has not finished within this many seconds of arrival (None: no bound)"})
    poll_interval_s: float = field(default=0.05, metadata={
        "metavar": "SECONDS", "help": "longest one poll of a worker blocks when the worker has nothing to report"})
    recover_lost_kv: bool = field(default=True, metadata={
        "help": "when a request's KV is lost (its decode worker died after the transfer), re-prefill prompt + "
                "tokens so far on a prefill worker; False: fail it with an error"})
    max_staged_kv_bytes: int = field(default=512 * 2**20, metadata={
        "type": parse_bytes, "metavar": "BYTES", "help": "received KV a decode worker keeps waiting for free blocks; beyond it, transfers wait "
                "(the prefill worker keeps the KV under its lease)"})
    worker_num_cpus: float = field(default=0.0, metadata={
        "metavar": "N", "help": "Ray CPUs each worker actor reserves (0: place by resources only; the thread count is separate)"})
    prefill_resources: dict[str, float] = field(default_factory=dict, metadata={
        "type": json.loads, "metavar": "JSON",
        "help": "Ray custom resources each prefill worker requires (pin the pool to nodes), e.g. '{\"prefill_host\": 1}'"})
    decode_resources: dict[str, float] = field(default_factory=dict, metadata={
        "type": json.loads, "metavar": "JSON",
        "help": "Ray custom resources each decode worker requires, e.g. '{\"decode_host\": 1}'"})
    object_store_memory: int = field(default=512 * 2**20, metadata={
        "type": parse_bytes, "metavar": "BYTES", "help": "object store size when Ray is started locally on demand"})
    fault_transfer_delay_s: float = field(default=0.0, metadata={
        "metavar": "SECONDS", "help": "FAULT INJECTION (tests): a decode worker sleeps this long inside every KV fetch, between "
                "its start and its end"})

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and v is not None and v < 0:
                raise ConfigError(f"{f.name}={v} must be >= 0")
        if self.poll_interval_s <= 0:
            raise ConfigError("poll_interval_s must be > 0")
