"""A recorded run's workload, as a rerun (`diagnose --verify`) and a simulation of it under another
configuration (analysis/predict.py) both need it: each request's arrival, prompt and output
lengths, the shared prefix it hit in the cache, and what released it.

What released a request is not in the records; it is read from them. A request that arrived
within CLOSED_LOOP_GAP_S after another request ended (its last token sent, or its finish) was
released by that end: a closed-loop client (`bench --concurrency`, a chained workload) sends its
next request when its last one returns. Rerun or simulated at its recorded time instead, it
would arrive before that request ended wherever the changed configuration is slower (queueing
behind a step it never met) and after it wherever it is faster, and a request that reuses the
prefix its predecessor cached would miss the cache. The window is a few ms: the in-process
driver adds a released request within microseconds of the end, a client on localhost within a
few ms, and an open-loop arrival lands that close to some end by chance only at a rate of
(ends per second x 5 ms): each such request is named in the notes. Over HTTP from `bench
--concurrency 4` on a 2-core machine the client's turnaround measured 0.7-5.3 ms (19 of 20 within
5 ms); where most arrivals of a run came within 5 ms of an end the run is closed-loop and the
window widens to 20 ms, so a slower turnaround (a loaded client) is not read as an open-loop
arrival. Where several requests ended in
the same step, which of them released the request is not recorded: it waits for all of them
(under a changed configuration they may end apart; it is then released by the last).

Prompt token ids are not recorded either. Where the run's prompts repeated an earlier request's
beginning (`num_repeat_tokens`, counted by the scheduler whether the prefix cache was on or off;
at least the cache hits), the rerun's prompts share one prefix, each request as many tokens of it
as it repeated at its first admission, and the request that began with it first (the latest
earlier one long enough, itself without a repeat) carries it whole: one shared root, a system
prompt's shape; nested or several distinct prefixes are approximated by it. So a run made with the
cache off reruns with the cache on (a suggested change) against prompts that share what the
recorded ones shared.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CLOSED_LOOP_GAP_S = 0.005
WIDE_GAP_S = 0.02  # the window once most arrivals came within CLOSED_LOOP_GAP_S of an end (a closed-loop run)
TIE_S = 0.001  # ends this close together came from one step: a request released then waits for all of them


@dataclass(frozen=True)
class RecordedRequest:
    request_id: str
    offset_s: float  # arrival after the run's first arrival (used when after_finished is None)
    num_prompt_tokens: int
    num_output_tokens: int
    shared_prefix: int  # tokens of the run's one shared prefix that the prompt starts with
    after_finished: tuple[str, ...] | None  # released when these requests had ended (closed loop)


def _end_ns(m: Any) -> int | None:
    ends = [t for t in (m.finished_ns, m.token_sent_ns[-1] if m.token_sent_ns else None) if t is not None]
    return max(ends) if ends else None


def recorded_workload(requests: Sequence[Any], gap_s: float = CLOSED_LOOP_GAP_S) -> tuple[list[RecordedRequest], list[str]]:
    """The workload of a run's request records (RequestMetrics), in arrival order; aborted and
    failed requests are left out. Returns (requests, notes for the user)."""
    ok = sorted((m for m in requests if m.finish_reason not in ("abort", "error")), key=lambda m: m.arrived_ns)
    notes: list[str] = []
    t0 = ok[0].arrived_ns if ok else 0
    # a prompt's shared beginning: what it repeated of an earlier request (counted cache on or off), or
    # at least what it hit (a run recorded before repeats were)
    cached = [max(m.num_cached_tokens, getattr(m, "num_repeat_tokens", 0)) for m in ok]
    longest, repeated = max(cached, default=0), sum(cached)
    if longest:
        first = next(k for k, c in enumerate(cached) if c)
        source = next((k for k in range(first - 1, -1, -1)
                       if not cached[k] and ok[k].num_prompt_tokens > cached[first]), None)
        if source is not None:
            cached[source] = min(longest, ok[source].num_prompt_tokens - 1)
        hits = sum(m.num_cached_tokens for m in ok)
        notes.append(f"the run's prompts repeated an earlier request's beginning ({repeated} tokens, {hits} of them "
                     f"prefix-cache hits); the rerun's prompts share one random {longest}-token prefix, as many "
                     "tokens of it as each request repeated"
                     + ("" if source is not None else " (no earlier request long enough to have begun with it: "
                        "the first repeat is new in the rerun)"))
    ends = sorted((e, m.request_id) for m in ok if (e := _end_ns(m)) is not None)
    end_times = [e for e, _ in ends]
    # per request: the index of the latest end at or before its arrival, and how long after it it came
    latest = [bisect.bisect_right(end_times, m.arrived_ns) - 1 for m in ok]
    gaps = [m.arrived_ns - end_times[k] if k >= 0 else None for m, k in zip(ok, latest)]
    after_an_end = [g for g in gaps if g is not None]
    window = gap_s
    if after_an_end and 2 * sum(g <= gap_s * 1e9 for g in after_an_end) >= len(after_an_end):
        window = max(gap_s, WIDE_GAP_S)  # a closed-loop run: a client's slower turnarounds count too
    gap_ns, tie_ns = round(window * 1e9), round(TIE_S * 1e9)
    out = []
    released = []
    for m, c, k, g in zip(ok, cached, latest, gaps):
        parents: tuple[str, ...] | None = None
        if g is not None and g <= gap_ns:
            # every request that ended with the latest one (in the same step): which of them released
            # this one is not recorded, so it waits for all of them
            lo = bisect.bisect_left(end_times, end_times[k] - tie_ns)
            parents = tuple(sorted(rid for _, rid in ends[lo:k + 1]))
            released.append(m.request_id)
        out.append(RecordedRequest(m.request_id, (m.arrived_ns - t0) / 1e9, m.num_prompt_tokens,
                                   max(1, m.num_output_tokens), c, parents))
    if released:
        shown = ", ".join(released[:4]) + (f" and {len(released) - 4} more" if len(released) > 4 else "")
        wide = (f" (most arrivals came within {gap_s * 1e3:g} ms of an end: a closed-loop run, so the window "
                f"is {window * 1e3:g} ms)") if window > gap_s else ""
        notes.append(f"{len(released)} of {len(out)} requests arrived within {window * 1e3:g} ms of another's end "
                     f"({shown}): each is released by that end, as a closed-loop client sends it, not at its "
                     "recorded time" + wide)
    return out, notes
