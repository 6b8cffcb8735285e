"""Chrome Trace Event JSON (opens in ui.perfetto.dev and chrome://tracing) from the phase records.

Layout of one trace:

    pid 1..n  one process per worker
        tid 1   "iterations": one complete slice ("X") per scheduler iteration, never overlapping
        counters ("C"): "kv blocks" {used, free} and "requests" {running, waiting} per iteration
        instants ("i"): "preempt" at an iteration that preempted requests
    pid n+1   "requests": per request one async track (cat "request", id = request id):
                  queue -> prefill chunk 0..k -> [kv transfer] -> decode   (+ "recompute chunk k")
              instants "preempted" / "resumed"
    flows     ("s" -> "f", cat "flow"): the iteration of a request's last prefill chunk -> the
              iteration that sampled its second token (its first decode step), on whichever worker

Timestamps are microseconds relative to the earliest timestamp of the run (`metadata.t0_ns`,
a time.monotonic_ns() value); durations keep ns precision as fractional microseconds.
`validate_trace` checks the format's rules, because Perfetto's trace processor is not runnable
offline here (the `perfetto` package downloads its binary on first use).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from os import PathLike
from typing import Any

from phaselab.core.timing import IterationRecord, RequestMetrics

Event = dict[str, Any]

ITERATION_TID = 1
REQUEST_TID = 1
TRACE_FORMAT = "phaselab-trace"
TRACE_VERSION = 1
# float noise of ns -> us conversion; far below the 1 ns resolution of the records
_EPS_US = 1e-6


# -- building -----------------------------------------------------------------------------------------
def build_trace(
    requests: list[RequestMetrics],
    iterations: list[IterationRecord],
    process_names: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The whole run as a Chrome trace. `process_names` maps a worker to its display name
    (default: "<worker> (<role>)")."""
    t0 = _earliest_ns(requests, iterations)
    clock = _Clock(t0)
    workers = _workers(requests, iterations)
    pids = {w: i + 1 for i, w in enumerate(workers)}
    requests_pid = len(workers) + 1
    roles = {rec.worker: rec.role for rec in iterations}
    names = {w: (process_names or {}).get(w) or (f"{w} ({roles[w]})" if w in roles else w) for w in workers}

    events: list[Event] = []
    events += _process_metadata(pids, names, requests_pid)
    by_key: dict[tuple[str, int], Event] = {}
    for rec in iterations:
        slice_ = _iteration_slice(rec, pids[rec.worker], clock)
        by_key[(rec.worker, rec.iteration_id)] = slice_
        events.append(slice_)
        events += _iteration_counters(rec, pids[rec.worker], clock)
    for index, m in enumerate(requests):
        events += _request_events(m, m.request_id or f"#{index}", requests_pid, clock)
    for flow_id, m in enumerate(requests, start=1):
        events += _prefill_to_decode_flow(m, flow_id, by_key)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "t0_ns": t0,
            "clock": "time.monotonic_ns",
            "num_iterations": len(iterations),
            "num_requests": len(requests),
        },
    }


class _Clock:
    """ns timestamps -> trace microseconds relative to t0."""

    def __init__(self, t0_ns: int) -> None:
        self.t0_ns = t0_ns

    def us(self, ns: int) -> float:
        return round((ns - self.t0_ns) / 1000, 3)

    def dur(self, start_ns: int, end_ns: int) -> float:
        return round((end_ns - start_ns) / 1000, 3)


def _earliest_ns(requests: list[RequestMetrics], iterations: list[IterationRecord]) -> int:
    starts = [rec.start_ns for rec in iterations] + [m.arrived_ns for m in requests]
    return min(starts, default=0)


def _workers(requests: list[RequestMetrics], iterations: list[IterationRecord]) -> list[str]:
    """Workers in order of first appearance (iterations first: they own the tracks)."""
    seen: dict[str, None] = {}
    for rec in iterations:
        seen.setdefault(rec.worker)
    for m in requests:
        for w in (m.worker, m.decode_worker):
            if w:
                seen.setdefault(w)
    return list(seen)


def _process_metadata(pids: dict[str, int], names: dict[str, str], requests_pid: int) -> list[Event]:
    events: list[Event] = []
    for worker, pid in pids.items():
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": names[worker]}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": ITERATION_TID, "args": {"name": "iterations"}},
        ]
    events += [
        {"ph": "M", "name": "process_name", "pid": requests_pid, "tid": 0, "args": {"name": "requests"}},
        {"ph": "M", "name": "process_sort_index", "pid": requests_pid, "tid": 0, "args": {"sort_index": requests_pid}},
    ]
    return events


