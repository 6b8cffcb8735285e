"""Chrome/Perfetto trace export: built from hand-made records, checked against the format's rules.

Perfetto's trace processor cannot run here (the `perfetto` package downloads its binary on first
use, and this machine is offline), so `validate_trace` stands in for it.
"""

from __future__ import annotations

import copy
import json

from phaselab.core.timing import (
    IterationRecord,
    ModeledCost,
    PrefillChunk,
    RequestMetrics,
    ScheduledChunk,
)
from phaselab.obs.perfetto import ITERATION_TID, build_trace, validate_trace, write_trace

MS = 1_000_000  # ns


def _iteration(worker: str, role: str, iteration_id: int, start: int, end: int,
               chunks: list[tuple[str, int, bool, int]], **kw: object) -> IterationRecord:
    scheduled = [ScheduledChunk(*c) for c in chunks]
    return IterationRecord(
        iteration_id=iteration_id, worker=worker, role=role, start_ns=start, end_ns=end,
        schedule_ns=100_000, prepare_ns=200_000, forward_ns=end - start - 500_000, sample_ns=100_000,
        output_ns=100_000,
        num_prefill_tokens=sum(c.num_tokens for c in scheduled if c.is_prefill),
        num_decode_tokens=sum(c.num_tokens for c in scheduled if not c.is_prefill),
        chunks=scheduled, num_blocks_used=len(chunks) + iteration_id, num_blocks_free=100 - iteration_id,
        num_running=len(chunks), num_waiting=1,
        modeled=ModeledCost(1000 + iteration_id, 10, 20, 300, 40), **kw,  # type: ignore[arg-type]
    )


def make_run() -> tuple[list[RequestMetrics], list[IterationRecord]]:
    """A colocated worker w0 (a: two prefill chunks; b; c: preempted after its first token and
    recomputed) and a disaggregated pair p0 -> d0 (d: KV transfer, first token sent by d0)."""
    its = [
        _iteration("w0", "colocated", 0, 1 * MS, 9 * MS, [("a", 4, True, 4)]),
        _iteration("w0", "colocated", 1, 10 * MS, 19 * MS, [("a", 2, True, 6), ("b", 3, True, 3)]),
        _iteration("w0", "colocated", 2, 20 * MS, 29 * MS,
                   [("a", 1, False, 7), ("b", 1, False, 4), ("c", 2, True, 2)]),
        _iteration("w0", "colocated", 3, 30 * MS, 39 * MS, [("a", 1, False, 8)], preempted_request_ids=["c"]),
        _iteration("w0", "colocated", 4, 40 * MS, 49 * MS, [("c", 3, True, 3)]),
        _iteration("p0", "prefill", 0, 2 * MS, 12 * MS, [("d", 5, True, 5)]),
        _iteration("d0", "decode", 0, 20 * MS, 22 * MS, [("d", 1, False, 6)]),
        _iteration("d0", "decode", 1, 23 * MS, 25 * MS, [("d", 1, False, 7)]),
    ]
    a = RequestMetrics(
        arrived_ns=0, tokenized_ns=200_000, queued_ns=300_000, first_scheduled_ns=1 * MS,
        prefill_chunks=[PrefillChunk(0, 1 * MS, 9 * MS, 4), PrefillChunk(1, 10 * MS, 19 * MS, 2)],
        first_token_sampled_ns=19 * MS, token_sampled_ns=[19 * MS, 29 * MS, 39 * MS], token_iteration_ids=[1, 2, 3],
        token_sent_ns=[19_100_000, 29_100_000, 39_100_000], finished_ns=39_200_000, finish_reason="length",
        request_id="a", num_prompt_tokens=6, num_output_tokens=3, worker="w0",
    )
    b = RequestMetrics(
        arrived_ns=5 * MS, tokenized_ns=5_100_000, queued_ns=5_200_000, first_scheduled_ns=10 * MS,
        prefill_chunks=[PrefillChunk(1, 10 * MS, 19 * MS, 3)], first_token_sampled_ns=19 * MS,
        token_sampled_ns=[19 * MS, 29 * MS], token_iteration_ids=[1, 2], token_sent_ns=[19_100_000, 29_100_000],
        finished_ns=29_200_000, finish_reason="stop", request_id="b", num_prompt_tokens=3, num_output_tokens=2,
        worker="w0",
    )
    c = RequestMetrics(
        arrived_ns=15 * MS, tokenized_ns=15_050_000, queued_ns=15_100_000, first_scheduled_ns=20 * MS,
        prefill_chunks=[PrefillChunk(2, 20 * MS, 29 * MS, 2)], recompute_chunks=[PrefillChunk(4, 40 * MS, 49 * MS, 3)],
        first_token_sampled_ns=29 * MS, token_sampled_ns=[29 * MS, 49 * MS], token_iteration_ids=[2, 4],
        token_sent_ns=[29_100_000, 49_100_000], preempted_ns=[30 * MS], resumed_ns=[40 * MS],
        finished_ns=49_200_000, finish_reason="stop", request_id="c", num_prompt_tokens=2, num_output_tokens=2,
        num_preemptions=1, worker="w0",
    )
    d = RequestMetrics(
        arrived_ns=1_500_000, tokenized_ns=1_600_000, queued_ns=1_700_000, first_scheduled_ns=2 * MS,
        prefill_chunks=[PrefillChunk(0, 2 * MS, 12 * MS, 5)], first_token_sampled_ns=12 * MS,
        kv_transfer_queued_ns=12_500_000, kv_transfer_start_ns=13 * MS, kv_transfer_end_ns=18 * MS,
        kv_transfer_bytes=40960, decode_admitted_ns=19 * MS,
        token_sampled_ns=[12 * MS, 22 * MS, 25 * MS], token_iteration_ids=[0, 0, 1],
        token_sent_ns=[19_500_000, 22_100_000, 25_100_000], finished_ns=25_200_000, finish_reason="length",
        request_id="d", num_prompt_tokens=5, num_output_tokens=3, worker="p0", decode_worker="d0",
    )
    return [a, b, c, d], its


