"""Prometheus metrics: render() parses with prometheus-client's own parser and counts what was fed."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phaselab.core.timing import RequestMetrics
from phaselab.obs.prometheus import EngineMetrics
from tests.test_obs_trace import make_run

LABELS = {"worker": "w0", "role": "colocated", "model": "tiny"}


def parse(metrics: EngineMetrics) -> dict[str, list]:
    """family name -> samples."""
    return {f.name: f.samples for f in text_string_to_metric_families(metrics.render().decode())}


def value(samples: list, suffix: str, **labels: str) -> float:
    (v,) = [s.value for s in samples if s.name.endswith(suffix) and labels.items() <= s.labels.items()]
    return v


def fed() -> tuple[EngineMetrics, list[RequestMetrics]]:
    requests, iterations = make_run()
    metrics = EngineMetrics(LABELS)
    for rec in iterations:
        metrics.observe_iteration(rec, rec.num_running, rec.num_waiting, kv_usage=0.25, blocks_used=rec.num_blocks_used)
    for m in requests:
        metrics.observe_finished(m)
    metrics.add_prefix_cache(queries_tokens=16, hit_tokens=4)
    metrics.add_prefix_cache(queries_tokens=4, hit_tokens=4)
    return metrics, requests


PER_REQUEST = [
    "phaselab_time_to_first_token_seconds", "phaselab_request_queue_time_seconds",
    "phaselab_request_tokenize_time_seconds", "phaselab_request_prefill_compute_seconds",
    "phaselab_request_prefill_span_seconds", "phaselab_request_decode_time_seconds",
    "phaselab_time_per_output_token_seconds", "phaselab_e2e_request_latency_seconds",
]


@pytest.mark.parametrize("name", PER_REQUEST)
def test_request_histograms_count_every_finished_request(name: str) -> None:
    metrics, requests = fed()
    samples = parse(metrics)[name]
    assert value(samples, "_count") == len(requests) == 4
    assert value(samples, "_bucket", le="+Inf") == 4


def test_histogram_values() -> None:
    metrics, requests = fed()
    fams = parse(metrics)
    assert value(fams["phaselab_time_to_first_token_seconds"], "_sum") == pytest.approx(
        sum(m.ttft_s for m in requests))  # type: ignore[misc]
    assert value(fams["phaselab_time_to_first_token_seconds"], "_bucket", le="0.02") == 4  # 19.1, 19.1, 14.1, 18 ms
    # every gap and every token, not one value per request
    assert value(fams["phaselab_inter_token_latency_seconds"], "_count") == 2 + 1 + 1 + 2
    assert value(fams["phaselab_token_delivery_seconds"], "_count") == 3 + 2 + 2 + 3
    # KV transfer only where it happened (request d)
    assert value(fams["phaselab_kv_transfer_seconds"], "_count") == 1
    assert value(fams["phaselab_kv_transfer_seconds"], "_sum") == pytest.approx(0.005)
    assert value(fams["phaselab_kv_transfer_bytes"], "_sum") == 40960


def test_counters_gauges_and_iterations() -> None:
    metrics, _ = fed()
    fams = parse(metrics)
    assert value(fams["phaselab_prompt_tokens"], "_total") == 6 + 3 + 2 + 5
    assert value(fams["phaselab_generation_tokens"], "_total") == 3 + 2 + 2 + 3
    success = fams["phaselab_request_success"]
    assert {r: value(success, "_total", finished_reason=r) for r in ("stop", "length", "abort", "error")} == {
        "stop": 2, "length": 2, "abort": 0, "error": 0}
    assert value(fams["phaselab_iterations"], "_total") == 8
    assert value(fams["phaselab_num_preemptions"], "_total") == 1
    assert value(fams["phaselab_prefix_cache_queries"], "_total") == 20
    assert value(fams["phaselab_prefix_cache_hits"], "_total") == 8
    # iteration token histograms: prefill where an iteration had prefill tokens (w0: 0,1,2,4; p0: 0)
    tokens = fams["phaselab_iteration_tokens"]
    assert value(tokens, "_count", phase="prefill") == 5 and value(tokens, "_sum", phase="prefill") == 4 + 5 + 2 + 3 + 5
    assert value(tokens, "_count", phase="decode") == 4 and value(tokens, "_sum", phase="decode") == 2 + 1 + 1 + 1
    assert value(fams["phaselab_iteration_duration_seconds"], "_count") == 8
    # gauges hold the last iteration's values (d0 iteration 1)
    assert value(fams["phaselab_num_requests_running"], "") == 1
    assert value(fams["phaselab_num_requests_waiting"], "") == 1
    assert value(fams["phaselab_kv_cache_usage_ratio"], "") == 0.25
    assert value(fams["phaselab_kv_cache_blocks_used"], "") == 2


def test_every_sample_carries_the_constant_labels() -> None:
    metrics, _ = fed()
    for name, samples in parse(metrics).items():
        assert name.startswith("phaselab_")
        for s in samples:
            assert LABELS.items() <= s.labels.items(), s


def test_aborted_in_queue_counts_where_it_has_a_value() -> None:
    metrics = EngineMetrics()
    metrics.observe_finished(RequestMetrics(arrived_ns=0, tokenized_ns=10, queued_ns=20, finished_ns=1_000,
                                            finish_reason="abort", request_id="x", num_prompt_tokens=3))
    fams = parse(metrics)
    assert value(fams["phaselab_e2e_request_latency_seconds"], "_count") == 1
    assert value(fams["phaselab_time_to_first_token_seconds"], "_count") == 0
    assert value(fams["phaselab_request_decode_time_seconds"], "_count") == 0
    assert value(fams["phaselab_request_success"], "_total", finished_reason="abort") == 1


def test_two_engines_in_one_process_do_not_clash() -> None:
    prefill = EngineMetrics({"worker": "p0", "role": "prefill"})
    decode = EngineMetrics({"worker": "d0", "role": "decode"})
    requests, _ = make_run()
    prefill.observe_finished(requests[0])
    assert value(parse(prefill)["phaselab_e2e_request_latency_seconds"], "_count") == 1
    assert value(parse(decode)["phaselab_e2e_request_latency_seconds"], "_count") == 0
    assert EngineMetrics().registry is not EngineMetrics().registry