def _ms(ns: int) -> float:
    return round(ns / 1e6, 6)


def _iteration_slice(rec: IterationRecord, pid: int, clock: _Clock) -> Event:
    cost = rec.modeled
    return {
        "ph": "X",
        "cat": "iteration",
        "name": f"iter {rec.iteration_id} (P {rec.num_prefill_tokens} / D {rec.num_decode_tokens})",
        "pid": pid,
        "tid": ITERATION_TID,
        "ts": clock.us(rec.start_ns),
        "dur": clock.dur(rec.start_ns, rec.end_ns),
        "args": {
            "iteration_id": rec.iteration_id,
            "role": rec.role,
            "prefill_tokens": rec.num_prefill_tokens,
            "decode_tokens": rec.num_decode_tokens,
            "num_requests": len(rec.chunks),
            "requests": [[c.request_id, c.num_tokens, "prefill" if c.is_prefill else "decode"] for c in rec.chunks],
            "modeled_bytes": cost.total_bytes,
            "modeled_weight_bytes": cost.weight_bytes,
            "modeled_kv_read_bytes": cost.kv_read_bytes,
            "modeled_kv_write_bytes": cost.kv_write_bytes,
            "modeled_flops": cost.flops,
            "schedule_ms": _ms(rec.schedule_ns),
            "prepare_ms": _ms(rec.prepare_ns),
            "forward_ms": _ms(rec.forward_ns),
            "sample_ms": _ms(rec.sample_ns),
            "output_ms": _ms(rec.output_ns),
            "blocks_used": rec.num_blocks_used,
            "blocks_free": rec.num_blocks_free,
            "preempted": list(rec.preempted_request_ids),
            **({"prefill_budget": rec.prefill_budget, "budget_reason": rec.budget_reason,
                "slo_tbt_ms": _ms(round(rec.slo_tbt_s * 1e9)) if rec.slo_tbt_s is not None else None,
                "slo_feasible": rec.slo_feasible,
                "predicted_ms": _ms(rec.predicted_ns) if rec.predicted_ns is not None else None,
                "measured_ms": _ms(rec.end_ns - rec.start_ns)} if rec.prefill_budget is not None else {}),
        },
    }


def _iteration_counters(rec: IterationRecord, pid: int, clock: _Clock) -> list[Event]:
    ts = clock.us(rec.start_ns)
    events: list[Event] = [
        {"ph": "C", "name": "kv blocks", "pid": pid, "tid": ITERATION_TID, "ts": ts,
         "args": {"used": rec.num_blocks_used, "free": rec.num_blocks_free}},
        {"ph": "C", "name": "requests", "pid": pid, "tid": ITERATION_TID, "ts": ts,
         "args": {"running": rec.num_running, "waiting": rec.num_waiting}},
    ]
    if rec.prefill_budget is not None:  # the adaptive budget over time (docs/slo.md)
        events.append({"ph": "C", "name": "prefill budget (tokens)", "pid": pid, "tid": ITERATION_TID, "ts": ts,
                       "args": {"budget": rec.prefill_budget, "prefill": rec.num_prefill_tokens}})
        args = {"measured": _ms(rec.end_ns - rec.start_ns)}
        if rec.predicted_ns is not None:
            args["predicted"] = _ms(rec.predicted_ns)
        if rec.slo_tbt_s is not None:
            args["target"] = _ms(round(rec.slo_tbt_s * 1e9))
        events.append({"ph": "C", "name": "iteration time vs TBT target (ms)", "pid": pid, "tid": ITERATION_TID,
                       "ts": ts, "args": args})
        if rec.slo_feasible is False:
            events.append({"ph": "i", "s": "t", "name": "TBT target infeasible", "pid": pid, "tid": ITERATION_TID,
                           "ts": ts, "args": {"min_chunk_budget": rec.prefill_budget}})
    if rec.preempted_request_ids:
        events.append({"ph": "i", "s": "t", "name": "preempt", "pid": pid, "tid": ITERATION_TID, "ts": ts,
                       "args": {"request_ids": list(rec.preempted_request_ids)}})
    return events


