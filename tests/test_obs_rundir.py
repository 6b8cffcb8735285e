"""Run directory round trip, and the derived durations it writes (TTFT tiled into its phases)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaselab.core.timing import TTFT_COMPONENTS, PrefillChunk, RequestMetrics
from phaselab.obs.prometheus import EngineMetrics
from phaselab.obs.rundir import RunDirError, read_run_dir, write_run_dir
from phaselab.obs.perfetto import validate_trace
from tests.test_obs_trace import MS, make_run


# -- TTFT components ----------------------------------------------------------------------------------
def test_ttft_components_tile_ttft_colocated_chunked() -> None:
    a = make_run()[0][0]  # arrived 0; prefill chunks 1-9 ms and 10-19 ms; first token sent 19.1 ms
    parts = a.ttft_components_ns()
    assert list(parts) == list(TTFT_COMPONENTS)
    assert parts == {
        "tokenize": 200_000, "admission": 100_000, "queue": 700_000, "schedule_to_prefill": 0,
        "prefill_compute": 17 * MS, "prefill_wait": 1 * MS, "post_prefill": 0,
        "transfer_queue": 0, "transfer": 0, "decode_admission": 0, "delivery": 100_000,
    }
    assert sum(parts.values()) == 19_100_000
    assert sum(a.ttft_components().values()) == pytest.approx(a.ttft_s, abs=1e-12)
    assert a.prefill_wait_s == pytest.approx(0.001) and a.admission_s == pytest.approx(0.0001)


def test_ttft_components_disaggregated_first_token_sent_by_decode_worker() -> None:
    d = make_run()[0][3]
    parts = d.ttft_components_ns()
    assert parts == {
        "tokenize": 100_000, "admission": 100_000, "queue": 300_000, "schedule_to_prefill": 0,
        "prefill_compute": 10 * MS, "prefill_wait": 0, "post_prefill": 0,
        "transfer_queue": 1 * MS,  # first token sampled 12 ms -> transfer start 13 ms
        "transfer": 5 * MS, "decode_admission": 1 * MS, "delivery": 500_000,
    }
    assert sum(parts.values()) == d.first_token_sent_ns - d.arrived_ns == 18 * MS
    assert d.transfer_queue_s == pytest.approx(0.0005) and d.transfer_s == pytest.approx(0.005)
    assert d.decode_admission_wait_s == pytest.approx(0.001)


def test_ttft_components_first_token_sent_before_the_transfer() -> None:
    d = copy.deepcopy(make_run()[0][3])
    d.token_sent_ns[0] = 12_100_000  # the prefill side streams the first token itself
    parts = d.ttft_components_ns()
    assert parts["transfer_queue"] == parts["transfer"] == parts["decode_admission"] == 0
    assert parts["delivery"] == 100_000
    assert sum(parts.values()) == d.first_token_sent_ns - d.arrived_ns == 10_600_000  # type: ignore[operator]


def test_ttft_components_with_gaps_and_no_send() -> None:
    # no tokenize/queue stamps, one chunk, nothing sent (offline without delivery): TTFT ends at sampling
    m = RequestMetrics(arrived_ns=100, first_scheduled_ns=150, prefill_chunks=[PrefillChunk(0, 160, 400, 8)],
                       first_token_sampled_ns=420, token_sampled_ns=[420])
    parts = m.ttft_components_ns()
    assert parts["queue"] == 50 and parts["schedule_to_prefill"] == 10 and parts["prefill_compute"] == 240
    assert parts["post_prefill"] == 20 and parts["delivery"] == 0
    assert sum(parts.values()) == 320
    assert RequestMetrics(arrived_ns=5).ttft_components_ns() == {}  # no first token yet


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_ttft_components_always_tile_exactly(data: st.DataObject) -> None:
    """Any subset of milestones, in any order after arrival: non-negative parts summing to TTFT."""
    stamp = st.one_of(st.none(), st.integers(min_value=0, max_value=10**9))
    arrived = data.draw(st.integers(min_value=0, max_value=10**6))
    chunks = sorted(data.draw(st.lists(st.integers(min_value=arrived, max_value=10**9), max_size=6)))
    m = RequestMetrics(
        arrived_ns=arrived, tokenized_ns=data.draw(stamp), queued_ns=data.draw(stamp),
        first_scheduled_ns=data.draw(stamp),
        prefill_chunks=[PrefillChunk(k, a, b, 1) for k, (a, b) in enumerate(zip(chunks[::2], chunks[1::2]))],
        first_token_sampled_ns=data.draw(st.integers(min_value=arrived, max_value=10**9)),
        kv_transfer_queued_ns=data.draw(stamp), kv_transfer_start_ns=data.draw(stamp),
        kv_transfer_end_ns=data.draw(stamp), decode_admitted_ns=data.draw(stamp),
    )
    m.token_sent_ns = [data.draw(st.integers(min_value=m.first_token_sampled_ns, max_value=2 * 10**9))]
    parts = m.ttft_components_ns()
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == m.token_sent_ns[0] - m.arrived_ns


def test_derived_per_token_lists() -> None:
    a = make_run()[0][0]
    assert a.delivery_s == pytest.approx([0.0001] * 3)
    assert a.itl_s == pytest.approx([0.01, 0.01])
    assert a.decode_s == pytest.approx(0.0202)


# -- the directory --------------------------------------------------------------------------------------
@dataclass
class _Knob:
    name: str
    sizes: tuple[int, ...]


def write_sample(path, with_metrics: bool = True) -> tuple[list, list, bytes]:
    requests, iterations = make_run()
    metrics = EngineMetrics({"worker": "w0"})
    for m in requests:
        metrics.observe_finished(m)
    text = metrics.render()
    config = {"model": {"name": "tiny"}, "dtype": "bfloat16", "knob": _Knob("x", (1, 2))}
    write_run_dir(path, requests, iterations, config, text if with_metrics else None)
    return requests, iterations, text


def test_round_trip_is_exact(tmp_path) -> None:
    requests, iterations, text = write_sample(tmp_path / "run")
    run = read_run_dir(tmp_path / "run")
    assert run.requests == requests
    assert run.iterations == iterations
    assert run.metrics_text == text
    assert run.config["format"] == "phaselab-run" and run.config["version"] == 1
    assert isinstance(run.config["created"], str) and run.config["created"][:2] == "20"
    assert run.config["model"] == {"name": "tiny"} and run.config["knob"] == {"name": "x", "sizes": [1, 2]}


def test_files_and_labelled_fields(tmp_path) -> None:
    requests, iterations, _ = write_sample(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json", "requests.jsonl", "iterations.jsonl", "trace.json", "metrics.prom"}
    lines = [json.loads(s) for s in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [d["record"] for d in lines] == ["request"] * len(requests)
    a = lines[0]
    assert a["request_id"] == "a" and a["arrived_ns"] == 0
    assert a["token_sent_ns"] == [19_100_000, 29_100_000, 39_100_000]
    assert a["prefill_chunks"][1] == {"iteration_id": 1, "start_ns": 10 * MS, "end_ns": 19 * MS, "num_tokens": 2}
    assert a["ttft_s"] == pytest.approx(0.0191) and a["prefill_wait_s"] == pytest.approx(0.001)
    assert a["itl_s"] == pytest.approx([0.01, 0.01]) and a["transfer_s"] is None
    assert sum(a["ttft_components_s"].values()) == pytest.approx(a["ttft_s"])
    its = [json.loads(s) for s in (tmp_path / "iterations.jsonl").read_text().splitlines()]
    assert len(its) == len(iterations) and all(d["record"] == "iteration" for d in its)
    assert "modeled" not in its[0]
    assert {k for k in its[0] if k.startswith("modeled_")} == {
        "modeled_weight_bytes", "modeled_kv_read_bytes", "modeled_kv_write_bytes", "modeled_matmul_flops",
        "modeled_attention_flops", "modeled_kv_repeat_read_bytes", "modeled_total_bytes", "modeled_flops"}
    assert its[0]["chunks"] == [{"request_id": "a", "num_tokens": 4, "is_prefill": True, "context_len": 4}]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert validate_trace(trace) == []
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(iterations)


def test_without_metrics_and_caller_dated(tmp_path) -> None:
    requests, iterations = make_run()
    write_run_dir(tmp_path, requests, iterations, {"created": "2025-01-01T00:00:00+00:00"})
    run = read_run_dir(tmp_path)
    assert run.metrics_text is None and not (tmp_path / "metrics.prom").exists()
    assert run.config["created"] == "2025-01-01T00:00:00+00:00"


def test_reading_what_is_not_a_run(tmp_path) -> None:
    with pytest.raises(RunDirError, match="config.json is missing"):
        read_run_dir(tmp_path)
    write_sample(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "version": 2}))
    with pytest.raises(RunDirError, match="version 2"):
        read_run_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with open(tmp_path / "requests.jsonl", "a") as f:
        f.write('{"record": "request", "arrived_')
    with pytest.raises(RunDirError, match="requests.jsonl:5"):
        read_run_dir(tmp_path)


def test_newer_fields_are_ignored_and_missing_ones_default(tmp_path) -> None:
    """Forward/backward tolerance within a version: unknown keys skipped, absent fields defaulted."""
    write_sample(tmp_path)
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    d = json.loads(lines[0])
    d["some_future_field"] = 1
    del d["decode_worker"]
    (tmp_path / "requests.jsonl").write_text(json.dumps(d) + "\n")
    (m,) = read_run_dir(tmp_path).requests
    assert m.request_id == "a" and m.decode_worker is None
