"""Prometheus text snapshots (/metrics scrapes) read the same way for phaselab and vLLM servers.

Each concept the diagnosis needs has a list of metric names, phaselab's first, then vLLM's (current
name, then older ones); the first name present in the scrape is used and the diagnosis says which.
The mapping and the differences in meaning are documented in docs/metrics.md and docs/glossary.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# concept -> candidate metric family names (histograms: without _sum/_count)
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("phaselab_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "queue": ("phaselab_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "prefill": ("phaselab_request_prefill_compute_seconds", "vllm:request_prefill_time_seconds"),
    "prefill_span": ("phaselab_request_prefill_span_seconds",),
    "decode": ("phaselab_request_decode_time_seconds", "vllm:request_decode_time_seconds"),
    "itl": ("phaselab_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds"),
    "tpot": ("phaselab_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
    "e2e": ("phaselab_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    "tokenize": ("phaselab_request_tokenize_time_seconds",),
    "kv_transfer": ("phaselab_kv_transfer_seconds",),
    "kv_transfer_bytes": ("phaselab_kv_transfer_bytes",),
    "iteration": ("phaselab_iteration_duration_seconds",),
    "inference": ("vllm:request_inference_time_seconds",),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    "preemptions": ("phaselab_num_preemptions_total", "vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prompt_tokens": ("phaselab_prompt_tokens_total", "vllm:prompt_tokens_total", "vllm:prompt_tokens"),
    "generation_tokens": ("phaselab_generation_tokens_total", "vllm:generation_tokens_total",
                          "vllm:generation_tokens"),
    "prefix_cache_queries": ("phaselab_prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                             "vllm:prefix_cache_queries"),
    "prefix_cache_hits": ("phaselab_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                          "vllm:prefix_cache_hits"),
}
GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("phaselab_num_requests_running", "vllm:num_requests_running"),
    "waiting": ("phaselab_num_requests_waiting", "vllm:num_requests_waiting"),
    "kv_usage": ("phaselab_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


@dataclass
class Snapshot:
    """Samples of one scrape, summed over label sets (one server; several workers add up)."""

    values: dict[str, float] = field(default_factory=dict)  # sample name -> value (labels summed)
    maxima: dict[str, float] = field(default_factory=dict)  # sample name -> largest value of one label set

    def get(self, name: str) -> float | None:
        return self.values.get(name)


def parse(text: str | bytes | None) -> Snapshot:
    snap = Snapshot()
    if not text:
        return snap
    from prometheus_client.parser import text_string_to_metric_families

    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created") or s.name.endswith("_bucket"):
                continue
            name = s.name
            # prometheus_client strips "_total" from counter family names but not from samples
            snap.values[name] = snap.values.get(name, 0.0) + float(s.value)
            snap.maxima[name] = max(snap.maxima.get(name, float("-inf")), float(s.value))
    return snap


@dataclass(frozen=True)
class HistogramDelta:
    name: str  # the metric family used
    count: float
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


def histogram(concept: str, before: Snapshot, after: Snapshot) -> HistogramDelta | None:
    """after - before of the first candidate name present (before may be empty: a fresh server)."""
    for name in HISTOGRAMS[concept]:
        c_after = after.get(name + "_count")
        if c_after is None:
            continue
        count = c_after - (before.get(name + "_count") or 0.0)
        total = (after.get(name + "_sum") or 0.0) - (before.get(name + "_sum") or 0.0)
        return HistogramDelta(name, count, total)
    return None


def counter(concept: str, before: Snapshot, after: Snapshot) -> tuple[str, float] | None:
    for name in COUNTERS[concept]:
        for sample in (name, name + "_total") if not name.endswith("_total") else (name,):
            v = after.get(sample)
            if v is not None:
                return name, v - (before.get(sample) or 0.0)
    return None


def gauge(concept: str, snap: Snapshot) -> tuple[str, float] | None:
    for name in GAUGES[concept]:
        v = snap.get(name)
        if v is not None:
            return name, v
    return None
