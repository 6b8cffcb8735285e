"""`phaselab diagnose RUN --verify`: rerun the run's workload with the top suggestion and put the
prediction next to what happened.

The workload is what the run directory records: each request's arrival offset, prompt length and
output length (greedy, ignore_eos, so the same number of tokens), read by workload/rerun.py: a
request that arrived within a few ms of another's end is released by that end (a closed-loop
client), the others at their recorded offsets. Prompt token ids are not recorded, so the rerun
draws random ones of the same lengths; where the run hit the prefix cache, the prompts share one
random prefix, each request as many tokens of it as it hit. The run is repeated on this machine as recorded
("before") and with the change ("after"), in alternating rounds (before, after, after, before for
two rounds), so a drift of the machine's load during the reruns moves both sides alike; each side's
figure is the mean of its runs, and the measured change (after / before) is set against the
predicted one. The spread between a side's own runs is reported: it is the measurement's noise.

Why not compare with the recorded run itself: on a shared machine the same workload rerun minutes
later measured 70% slower (queue scenario, TTFT p50 2.4 s recorded, 4.0 s rerun), more than most
changes' effect; only reruns side by side measure the change rather than the machine's drift.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phaselab.analysis import fmt
from phaselab.analysis.advice import LABEL
from phaselab.analysis.predict import FIGURES, Prediction, figures


@dataclass
class Verification:
    prediction: Prediction
    before: dict[str, float | None]  # rerun as recorded (mean of its runs)
    after: dict[str, float | None]  # rerun with the change (mean of its runs)
    notes: list[str]
    runs: dict[str, list[dict[str, float | None]]] = field(default_factory=dict)  # side -> each run's figures

    def spread(self, name: str) -> float | None:
        """The largest relative difference between two runs of the same side: the rerun's noise."""
        out = None
        for side in self.runs.values():
            vals = [v for r in side if (v := r.get(name)) is not None]
            if len(vals) >= 2 and min(vals) > 0:
                d = (max(vals) - min(vals)) / min(vals)
                out = d if out is None else max(out, d)
        return out

    def measured_relative(self, name: str) -> float | None:
        b, a = self.before.get(name), self.after.get(name)
        return (a - b) / b if b and a is not None else None

    def rows(self) -> list[tuple[str, float | None, float | None, float | None, float | None]]:
        return [(n, self.before.get(n), self.after.get(n), self.prediction.relative(n), self.measured_relative(n))
                for n in FIGURES]

    def text(self) -> str:
        out = [f"verify `{self.prediction.change.flags}`: the recorded workload rerun as recorded and with the change",
               f"  {'figure':<16} {'before':>10} {'after':>10} {'predicted':>10} {'measured':>10}"]
        for n, b, a, pr, me in self.rows():
            val = (lambda v: f"{v:.1f}" if v is not None else "—") if n == "output_tokens_per_s" else fmt.s
            pct = (lambda v: f"{v:+.0%}" if v is not None else "—")
            noise = self.spread(n)
            span = self.prediction.range(n)  # the readings of what the calibration run could not separate
            predicted = f"{span[0]:+.0%}..{span[1]:+.0%}" if span else pct(pr)
            out.append(f"  {LABEL[n]:<16} {val(b):>10} {val(a):>10} {predicted:>10} {pct(me):>10}"
                       + (f"   (runs of one side differ by up to {noise:.0%})" if noise is not None else ""))
        out += [f"  note: {x}" for x in self.notes]
        return "\n".join(out) + "\n"


def workload(data: Any, seed: int = 0) -> tuple[list[Any], list[str]]:
    """The run's workload as Arrivals (workload/rerun.py): random prompt ids of the recorded lengths,
    the shared prefix where the run hit the cache, closed-loop requests released by their
    predecessor's end and the rest at their recorded offsets."""
    from phaselab.workload.driver import Arrival, random_prompt
    from phaselab.workload.rerun import recorded_workload

    rng = np.random.default_rng(seed)
    recorded, notes = recorded_workload(data.requests)
    shared = random_prompt(rng, max((r.shared_prefix for r in recorded), default=0))
    arrivals = [Arrival(r.request_id, shared[:r.shared_prefix] + random_prompt(rng, r.num_prompt_tokens - r.shared_prefix),
                        r.num_output_tokens, at_s=None if r.after_finished else r.offset_s,
                        after_finished=r.after_finished) for r in recorded]
    return arrivals, notes