def _by_ph(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_trace_is_valid_and_has_one_slice_per_iteration() -> None:
    requests, iterations = make_run()
    trace = build_trace(requests, iterations)
    assert validate_trace(trace) == []
    slices = [e for e in _by_ph(trace, "X") if e["cat"] == "iteration"]
    assert len(slices) == len(iterations)
    assert all(e["tid"] == ITERATION_TID for e in slices)
    assert json.loads(json.dumps(trace)) == trace  # plain JSON
    assert trace["displayTimeUnit"] == "ms" and trace["metadata"]["version"] == 1


def test_timestamps_are_microseconds_from_the_earliest_record() -> None:
    requests, iterations = make_run()
    trace = build_trace(requests, iterations)
    assert trace["metadata"]["t0_ns"] == 0
    first = next(e for e in _by_ph(trace, "X") if e["args"]["iteration_id"] == 0 and e["pid"] == 1)
    assert first["ts"] == 1000.0 and first["dur"] == 8000.0  # 1 ms .. 9 ms
    assert first["name"] == "iter 0 (P 4 / D 0)"
    assert first["args"]["requests"] == [["a", 4, "prefill"]]
    assert first["args"]["modeled_bytes"] == 1000 + 10 + 20 and first["args"]["modeled_flops"] == 340
    assert first["args"]["forward_ms"] == 7.5
    shifted = [copy.deepcopy(r) for r in requests]
    for r in shifted:
        r.arrived_ns += 7  # only the earliest timestamp moves t0
    assert build_trace(shifted, iterations)["metadata"]["t0_ns"] == 7


def test_processes_are_named_per_worker() -> None:
    requests, iterations = make_run()
    trace = build_trace(requests, iterations, process_names={"p0": "prefill worker"})
    names = {e["pid"]: e["args"]["name"] for e in _by_ph(trace, "M") if e["name"] == "process_name"}
    assert names == {1: "w0 (colocated)", 2: "prefill worker", 3: "d0 (decode)", 4: "requests"}
    per_pid = {pid: sum(1 for e in _by_ph(trace, "X") if e["pid"] == pid) for pid in names}
    assert per_pid == {1: 5, 2: 1, 3: 2, 4: 0}


def test_request_phases_counters_and_preemption() -> None:
    requests, iterations = make_run()
    trace = build_trace(requests, iterations)
    begins = {(e["id"], e["name"]) for e in _by_ph(trace, "b")}
    assert {("a", "queue"), ("a", "prefill chunk 0"), ("a", "prefill chunk 1"), ("a", "decode")} <= begins
    assert ("d", "kv transfer") in begins and ("c", "recompute chunk 0") in begins
    assert not any(rid == "a" and name == "kv transfer" for rid, name in begins)
    counters = _by_ph(trace, "C")
    assert len(counters) == 2 * len(iterations)
    assert {e["name"] for e in counters} == {"kv blocks", "requests"}
    instants = {(e["name"], e.get("args", {}).get("request_id")) for e in _by_ph(trace, "i")}
    assert {("preempted", "c"), ("resumed", "c")} <= instants
    assert any(e["name"] == "preempt" and e["args"]["request_ids"] == ["c"] for e in _by_ph(trace, "i"))


def test_flows_link_last_prefill_chunk_to_first_decode_iteration() -> None:
    requests, iterations = make_run()
    trace = build_trace(requests, iterations)
    flows = {e["args"]["request_id"]: {} for e in _by_ph(trace, "s")}
    for e in _by_ph(trace, "s") + _by_ph(trace, "f"):
        flows[e["args"]["request_id"]][e["ph"]] = e
    assert set(flows) == {"a", "b", "c", "d"}

    def enclosing(ev: dict) -> str:
        (slice_,) = [x for x in _by_ph(trace, "X") if x["pid"] == ev["pid"] and x["tid"] == ev["tid"]
                     and x["ts"] <= ev["ts"] <= x["ts"] + x["dur"]]
        return slice_["name"]

    assert enclosing(flows["a"]["s"]).startswith("iter 1 ") and enclosing(flows["a"]["f"]).startswith("iter 2 ")
    d = flows["d"]
    assert (d["s"]["pid"], d["f"]["pid"]) == (2, 3)  # prefill worker -> decode worker
    assert d["f"]["bp"] == "e"


def test_validator_catches_broken_traces() -> None:
    def errors(*events: dict) -> list[str]:
        return validate_trace({"traceEvents": list(events)})

    x = {"ph": "X", "name": "s", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0}
    assert errors(x, {**x, "ts": 10.0}) == []  # touching is fine
    assert errors(x, {**x, "ts": 5.0})  # iteration tracks never overlap
    nested = {**x, "tid": 2}
    assert errors(nested, {**nested, "ts": 2.0, "dur": 3.0}) == []  # nesting allowed elsewhere
    assert errors(nested, {**nested, "ts": 5.0, "dur": 10.0})  # partial overlap
    assert errors({**x, "dur": -1.0}) and errors({k: v for k, v in x.items() if k != "dur"})
    assert errors({**x, "ph": "Q"}) and errors({**x, "ts": "soon"})
    b = {"ph": "b", "cat": "request", "name": "queue", "id": "r", "pid": 4, "tid": 1, "ts": 5.0}
    assert errors(b, {**b, "ph": "e", "ts": 6.0}) == []
    assert errors(b, {**b, "ph": "e", "ts": 6.0, "name": "decode"})  # name mismatch: both unpaired
    assert errors(b, {**b, "ph": "e", "ts": 4.0})  # ends before it begins
    assert errors(b)
    s = {"ph": "s", "cat": "flow", "name": "f", "id": 1, "pid": 1, "tid": 1, "ts": 5.0}
    assert errors(s, {**s, "ph": "f", "bp": "e", "ts": 7.0}) == []
    assert errors(s) and errors(s, {**s, "ph": "f", "ts": 1.0})
    c = {"ph": "C", "name": "kv", "pid": 1, "tid": 1, "ts": 0.0, "args": {"used": 3}}
    assert errors(c) == [] and errors({**c, "args": {"used": "3"}}) and errors({**c, "args": {}})
    assert validate_trace({}) == ["traceEvents is missing or not a list"]


def test_write_trace(tmp_path) -> None:
    requests, iterations = make_run()
    trace = build_trace(requests, iterations)
    write_trace(tmp_path / "t.json", trace)
    assert json.loads((tmp_path / "t.json").read_text()) == trace


def test_empty_run() -> None:
    trace = build_trace([], [])
    assert validate_trace(trace) == []
    assert not _by_ph(trace, "X")
