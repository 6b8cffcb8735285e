"""The one reader of the trace format (JSONL, Mooncake keys too), for the bench and the simulator.

    {"arrival_s": 0.5, "input_tokens": 812, "output_tokens": 64}      one request per line

Arrival: `arrival_s`/`timestamp_s` (seconds) or `timestamp_ms`/`timestamp` (milliseconds, as in
the Mooncake traces). Input: `prompt` (text) or `input_tokens`/`input_length`/`prompt_tokens`.
Output: `output_tokens`/`output_length`/`max_tokens`. Optional `request_id`, `group`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from phaselab.workload.lengths import WorkloadError

# Trace keys, first match wins. Arrival: seconds, or milliseconds (Mooncake's "timestamp").
TRACE_ARRIVAL_S = ("arrival_s", "timestamp_s")
TRACE_ARRIVAL_MS = ("timestamp_ms", "timestamp")
TRACE_INPUT_TOKENS = ("input_tokens", "input_length", "prompt_tokens")
TRACE_OUTPUT_TOKENS = ("output_tokens", "output_length", "max_tokens")


def read_trace_rows(path: str, num_prompts: int | None = None) -> list[tuple[float, dict[str, Any]]]:
    """(arrival in seconds, row) of every request line of a trace JSONL, in file order: the one
    reader of the trace format, shared with the simulator. Raises WorkloadError naming the line."""
    rows: list[tuple[float, dict[str, Any]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{lineno}: not JSON ({e.msg})") from e
            arrival = first_of(row, TRACE_ARRIVAL_S)
            if arrival is None and (ms := first_of(row, TRACE_ARRIVAL_MS)) is not None:
                arrival = ms / 1000.0
            if arrival is None:
                raise WorkloadError(f"{path}:{lineno}: no arrival time (one of {TRACE_ARRIVAL_S + TRACE_ARRIVAL_MS})")
            rows.append((float(arrival), row))
            if num_prompts is not None and len(rows) >= num_prompts:
                break
    if not rows:
        raise WorkloadError(f"{path} holds no requests")
    return rows


def first_of(row: dict[str, Any], keys: Sequence[str]) -> Any:
    """The value of the first of `keys` that the row holds (not None), else None."""
    for k in keys:
        if row.get(k) is not None:
            return row[k]
    return None