@contextlib.contextmanager
def _recorded_linear_path(config: dict[str, Any], overrides: dict[str, Any]) -> Iterator[None]:
    """Build the rerun's engine on the linear path the run recorded (config.json's `linear`: path,
    batched GEMM, native row count, four-row pass, prefetch distance), forced by their environment variables, unless
    the change is about the weights or dtype. Left to `--weights auto`, the rerun would measure again
    and may choose another path: a run made on a dense checkpoint (the bf16 kernel) was rerun on the
    Q4_1 kernel, whose per-row cost made a batch of 4 cost 32 ms a step where the run's path took 26
    ms, and the prediction, made for the run's path, was judged against another engine. The row count up to which the kernel runs
    (max_native_rows) and the four-row pass are pinned too: a forced path runs no probe and took the
    default row count, 16, where the run's probe had measured 64, so the rerun's batch-32 decode
    steps ran the GEMM on a weight widened per call (138 ms a step against the run's 100), and
    `--max-num-seqs 16`, predicted at -43% ITL p50, measured -57% against that other engine."""
    from phaselab import envs
    from phaselab.model.kernels.linear_probe import rows4_text

    lin = config.get("linear") or {}
    if "weights" in overrides or "dtype" in overrides or not isinstance(lin, dict):
        lin = {}
    rows = lin.get("max_native_rows")
    pinned = {envs.LINEAR.name: lin.get("path"), envs.BATCHED.name: lin.get("batched"),
              envs.NATIVE_ROWS.name: None if rows is None or lin.get("path") == "torch" else str(rows),
              envs.ROWS4_MIN.name: rows4_text(lin["rows4_min"]) if lin.get("rows4_min") else None,
              envs.PREFETCH_BYTES.name: str(lin["prefetch_bytes"]) if lin.get("prefetch_bytes") else None}
    saved = {k: os.environ.get(k) for k in pinned}
    try:
        for k, v in pinned.items():
            if v:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(config: dict[str, Any], overrides: dict[str, Any], arrivals: list[Any], what: str) -> dict[str, float | None]:
    from phaselab.engine_args import EngineArgs
    from phaselab.serving_engine import make_engine
    from phaselab.workload.driver import run_arrivals

    args = {k: v for k, v in (config.get("engine_args") or {}).items() if k in EngineArgs.__dataclass_fields__}
    if args.get("mode", "colocated") != "colocated":
        raise ValueError("--verify reruns one-engine runs only; rerun a disaggregated deployment with compare")
    with _recorded_linear_path(config, overrides):
        engine = make_engine(EngineArgs(**{**args, **overrides}))

    def progress(done: int, total: int) -> None:
        print(f"\r  {what}: {done}/{total} requests", end="", file=sys.stderr, flush=True)

    try:
        run_arrivals(engine, arrivals, on_progress=progress)
    finally:
        engine.shutdown()
    print(file=sys.stderr)
    return figures(list(engine.finished_requests))


def client_figures(results: list[Any]) -> dict[str, float | None]:
    """The user-facing figures (analysis/predict.py FIGURES) of a client's view of a run
    (bench/client_metrics.py RequestResult, ok requests): TTFT and E2E from the POST, ITL between content
    chunks, output tokens over first POST -> last stream end."""
    from phaselab.analysis.stats import percentile

    ok = [r for r in results if r.ok and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    t0 = min((r.sent_ns for r in ok if r.sent_ns is not None), default=0)
    t1 = max((r.sent_ns + round(r.e2e_s * 1e9) for r in ok if r.sent_ns is not None and r.e2e_s is not None),
             default=0)
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "longest_pause_s": max(itl, default=None),
            "e2e_mean_s": sum(e2e) / len(e2e) if e2e else None,
            "output_tokens_per_s": sum(r.num_output_tokens for r in ok) / ((t1 - t0) / 1e9) if t1 > t0 else None}


async def _drive_http(url: str, arrivals: list[Any], what: str) -> list[Any]:
    """Send the arrivals to a server as a client would: each at its offset, or when every request
    it waits for has ended (a closed loop); prompts as token ids, ignore_eos, greedy."""
    import asyncio
    import time

    from phaselab.bench.client import ClientConfig, StreamingClient, first_model, new_record
    from phaselab.bench.client_metrics import derive
    from phaselab.workload.driver import ended_set
    from phaselab.workload.request_spec import RequestSpec

    cfg = ClientConfig(base_url=url, model=await first_model(url), endpoint="completions", ignore_eos=True)
    ended = {a.request_id: asyncio.Event() for a in arrivals}
    records: list[Any] = []
    done = 0
    async with StreamingClient(cfg) as client:
        t0 = time.monotonic_ns()

        async def one(a: Any) -> None:
            nonlocal done
            for dep in ended_set(a.after_finished):
                if dep in ended:
                    await ended[dep].wait()
            if a.at_s is not None:
                await asyncio.sleep(max(0.0, t0 / 1e9 + a.at_s - time.monotonic_ns() / 1e9))
            spec = RequestSpec(a.request_id, "", a.max_tokens, len(a.prompt), prompt_token_ids=a.prompt)
            rec = new_record(spec, time.monotonic_ns())
            records.append(rec)
            try:
                await client.send(spec, rec)
            finally:
                ended[a.request_id].set()
                done += 1
                print(f"\r  {what}: {done}/{len(arrivals)} requests", end="", file=sys.stderr, flush=True)

        await asyncio.gather(*(one(a) for a in arrivals))
    print(file=sys.stderr)
    results = [derive(r, t0) for r in records]
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} of {len(results)} requests of the rerun failed (first: "
                           f"{failed[0].status}: {failed[0].error}); check that server, then verify again")
    return results


