"""`phaselab diagnose RUN --verify`: rerun the run's workload with the top suggestion and put the
prediction next to what happened.

The workload is what the run directory records: each request's arrival offset, prompt length and
output length (greedy, ignore_eos, so the same number of tokens). Prompt token ids are not
recorded, so the rerun draws random ones of the same lengths (a run that relied on the prefix
cache is not reproduced, and the report says so). The run is repeated twice on this machine, as
recorded ("before") and with the change ("after"): the measured change is after / before of the
same day's machine, set against the predicted change.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from phaselab.analysis import fmt
from phaselab.analysis.advice import LABEL
from phaselab.analysis.predict import FIGURES, Prediction, figures


@dataclass
class Verification:
    prediction: Prediction
    before: dict[str, float | None]  # rerun as recorded
    after: dict[str, float | None]  # rerun with the change
    notes: list[str]

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
            out.append(f"  {LABEL[n]:<16} {val(b):>10} {val(a):>10} {pct(pr):>10} {pct(me):>10}")
        out += [f"  note: {x}" for x in self.notes]
        return "\n".join(out) + "\n"


def workload(data: Any, seed: int = 0) -> tuple[list[Any], list[str]]:
    from phaselab.workload.driver import Arrival, random_prompt

    rng = np.random.default_rng(seed)
    ok = [m for m in data.requests if m.finish_reason not in ("abort", "error")]
    t0 = min((m.arrived_ns for m in ok), default=0)
    notes = []
    if any(m.num_cached_tokens for m in ok):
        notes.append("the run hit the prefix cache; the rerun's random prompts do not share prefixes")
    arrivals = [Arrival(m.request_id, random_prompt(rng, m.num_prompt_tokens), max(1, m.num_output_tokens),
                        at_s=(m.arrived_ns - t0) / 1e9) for m in sorted(ok, key=lambda m: m.arrived_ns)]
    return arrivals, notes


def _run(config: dict[str, Any], overrides: dict[str, Any], arrivals: list[Any], what: str) -> dict[str, float | None]:
    from phaselab.config import EngineArgs
    from phaselab.engine.engine import LLMEngine
    from phaselab.workload.driver import run_arrivals

    args = {k: v for k, v in (config.get("engine_args") or {}).items() if k in EngineArgs.__dataclass_fields__}
    if args.get("mode", "colocated") != "colocated":
        raise ValueError("--verify reruns one-engine runs only; rerun a disaggregated deployment with compare")
    engine = LLMEngine(EngineArgs(**{**args, **overrides}))

    def progress(done: int, total: int) -> None:
        print(f"\r  {what}: {done}/{total} requests", end="", file=sys.stderr, flush=True)

    run_arrivals(engine, arrivals, on_progress=progress)
    print(file=sys.stderr)
    return figures(list(engine.finished_requests))


def verify(path: str, prediction: Prediction) -> Verification:
    from phaselab.obs.rundir import read_run_dir

    data = read_run_dir(path)
    arrivals, notes = workload(data)
    before = _run(data.config, {}, arrivals, "as recorded")
    after = _run(data.config, prediction.change.engine_args, arrivals, f"with {prediction.change.flags}")
    return Verification(prediction, before, after, notes)