def _request_events(m: RequestMetrics, rid: str, pid: int, clock: _Clock) -> list[Event]:
    """One async track per request (async id `rid`, unique in the run); the phases follow each
    other, transfer and recompute chunks nest in decode."""
    spans: list[tuple[str, int | None, int | None, dict[str, Any]]] = [
        ("queue", m.queued_ns, m.first_scheduled_ns, {}),
    ]
    for k, c in enumerate(m.prefill_chunks):
        spans.append((f"prefill chunk {k}", c.start_ns, c.end_ns,
                      {"iteration_id": c.iteration_id, "tokens": c.num_tokens}))
    spans.append(("decode", m.first_token_sampled_ns, m.finished_ns,
                  {"output_tokens": len(m.token_sampled_ns), "finish_reason": m.finish_reason}))
    spans.append(("kv transfer", m.kv_transfer_start_ns, m.kv_transfer_end_ns, {"bytes": m.kv_transfer_bytes}))
    for k, c in enumerate(m.recompute_chunks):
        spans.append((f"recompute chunk {k}", c.start_ns, c.end_ns,
                      {"iteration_id": c.iteration_id, "tokens": c.num_tokens}))
    events: list[Event] = []
    for name, start, end, args in spans:
        if start is None or end is None:
            continue
        common = {"cat": "request", "name": name, "id": rid, "pid": pid, "tid": REQUEST_TID}
        events.append({**common, "ph": "b", "ts": clock.us(start), "args": {"request_id": rid, **args}})
        events.append({**common, "ph": "e", "ts": clock.us(end)})
    for name, stamps in (("preempted", m.preempted_ns), ("resumed", m.resumed_ns)):
        for ts in stamps:
            events.append({"ph": "i", "s": "p", "name": name, "pid": pid, "tid": REQUEST_TID,
                           "ts": clock.us(ts), "args": {"request_id": rid}})
    return events


def _prefill_to_decode_flow(m: RequestMetrics, flow_id: int, by_key: dict[tuple[str, int], Event]) -> list[Event]:
    """Arrow from the last prefill chunk's iteration to the first decode iteration (the one that
    sampled token 1). Both ends sit mid-slice so each binds to its enclosing iteration."""
    if not m.prefill_chunks or len(m.token_iteration_ids) < 2:
        return []
    src = by_key.get((m.worker, m.prefill_chunks[-1].iteration_id))
    dst = by_key.get((m.decode_worker or m.worker, m.token_iteration_ids[1]))
    if src is None or dst is None:
        return []
    common = {"cat": "flow", "name": "prefill -> decode", "id": flow_id, "args": {"request_id": m.request_id}}
    return [
        {**common, "ph": "s", "pid": src["pid"], "tid": src["tid"], "ts": _mid(src)},
        {**common, "ph": "f", "bp": "e", "pid": dst["pid"], "tid": dst["tid"], "ts": _mid(dst)},
    ]


def _mid(slice_: Event) -> float:
    return round(slice_["ts"] + slice_["dur"] / 2, 3)


def write_trace(path: str | PathLike[str], trace: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))


# -- validation -----------------------------------------------------------------------------------------
_REQUIRED: dict[str, tuple[str, ...]] = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "B": ("name", "ts", "pid", "tid"),
    "E": ("ts", "pid", "tid"),
    "b": ("name", "cat", "ts", "pid"),
    "e": ("name", "cat", "ts", "pid"),
    "n": ("name", "cat", "ts", "pid"),
    "s": ("name", "cat", "id", "ts", "pid", "tid"),
    "t": ("name", "cat", "id", "ts", "pid", "tid"),
    "f": ("name", "cat", "id", "ts", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "i": ("name", "ts", "pid", "tid"),
    "I": ("name", "ts", "pid", "tid"),
    "M": ("name", "pid", "args"),
}
_METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def validate_trace(trace: dict[str, Any], strict_tids: Iterable[int] = (ITERATION_TID,)) -> list[str]:
    """Violations of the trace-event format's rules (empty: valid).

    Checked: required fields per phase, numeric timestamps, non-negative durations; complete
    slices on one (pid, tid) track nest only when fully contained, and on `strict_tids` tracks
    (phaselab's iteration tracks) do not overlap at all; every async "b" has an "e" with the same
    pid/cat/id/name no earlier; flows pair one "s" with one "f" no earlier; counter args are numbers.
    """
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        return ["traceEvents is missing or not a list"]
    errors: list[str] = []
    valid: list[Event] = []
    for i, ev in enumerate(events):
        problems = _event_problems(ev)
        errors += [f"event {i}: {p}" for p in problems]
        if not problems:
            valid.append(ev)
    errors += _slice_overlaps(valid, set(strict_tids))
    errors += _async_pairs(valid)
    errors += _flow_pairs(valid)
    return errors


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _event_problems(ev: Any) -> list[str]:
    if not isinstance(ev, dict):
        return ["not an object"]
    ph = ev.get("ph")
    if ph not in _REQUIRED:
        return [f"unknown phase {ph!r}"]
    problems = [f"{ph!r} lacks {key!r}" for key in _REQUIRED[ph] if key not in ev]
    if ph in ("b", "e", "n") and "id" not in ev and "id2" not in ev:
        problems.append(f"{ph!r} lacks 'id' (or 'id2')")
    if "ts" in ev and not _is_number(ev["ts"]):
        problems.append(f"ts {ev['ts']!r} is not a number")
    if ph == "X" and "dur" in ev and not (_is_number(ev["dur"]) and ev["dur"] >= 0):
        problems.append(f"dur {ev['dur']!r} is not a non-negative number")
    if ph == "C" and not (isinstance(ev.get("args"), dict) and ev["args"]
                          and all(_is_number(v) for v in ev["args"].values())):
        problems.append(f"counter {ev.get('name')!r} args are not all numbers")
    if ph == "M" and ev.get("name") not in _METADATA_NAMES:
        problems.append(f"unknown metadata name {ev.get('name')!r}")
    if ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
        problems.append(f"instant scope {ev.get('s')!r} is not g, p or t")
    return problems


