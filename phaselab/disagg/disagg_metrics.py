"""Prometheus for disaggregated serving: the router's own counters, and one /metrics text merged
from the router's and every live worker's registries.

    router:   EngineMetrics{worker="router"}  request histograms of the one record per request
              RouterMetrics                   failures, re-routes, re-prefills, transfer bandwidth
    worker i: EngineMetrics{worker, role}     iterations, queues, KV usage (its own registry)
              worker gauges/counters          busy ratio, leases, transfer queue, staged KV
    /metrics = merge_exposition(all of them): one HELP/TYPE per family, samples told apart by labels
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phaselab.disagg.messages import WorkerStats
from phaselab.obs.prometheus import BYTES_BUCKETS, STEP_SECONDS_BUCKETS

logger = logging.getLogger("phaselab.disagg")

BANDWIDTH_BUCKETS = tuple(float(2**k) for k in range(20, 38))  # 1 MiB/s .. 128 GiB/s


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.worker_failures = Counter(
            "phaselab_disagg_worker_failures", "Workers declared dead (actor died, or silent past worker_timeout_s).",
            ["worker", "role"], registry=r)
        self.request_failures = Counter(
            "phaselab_disagg_request_failures", "Requests that ended with an error, by cause.", ["cause"], registry=r)
        self.reroutes = Counter(
            "phaselab_disagg_reroutes", "Requests sent to another decode worker while the prefill worker still "
            "held their KV (the first decode worker died before the transfer completed).", registry=r)
        self.reprefills = Counter(
            "phaselab_disagg_reprefills", "Requests prefilled again (prompt + tokens so far) because their KV or "
            "their prefill worker was lost, by cause.", ["cause"], registry=r)
        self.transfer_bandwidth = Histogram(
            "phaselab_kv_transfer_bandwidth_bytes_per_second", "Per request: KV bytes / transfer time.",
            registry=r, buckets=BANDWIDTH_BUCKETS)
        self.decode_admission_wait = Histogram(
            "phaselab_decode_admission_wait_seconds", "KV transfer end -> decode admitted (backpressure).",
            registry=r, buckets=STEP_SECONDS_BUCKETS)
        self.transfer_queue = Histogram(
            "phaselab_kv_transfer_queue_seconds", "First token sampled -> KV transfer start.",
            registry=r, buckets=STEP_SECONDS_BUCKETS)
        self.transfer_bytes_total = Counter(
            "phaselab_kv_transfer_bytes_moved", "KV bytes moved between workers.", registry=r)
        assert BYTES_BUCKETS  # the per-request bytes histogram lives in EngineMetrics

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MergedEngineMetrics:
    """Stands where an engine's `metrics` stands (the server renders it for /metrics): the
    router's EngineMetrics (its gauges included) whose render() also merges the RouterMetrics
    and the latest text of every worker (refreshed by the router in the background)."""

    def __init__(self, engine_metrics: Any, router_metrics: RouterMetrics) -> None:
        self.engine_metrics = engine_metrics
        self.router_metrics = router_metrics
        self.worker_texts: dict[str, bytes] = {}
        self._refs: dict[str, Any] = {}  # worker -> its metrics_text call in flight
        self._refreshed_ns = 0

    def __getattr__(self, name: str) -> Any:  # gauges, histograms, observe_*: the router's EngineMetrics
        return getattr(self.engine_metrics, name)

    def render(self) -> bytes:
        texts = [self.engine_metrics.render(), self.router_metrics.render(), *self.worker_texts.values()]
        return merge_exposition(texts)

    def refresh(self, workers: Iterable[Any], every_s: float = 1.0) -> None:
        """Keep each live worker's text fresh (for render) without blocking: collect the answers
        that arrived, ask again every `every_s`. A dead worker is noticed by its poll, not here."""
        import ray

        for name, ref in list(self._refs.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._refs[name]
                try:
                    self.worker_texts[name] = ray.get(ref)
                except Exception:  # noqa: BLE001
                    self.worker_texts.pop(name, None)
        now = time.monotonic_ns()
        if now - self._refreshed_ns > every_s * 1e9:
            self._refreshed_ns = now
            for w in workers:
                if w.alive and w.name not in self._refs:
                    self._refs[w.name] = w.actor.metrics_text.remote()

    def render_now(self, workers: Iterable[Any], timeout_s: float) -> bytes:
        """render() with every live worker's text fetched now (waits up to timeout_s per worker)."""
        import ray

        texts = [self.engine_metrics.render(), self.router_metrics.render()]
        alive = [w for w in workers if w.alive]
        refs = [w.actor.metrics_text.remote() for w in alive]
        for w, ref in zip(alive, refs):
            try:
                texts.append(ray.get(ref, timeout=timeout_s))
                self.worker_texts[w.name] = texts[-1]
            except Exception as e:  # noqa: BLE001 - a worker that dies now is reported by the next step
                logger.debug("metrics of %s: %r", w.name, e)
        return merge_exposition(texts)


class _Families:
    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


def merge_exposition(texts: list[bytes]) -> bytes:
    """Several Prometheus text expositions as one: samples of one family (same name) from all
    sources under a single HELP/TYPE (concatenating the texts would repeat them, which strict
    parsers refuse)."""
    families: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry)


class WorkerPrometheus:
    """Per-worker gauges and counters of disaggregation, next to the engine's own registry."""

    def __init__(self, name: str, role: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"worker": name, "role": role}
        names = list(labels)

        def gauge(metric: str, doc: str) -> Any:
            return Gauge(metric, doc, names, registry=self.registry).labels(**labels)

        self.busy = gauge("phaselab_worker_busy_ratio", "Fraction of the worker's lifetime spent in iterations.")
        self.parked = gauge("phaselab_worker_kv_leases", "Prefill: parked requests whose KV is leased, awaiting pickup.")
        self.transfer_queue = gauge("phaselab_worker_kv_transfer_queue_length", "Decode: KV transfers not started.")
        self.staged = gauge("phaselab_worker_kv_staged_requests", "Decode: KV received, waiting for free blocks.")
        self._leases = Counter("phaselab_worker_kv_leases_ended", "Prefill: leases ended, by outcome "
                               "(acked, released, expired, aborted, replaced).", [*names, "outcome"],
                               registry=self.registry)
        self._transfers = Counter("phaselab_worker_kv_transfers", "Decode: KV fetches, by outcome (ok, failed).",
                                  [*names, "outcome"], registry=self.registry)
        self.labels = labels

    def set_stats(self, s: WorkerStats) -> None:
        self.busy.set(s.busy_fraction)
        self.parked.set(s.num_parked)
        self.transfer_queue.set(s.num_transfer_queue)
        self.staged.set(s.num_staged)

    def lease_ended(self, outcome: str) -> None:
        self._leases.labels(**self.labels, outcome=outcome or "released").inc()

    def transfer(self, outcome: str) -> None:
        self._transfers.labels(**self.labels, outcome=outcome).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


