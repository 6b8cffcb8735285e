"""Prometheus metrics of one engine (or worker), fed from the phase records of core/timing.py.

Each `EngineMetrics` owns its `CollectorRegistry`: several engines (prefill and decode workers,
tests) live in one process without clashing, and nothing registers globally. Constant labels
(worker, role, model, ...) are bound once, so every series of one instance carries them.

    engine step  ──▶ observe_iteration(rec, running, waiting, kv_usage, blocks_used)
    request done ──▶ observe_finished(metrics)     (request histograms, token counters, reason)
    prefix cache ──▶ add_prefix_cache(queried, hit) (token deltas)
    adaptive budget ─▶ observe_budget(rec, coefficients)  (--slo-tbt-ms: budget, prediction, cost model)
    /metrics     ◀── render()

docs/metrics.md maps every name to the nearest vLLM metric. `enable_vllm_names(model_name)` adds,
in the same registry, the vLLM metrics of the same meaning under vLLM's names and labels
(`model_name`, `engine`), so a vLLM dashboard's queries work unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from phaselab.core.timing import IterationRecord, RequestMetrics

# Request-level latencies: 1 ms (GPU, short prompts) to ~10 minutes (CPU, long prompts, queues).
REQUEST_SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)
# Per-step latencies (ITL, TPOT, iteration, delivery, tokenize, transfer): 100 us to 80 s.
STEP_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)
TOKEN_BUCKETS = tuple(float(2**k) for k in range(0, 17))  # 1 .. 65536 tokens
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 37, 2))  # 1 KiB .. 64 GiB

Metric = TypeVar("Metric", Histogram, Gauge, Counter)

FINISHED_REASONS = ("stop", "length", "abort", "error")
PHASES = ("prefill", "decode")


class EngineMetrics:
    """The phaselab_* metrics of one engine over its own registry."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.const_labels: dict[str, str] = dict(labels or {})
        names = list(self.const_labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return self._bind(Histogram(name, doc, names, registry=self.registry, buckets=buckets))

        def gauge(name: str, doc: str) -> Gauge:
            return self._bind(Gauge(name, doc, names, registry=self.registry))

        def counter(name: str, doc: str) -> Counter:
            return self._bind(Counter(name, doc, names, registry=self.registry))

        R, S = REQUEST_SECONDS_BUCKETS, STEP_SECONDS_BUCKETS
        # -- per finished request ------------------------------------------------------------------
        self.ttft = histogram("phaselab_time_to_first_token_seconds", "Arrived -> first token sent (server TTFT).", R)
        self.queue = histogram("phaselab_request_queue_time_seconds", "Queued -> first scheduled.", R)
        self.tokenize = histogram("phaselab_request_tokenize_time_seconds", "Arrived -> tokenized.", S)
        self.prefill_compute = histogram(
            "phaselab_request_prefill_compute_seconds", "Sum of the iterations that carried the prefill chunks.", R)
        self.prefill_span = histogram(
            "phaselab_request_prefill_span_seconds", "First prefill chunk start -> last chunk end.", R)
        self.decode = histogram("phaselab_request_decode_time_seconds", "First token sampled -> finished.", R)
        self.itl = histogram("phaselab_inter_token_latency_seconds", "Every gap between consecutive sent tokens.", S)
        self.tpot = histogram(
            "phaselab_time_per_output_token_seconds", "Per request: (E2E - TTFT) / (output tokens - 1).", S)
        self.e2e = histogram("phaselab_e2e_request_latency_seconds", "Arrived -> finished.", R)
        self.delivery = histogram("phaselab_token_delivery_seconds", "Every token: sampled -> sent.", S)
        self.kv_transfer = histogram("phaselab_kv_transfer_seconds", "KV transfer start -> end (disaggregated).", S)
        self.kv_transfer_bytes = histogram(
            "phaselab_kv_transfer_bytes", "KV bytes transferred per request (disaggregated).", BYTES_BUCKETS)
        # -- per iteration ---------------------------------------------------------------------------
        self._iteration_tokens = Histogram(
            "phaselab_iteration_tokens", "Tokens per iteration, by phase (observed when > 0).",
            [*names, "phase"], registry=self.registry, buckets=TOKEN_BUCKETS)
        self.iteration_tokens = {p: self._iteration_tokens.labels(**self.const_labels, phase=p) for p in PHASES}
        self.iteration_duration = histogram(
            "phaselab_iteration_duration_seconds", "One scheduler iteration: schedule -> outputs handled.", S)
        self.iterations = counter("phaselab_iterations", "Scheduler iterations run.")
        self.num_running = gauge("phaselab_num_requests_running", "Requests running (scheduled or resumable).")
        self.num_waiting = gauge("phaselab_num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = gauge("phaselab_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_blocks_used = gauge("phaselab_kv_cache_blocks_used", "KV-cache blocks in use.")
        self.preemptions = counter("phaselab_num_preemptions", "Requests preempted (cumulative).")
        # -- the adaptive budget (--slo-tbt-ms, docs/slo.md) ------------------------------------------
        self.slo_budget = gauge("phaselab_slo_prefill_budget_tokens",
                                "Prefill tokens the adaptive budget allowed in the last iteration.")
        self.slo_target = gauge("phaselab_slo_tbt_target_seconds", "The time-between-tokens target.")
        self.slo_predicted = gauge("phaselab_slo_predicted_iteration_seconds",
                                   "The online cost model's prediction of the last iteration (before it learned from it).")
        self.slo_missed = counter("phaselab_slo_tbt_missed_iterations",
                                  "Iterations carrying decodes that took longer than the TBT target.")
        self.slo_infeasible = counter("phaselab_slo_infeasible_iterations",
                                      "Iterations where even min_chunk was predicted over the target.")
        self._cost_coefficient = Gauge(
            "phaselab_slo_cost_coefficient", "The adaptive budget's cost model, seconds per unit of `term`.",
            [*names, "term"], registry=self.registry)
        # -- tokens and outcomes ---------------------------------------------------------------------
        self.prompt_tokens = counter("phaselab_prompt_tokens", "Prompt tokens of finished requests (cached included).")
        self.generation_tokens = counter("phaselab_generation_tokens", "Output tokens sampled by finished requests.")
        self.prefix_queries = counter("phaselab_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("phaselab_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter(
            "phaselab_request_success", "Finished requests by finished_reason (errors and aborts too).",
            [*names, "finished_reason"], registry=self.registry)
        # pre-create every reason so a dashboard sees 0 rather than a missing series
        self.success = {r: self._success.labels(**self.const_labels, finished_reason=r) for r in FINISHED_REASONS}

        self.vllm: VllmMetrics | None = None

    def enable_vllm_names(self, model_name: str, engine: str = "0") -> None:
        """Also export vLLM's names (idempotent); the server calls it with the served model name."""
        if self.vllm is None:
            self.vllm = VllmMetrics(self.registry, model_name, engine)

    def _bind(self, metric: Metric) -> Metric:
        # prometheus_client refuses .labels() on a metric declared without label names
        return metric.labels(**self.const_labels) if self.const_labels else metric

    # -- feeding --------------------------------------------------------------------------------------
    def observe_iteration(
        self, rec: IterationRecord, num_running: int, num_waiting: int, kv_usage: float, blocks_used: int
    ) -> None:
        self.iterations.inc()
        self.iteration_duration.observe(rec.duration_s)
        for phase, n in (("prefill", rec.num_prefill_tokens), ("decode", rec.num_decode_tokens)):
            if n > 0:
                self.iteration_tokens[phase].observe(n)
        self.preemptions.inc(len(rec.preempted_request_ids))
        if self.vllm is not None:
            self.vllm.observe_iteration(rec)
        self.set_gauges(num_running, num_waiting, kv_usage, blocks_used)

    def observe_budget(self, rec: IterationRecord, coefficients: Mapping[str, float]) -> None:
        """The adaptive budget's decision for `rec` and the cost model it will plan the next with."""
        if rec.prefill_budget is not None:
            self.slo_budget.set(rec.prefill_budget)
        if rec.slo_tbt_s is not None:
            self.slo_target.set(rec.slo_tbt_s)
            if rec.num_decode_tokens and rec.duration_s > rec.slo_tbt_s:
                self.slo_missed.inc()
        if rec.predicted_ns is not None:
            self.slo_predicted.set(rec.predicted_ns / 1e9)
        if rec.slo_feasible is False:
            self.slo_infeasible.inc()
        for term, value in coefficients.items():
            self._cost_coefficient.labels(**self.const_labels, term=term).set(value)

    def set_gauges(self, num_running: int, num_waiting: int, kv_usage: float, blocks_used: int) -> None:
        """Queue and KV gauges; also set outside iterations (an abort on an idle engine)."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.kv_blocks_used.set(blocks_used)
        if self.vllm is not None:
            self.vllm.set_gauges(num_running, num_waiting, kv_usage)

    def observe_finished(self, m: RequestMetrics) -> None:
        """Everything a finished (or aborted) request contributes; phases it never reached are skipped."""
        _observe(self.ttft, [m.ttft_s])
        _observe(self.queue, [m.queue_s])
        _observe(self.tokenize, [m.tokenize_s])
        if m.prefill_chunks:
            _observe(self.prefill_compute, [m.prefill_compute_s])
            _observe(self.prefill_span, [m.prefill_span_s])
        _observe(self.decode, [m.decode_s])
        _observe(self.itl, m.itl_s)
        _observe(self.tpot, [m.tpot_s])
        _observe(self.e2e, [m.e2e_s])
        _observe(self.delivery, m.delivery_s)
        _observe(self.kv_transfer, [m.transfer_s])
        if m.kv_transfer_bytes is not None:
            self.kv_transfer_bytes.observe(m.kv_transfer_bytes)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(len(m.token_sampled_ns))
        reason = m.finish_reason or "error"
        if reason not in self.success:  # an unforeseen reason still gets a series
            self.success[reason] = self._success.labels(**self.const_labels, finished_reason=reason)
        self.success[reason].inc()
        if self.vllm is not None:
            self.vllm.observe_finished(m, reason)

    def add_prefix_cache(self, queries_tokens: int, hit_tokens: int) -> None:
        """Deltas since the last call, in tokens (as vLLM counts them)."""
        self.prefix_queries.inc(queries_tokens)
        self.prefix_hits.inc(hit_tokens)
        if self.vllm is not None:
            self.vllm.prefix_queries.inc(queries_tokens)
            self.vllm.prefix_hits.inc(hit_tokens)

    def render(self) -> bytes:
        """Prometheus text exposition format (what GET /metrics returns)."""
        return generate_latest(self.registry)


class VllmMetrics:
    """vLLM's metric names and labels (`model_name`, `engine`) fed from the same records as the
    phaselab_* ones; docs/metrics.md says where the definitions differ."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str) -> None:
        labels = {"model_name": model_name, "engine": engine}
        names = list(labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, registry=registry, buckets=buckets).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        R, S = REQUEST_SECONDS_BUCKETS, STEP_SECONDS_BUCKETS
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token (phaselab: arrived -> sent).", R)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency (gaps between sent tokens).", S)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Per request (e2e - ttft) / (n - 1).", S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", R)
        self.queue = histogram("vllm:request_queue_time_seconds", "Queued -> first scheduled.", R)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Prefill span (first to last chunk).", R)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token sampled -> finished.", R)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.output_len = histogram("vllm:request_generation_tokens", "Output tokens per request.", TOKEN_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step.", TOKEN_BUCKETS)
        self.running = gauge("vllm:num_requests_running", "Requests running.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (1 = 100%).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens (counted at finish).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens (counted at finish).")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter("vllm:request_success", "Finished requests by finished_reason.",
                                [*names, "finished_reason"], registry=registry)
        self._labels = labels
        self.success = {r: self._success.labels(**labels, finished_reason=r) for r in FINISHED_REASONS}

    def observe_iteration(self, rec: IterationRecord) -> None:
        total = rec.num_prefill_tokens + rec.num_decode_tokens
        if total > 0:
            self.iteration_tokens.observe(total)
        self.preemptions.inc(len(rec.preempted_request_ids))

    def set_gauges(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def observe_finished(self, m: RequestMetrics, reason: str) -> None:
        _observe(self.ttft, [m.ttft_s])
        _observe(self.itl, m.itl_s)
        _observe(self.tpot, [m.tpot_s])
        _observe(self.e2e, [m.e2e_s])
        _observe(self.queue, [m.queue_s])
        if m.prefill_chunks:
            _observe(self.prefill, [m.prefill_span_s])
        _observe(self.decode, [m.decode_s])
        self.prompt_len.observe(m.num_prompt_tokens)
        self.output_len.observe(len(m.token_sampled_ns))
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(len(m.token_sampled_ns))
        if reason not in self.success:
            self.success[reason] = self._success.labels(**self._labels, finished_reason=reason)
        self.success[reason].inc()


def _observe(hist: Histogram, values: Iterable[float | None]) -> None:
    for v in values:
        if v is not None:
            hist.observe(v)