def _slice_overlaps(events: list[Event], strict_tids: set[int]) -> list[str]:
    tracks: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            tracks[(ev["pid"], ev["tid"])].append(ev)
    errors: list[str] = []
    for (pid, tid), slices in tracks.items():
        check = _track_overlaps if tid in strict_tids else _track_partial_overlaps
        errors += [f"track ({pid}, {tid}): {e}" for e in check(slices)]
    return errors


def _track_overlaps(slices: list[Event]) -> list[str]:
    """Strict track: each slice starts at or after every earlier one ends (touching is fine)."""
    errors: list[str] = []
    latest_end, latest = -math.inf, ""
    for ev in sorted(slices, key=lambda e: (e["ts"], e["dur"])):
        if ev["ts"] + _EPS_US < latest_end:
            errors.append(f"{ev['name']!r} overlaps {latest!r}")
        if ev["ts"] + ev["dur"] > latest_end:
            latest_end, latest = ev["ts"] + ev["dur"], ev["name"]
    return errors


def _track_partial_overlaps(slices: list[Event]) -> list[str]:
    """Nesting track: a slice that starts inside another must also end inside it."""
    errors: list[str] = []
    enclosing: list[tuple[float, str]] = []  # (end, name), innermost last
    for ev in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        while enclosing and enclosing[-1][0] <= start + _EPS_US:
            enclosing.pop()
        if enclosing and end > enclosing[-1][0] + _EPS_US:
            errors.append(f"{ev['name']!r} partially overlaps {enclosing[-1][1]!r}")
        enclosing.append((end, ev["name"]))
    return errors


def _async_key(ev: Event) -> tuple[Any, ...]:
    ident = ev.get("id", json.dumps(ev.get("id2"), sort_keys=True))
    return (ev["pid"], ev["cat"], str(ident), ev["name"])


def _async_pairs(events: list[Event]) -> list[str]:
    open_begins: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    errors: list[str] = []
    # stable sort: at equal timestamps the file order decides (a zero-length phase is b then e)
    for ev in sorted((e for e in events if e["ph"] in ("b", "e")), key=lambda e: e["ts"]):
        key = _async_key(ev)
        if ev["ph"] == "b":
            open_begins[key].append(ev["ts"])
        elif open_begins[key]:
            open_begins[key].pop()
        else:
            errors.append(f"async end {key} has no earlier begin")
    errors += [f"async begin {key} never ends" for key, left in open_begins.items() for _ in left]
    return errors


def _flow_pairs(events: list[Event]) -> list[str]:
    starts: dict[tuple[Any, Any], list[float]] = defaultdict(list)
    finishes: dict[tuple[Any, Any], list[float]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "s":
            starts[(ev["cat"], ev["id"])].append(ev["ts"])
        elif ev["ph"] == "f":
            finishes[(ev["cat"], ev["id"])].append(ev["ts"])
    errors: list[str] = []
    for key in starts.keys() | finishes.keys():
        s, f = starts.get(key, []), finishes.get(key, [])
        if len(s) != 1 or len(f) != 1:
            errors.append(f"flow {key}: {len(s)} start(s) and {len(f)} finish(es), want one each")
        elif f[0] + _EPS_US < s[0]:
            errors.append(f"flow {key}: finish at {f[0]} before start at {s[0]}")
    return errors