def _run_http(url: str, arrivals: list[Any], what: str) -> dict[str, float | None]:
    import asyncio

    return client_figures(asyncio.run(_drive_http(url, arrivals, what)))


def _mean(runs: list[dict[str, float | None]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for n in FIGURES:
        vals = [v for r in runs if (v := r.get(n)) is not None]
        out[n] = sum(vals) / len(vals) if vals else None
    return out


def verify(path: str, prediction: Prediction, rounds: int = 2, before_url: str | None = None,
           after_url: str | None = None) -> Verification:
    """Rerun the recorded workload as recorded and with the change, `rounds` times each, in the order
    before, after, after, before, ... (module docstring). With `before_url` and `after_url` the
    reruns go to those servers (the deployment as recorded, and with the change) through the
    OpenAI API, and each side's figures are its client's view; a disaggregated run is verified only
    so, since its workers and the link between them cannot be rebuilt in this process."""
    from phaselab.obs.rundir import read_run_dir

    data = read_run_dir(path)
    if (before_url is None) != (after_url is None):
        raise ValueError("give both --before-url (the deployment as recorded) and --after-url (with "
                         f"`{prediction.change.flags}`), or neither to rerun in this process")
    if before_url is None and data.config.get("mode") == "disagg":
        raise ValueError("a disaggregated run's workers and the link between them cannot be rebuilt in this "
                         "process: serve it as recorded and with `" + prediction.change.flags + "`, and pass "
                         "their addresses: --before-url URL --after-url URL")
    arrivals, notes = workload(data)
    if before_url is not None:
        notes.append(f"reruns sent to {before_url} (as recorded) and {after_url} (with the change); figures "
                     "from the client's view (TTFT from the POST)")
    runs: dict[str, list[dict[str, float | None]]] = {"before": [], "after": []}
    for k in range(rounds):
        for side in (("before", "after") if k % 2 == 0 else ("after", "before")):
            what = "as recorded" if side == "before" else f"with {prediction.change.flags}"
            what = f"[{k + 1}/{rounds}] {what}"
            if before_url is not None:
                runs[side].append(_run_http(before_url if side == "before" else str(after_url), arrivals, what))
            else:
                overrides = {} if side == "before" else prediction.change.engine_args
                runs[side].append(_run(data.config, overrides, arrivals, what))
    return Verification(prediction, _mean(runs["before"]), _mean(runs["after"]), notes, runs)


def verify_top(diag: Any, ns: argparse.Namespace) -> int:
    """`phaselab diagnose RUN --verify`: verify the highest-ranked suggested change of `diag`; print
    the side-by-side table and write verify.json beside the run (or under --out)."""
    import json
    from pathlib import Path

    # the highest-ranked finding whose change the prediction supports; the ones above it say why not
    rank = next((k for k, f in enumerate(diag.findings) if f.prediction is not None and f.suggested), None)
    for k, f in enumerate(diag.findings[:rank]):
        why = ("no engine knob changes it (its advice is above)" if f.prediction is None else
               f"`{f.prediction.change.flags}` is not suggested (its prediction is above)")
        print(f"phaselab diagnose --verify: skipping #{k + 1} {f.cause}: {why}", file=sys.stderr)
    top = diag.findings[rank] if rank is not None else None
    if top is None or top.prediction is None:
        print("phaselab diagnose --verify: no finding has a suggested change to verify; verify a change by hand "
              "with `phaselab compare`, or rerun with the change and diagnose both runs", file=sys.stderr)
        return 2
    print(f"phaselab diagnose --verify: verifying #{rank + 1} {top.cause}: "
          f"`{top.prediction.change.flags}`", file=sys.stderr)
    try:
        v = verify(ns.run_dir, top.prediction, before_url=ns.before_url, after_url=ns.after_url)
    except ValueError as e:
        print(f"phaselab diagnose --verify: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(v.text())
    if not ns.no_write:
        out = Path(ns.out or ns.run_dir) / "verify.json"
        out.write_text(json.dumps({"cause": top.cause, "flags": top.prediction.change.flags,
                                   "rows": [{**dict(zip(("figure", "before", "after", "predicted_change",
                                                         "measured_change"), r)), "spread": v.spread(r[0]),
                                             "predicted_range": top.prediction.range(r[0])}
                                            for r in v.rows()],
                                   "runs": v.runs, "notes": v.notes}, indent=2) + "\n", encoding="utf-8")
    return 0
