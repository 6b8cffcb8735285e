"""Token-id workloads for an engine in this process, and the one open-loop driver that runs them.

    Arrival            one request: token-id prompt, max_tokens, and the trigger that releases it
                       (a time offset, a number of tokens every request of a group has received,
                       or another request's end)
    run_arrivals       drives any engine (add_request / step / has_unfinished_requests) on the real
                       clock, open loop, greedy, ignoring EOS; used by `phaselab compare`, the
                       simulator's self-fidelity check (phaselab/sim/fidelity.py) and
                       benchmarks/disagg_interference.py
    interference_arrivals, sweep_arrivals   compare's two workloads as Arrivals

A request is stamped arrived at the moment its trigger fired (its scheduled time, for a timed
one) and, its prompt being token ids already, tokenized and queued then too; the driver adds it at
the next step boundary, as a server's engine thread would, so a step in progress counts as queue
time. Imports no torch: the engine is passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from phaselab.core.sampling_params import SamplingParams
from phaselab.workload.interference import InterferenceParams

PROMPT_TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary entries of the bundled model


@dataclass
class Arrival:
    """One request of a driven workload and the trigger that releases it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    group: str = "default"
    at_s: float | None = None  # seconds after the run's start
    after_group_tokens: tuple[str, int] | None = None  # every request of the group has >= n tokens (or finished)
    after_finished: str | tuple[str, ...] | None = None  # that request (every one of those) finished


@dataclass(frozen=True)
class Driven:
    """When a run_arrivals run started and ended (time.monotonic_ns)."""

    start_ns: int
    end_ns: int

    @property
    def makespan_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def ended_set(after_finished: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The request ids an `after_finished` trigger waits for (one id, or all of several)."""
    if after_finished is None:
        return ()
    return (after_finished,) if isinstance(after_finished, str) else tuple(after_finished)


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(*PROMPT_TOKEN_RANGE, size=n)]


def interference_arrivals(p: InterferenceParams, seed: int = 0) -> list[Arrival]:
    """Streams at t=0, then the long prompts, timed as `p` says (seconds or stream tokens)."""
    rng = np.random.default_rng(seed)
    out = [Arrival(f"stream-{i}", random_prompt(rng, p.stream_input_len), p.stream_output_len, "stream", at_s=0.0)
           for i in range(p.num_streams)]
    for k in range(p.num_long_prompts):
        prompt = random_prompt(rng, p.long_input_len)
        if p.token_timed:
            out.append(Arrival(f"long-{k}", prompt, p.long_output_len, "long",
                               after_group_tokens=("stream", p.long_arrival_tokens(k))))
        else:
            out.append(Arrival(f"long-{k}", prompt, p.long_output_len, "long", at_s=p.long_arrival_s(k)))
    return out


def sweep_arrivals(input_lens: Sequence[int], output_len: int = 4, seed: int = 1) -> list[Arrival]:
    """One request at a time (each after the previous finished): prefill alone at each length."""
    rng = np.random.default_rng(seed)
    out: list[Arrival] = []
    for n in input_lens:
        prev = out[-1].request_id if out else None
        out.append(Arrival(f"sweep-{n}", random_prompt(rng, n), output_len, "sweep",
                           at_s=0.0 if prev is None else None, after_finished=prev))
    return out


def _add(engine: Any, a: Arrival, arrived_ns: int) -> str:
    """Add one token-id request, stamped arrived (and, needing no tokenization, tokenized and queued)
    at `arrived_ns`."""
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # token-id prompts: tokenized before arrival; queued from the moment it arrived (the wait for the
    # step in progress is queueing, as in a server's engine thread)
    rid: str = engine.add_request(list(a.prompt), params, request_id=a.request_id, arrived_ns=arrived_ns,
                                  tokenized_ns=arrived_ns, queued_ns=arrived_ns)
    return rid


def run_arrivals(engine: Any, arrivals: Sequence[Arrival], on_progress: Callable[[int, int], None] | None = None,
                 poll_s: float = 0.01) -> Driven:
    """Run `arrivals` on an engine (LLMEngine or DisaggEngine: add_request / step /
    has_unfinished_requests: the ServingEngine surface) to completion, greedy, ignoring EOS, on the real clock.
    `on_progress(finished, total)` is called as requests finish."""
    t0 = time.monotonic_ns()
    # timed arrivals in time order, before the triggered ones (each kept in its given order)
    pending = sorted(arrivals, key=lambda a: (a.at_s is None, a.at_s or 0.0))
    groups: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    finished: set[str] = set()
    released: dict[int, float] = {}  # id(arrival) -> offset (s) at which a stuck trigger was released

    def at(a: Arrival) -> float | None:
        return released.get(id(a), a.at_s)

    def due(a: Arrival, now: int) -> bool:
        t = at(a)
        if t is not None:
            return now >= t0 + int(t * 1e9)
        if a.after_finished is not None:
            return all(r in finished for r in ended_set(a.after_finished))
        if a.after_group_tokens is not None:
            g, n = a.after_group_tokens
            members = groups.get(g, [])
            return bool(members) and all(tokens.get(r, 0) >= n or r in finished for r in members)
        return True

    while pending or engine.has_unfinished_requests():
        now = time.monotonic_ns()
        for a in [a for a in pending if due(a, now)]:
            pending.remove(a)
            t = at(a)
            rid = _add(engine, a, t0 + int(t * 1e9) if t is not None else now)
            groups.setdefault(a.group, []).append(rid)
        if engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    finished.add(out.request_id)
                    if on_progress:
                        on_progress(len(finished), len(arrivals))
        elif pending:
            timed = [t0 + int(t * 1e9) for a in pending if (t := at(a)) is not None]
            if not timed and not any(due(a, time.monotonic_ns()) for a in pending):
                # nothing runs and no trigger can fire any more: release the rest now
                for a in pending:
                    released[id(a)] = (time.monotonic_ns() - t0) / 1e9
                continue
            wait = poll_s if not timed else min(poll_s, max(0.0, (min(timed) - time.monotonic_ns()) / 1e9))
            time.sleep(wait)
    return Driven(t0, time.monotonic_ns())
