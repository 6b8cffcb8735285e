"""`phaselab plan --verify`: run the planned configurations for real on this machine and put the
measured figures next to the predicted ones (issue 17, item 3).

    calibration runs  (unless --params): the plan's workload on a chunked engine with the bundled
                      model, every request at once (at each planned budget) and spread out (at the
                      largest); the simulator's cost parameters are fitted to their iterations
                      (cost/record_fit.py, Verifier.calibrate), so prediction and measurement share a load
    plan              the search of phaselab/experiments/plan.py with those parameters
    verification      the top colocated configurations, each at its planned rate R (its predicted
                      goodput): the same seeded requests (random token ids of the same lengths,
                      the same arrival times, EOS ignored) run through the engine in process with the
                      same scheduler options (workload/driver.run_arrivals), and simulated again;
                      --verify-runs times each (3), alternated between the configurations
    compared          attainment at R, and goodput at R = the requests meeting both SLOs per second
                      of the run (first arrival to last finish), predicted vs measured (the median
                      run); a configuration whose goodput is off by more than --verify-tolerance (20%)
                      fails the plan (exit 3)

The measured runs' run directories go to --verify-dir when given (rank-I/run-J/requests.jsonl: what
the measured figures count). The planning target stays the simulator's; this only checks it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from phaselab.errors import ConfigError

KV_CACHE_MEMORY = "1GiB"
LIGHT_SPAN_S = 8.0  # the spread-out calibration pass: its arrivals span this long


@dataclass
class MeasuredRun:
    """One real run of a configuration at its planned rate."""

    attainment: float
    goodput: float  # requests meeting both SLOs per second of the run
    loadavg_1m: float  # this machine's load when the run started
    run_dir: str | None = None


@dataclass
class VerifyRow:
    """A configuration's prediction and its real runs. The measured figures are the median run's: the
    runs alternate with the other configurations', so a minute in which this shared machine ran slow
    (its speed probes moved 10-33% within a minute) falls on one run of each, not on every run of one;
    each run is kept and shown."""

    configuration: str
    rate: float  # the planned rate (predicted goodput, DistServe)
    num_requests: int
    attainment_predicted: float
    goodput_predicted: float  # good requests / s of the simulated run at `rate`
    runs: list[MeasuredRun] = dataclasses.field(default_factory=list)

    def _median(self, values: list[float]) -> float:
        return float(statistics.median(values)) if values else 0.0

    @property
    def attainment_measured(self) -> float:
        return self._median([r.attainment for r in self.runs])

    @property
    def goodput_measured(self) -> float:
        return self._median([r.goodput for r in self.runs])

    @property
    def loadavg_1m(self) -> float:
        """The highest load any of its runs started under."""
        return max((r.loadavg_1m for r in self.runs), default=0.0)

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted goodput; inf when the prediction is 0 and the measure is not."""
        if self.goodput_predicted > 0:
            return (self.goodput_measured - self.goodput_predicted) / self.goodput_predicted
        return 0.0 if self.goodput_measured == 0 else float("inf")

    def within(self, tolerance: float) -> bool:
        return abs(self.error) <= tolerance

    def to_json(self, tolerance: float) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "attainment_measured": self.attainment_measured,
                "goodput_measured": self.goodput_measured, "loadavg_1m": self.loadavg_1m,
                "goodput_error": self.error, "within_tolerance": self.within(tolerance)}


def attainment_and_goodput(requests: Sequence[Any], ttft_s: float, tpot_s: float) -> tuple[float, float]:
    """The share of requests meeting both SLOs (sim.report.slo_attainment's rule) and goodput: those
    requests per second of the run (first arrival to last finish); (0, 0) for no requests."""
    from phaselab.sim.summary import slo_attainment

    if not requests:
        return 0.0, 0.0
    attainment = slo_attainment(requests, ttft_s, tpot_s)
    span = (max(m.finished_ns for m in requests) - min(m.arrived_ns for m in requests)) / 1e9
    return attainment, round(attainment * len(requests)) / span if span > 0 else 0.0


class Verifier:
    """The bundled model, loaded once; a fresh engine per run."""

    def __init__(self, dtype: str = "auto", log: Callable[[str], None] | None = None) -> None:
        from phaselab.engine.engine import resolve_dtype
        from phaselab.model.loader import load_checkpoint

        self.log = log or (lambda text: print(text, file=sys.stderr))
        self.dtype, why = resolve_dtype(dtype)
        self.log(f"verify: loading the bundled model ({self.dtype}: {why})")
        self.checkpoint = load_checkpoint(None, self.dtype)
        self.model = self.checkpoint.config
        self.dtype_bytes = 4 if str(self.dtype).endswith("float32") else 2

    def host_hardware(self) -> Any:
        """This host's ceilings, measured now with the model, dtype and threads that will run
        (engine/ceilings.py, a few seconds): what the calibration's efficiencies are fractions of.
        The catalog's `cpu` entry is an earlier session's CPU; bounded by it on an AMD EPYC that
        measured 815 bf16 GFLOP/s against its 180, the fit was capped at efficiency 1 everywhere, its
        calibration runs predicted 1.61x their measured total, and every plan verified 8-37% faster
        than predicted. Bounded by this host's: 1.01x."""
        from phaselab.engine.ceilings import measure_ceilings
        from phaselab.cost.catalog_files import hardware_from_dict

        ceilings = measure_ceilings(self.model, self.dtype, log=self.log)
        return hardware_from_dict(ceilings, "measured now on this host by phaselab plan --verify")

    def engine(self, sched: Any, max_model_len: int) -> Any:
        from phaselab.engine_args import EngineArgs
        from phaselab.core.config import scheduler_options
        from phaselab.serving_engine import make_engine

        args = EngineArgs(dtype=str(self.dtype).removeprefix("torch."), kv_cache_memory=KV_CACHE_MEMORY,
                          max_model_len=max_model_len, **scheduler_options(sched))
        return make_engine(args, checkpoint=self.checkpoint)

    def run(self, sched: Any, requests: Sequence[Any], run_dir: str | None = None) -> tuple[list[Any], float]:
        """The simulator's requests for real (same lengths and arrival offsets); their metrics and the
        load average at the start."""
        import numpy as np

        from phaselab.workload.driver import Arrival, random_prompt, run_arrivals

        rng = np.random.default_rng(0)
        arrivals = [Arrival(r.request_id, random_prompt(rng, r.num_prompt_tokens),
                            r.output_len if r.output_len is not None else r.max_tokens, "plan",
                            at_s=r.offset_ns / 1e9) for r in requests]
        max_len = max(r.num_prompt_tokens + (r.output_len or r.max_tokens) for r in requests) + 1
        engine = self.engine(sched, max(max_len, 64))
        load = os.getloadavg()[0]
        run_arrivals(engine, arrivals)
        metrics = list(engine.finished_requests)
        if run_dir is not None:
            engine.write_record(run_dir)
        engine.shutdown()
        return metrics, load

    def calibrate(self, workload_at: Callable[[float], list[Any]], budgets: Sequence[int], hardware: Any) -> Any:
        """Cost parameters fitted to runs of the plan's workload on this machine, bounded by `hardware`'s
        ceilings:

        all at once    every request at time 0 (prefill chunks of every size the budget allows, then
                       decode batches shrinking as they finish): a first pass at the largest budget
                       pays first-touch costs and is not fitted, then one fitted pass per planned
                       budget (a fit on the largest alone was measured 62% off for 64-token chunks:
                       their per-iteration costs were extrapolated)
        spread out     the workload at the rate that spans LIGHT_SPAN_S, at the largest budget: the
                       narrow iterations (a few decodes, one short chunk) that a planned rate runs
                       most of, which the passes at once reach only in their tails
        the wide step  above the engine's max_native_rows rows the linear layers leave the one-row
                       kernel for the batched GEMM at a fixed cost per iteration (cost/record_fit.py's
                       wide_overhead_s), fitted apart: averaged into the other terms, the iterations
                       of a chunked-64 plan's real run measured 1.21x their prediction when wide and
                       0.56x when narrow, and the plan verified at 6% attainment against 94%

        Weighted in seconds (`absolute`): what a rate's goodput depends on is the run's total time,
        which the other weightings bias low."""
        import numpy as np

        from phaselab.core.config import SchedulerConfig
        from phaselab.cost.record_fit import fit_params, iteration_cycles
        from phaselab.workload.driver import Arrival, random_prompt, run_arrivals

        requests = workload_at(1.0)
        spread = workload_at(len(requests) / LIGHT_SPAN_S)
        max_len = max(max(r.num_prompt_tokens + (r.output_len or r.max_tokens) for r in requests) + 1, 64)
        rng = np.random.default_rng(1)
        passes = [(f"at-once-{k}", budget, [0.0] * len(requests))
                  for k, budget in enumerate([max(budgets), *budgets])]
        passes.append(("spread", max(budgets), [r.offset_ns / 1e9 for r in spread]))
        iters: list[Any] = []
        wide_rows = 0  # the engine's LinearDecision.wide_rows, the same on every pass
        for k, (name, budget, offsets) in enumerate(passes):
            self.log(f"verify: calibration pass {k + 1}/{len(passes)} ({name}, budget {budget}, "
                     f"{len(requests)} requests{'' if k else ', not fitted'})")
            sched = SchedulerConfig.resolve(policy="chunked", max_num_batched_tokens=budget, max_num_seqs=256,
                                            max_model_len=max_len)
            engine = self.engine(sched, max_len)
            wide_rows = engine.linear.wide_rows
            run_arrivals(engine, [Arrival(f"calibration-{name}-{r.request_id}",
                                          random_prompt(rng, r.num_prompt_tokens), r.output_len or r.max_tokens,
                                          "calibration", at_s=at) for r, at in zip(requests, offsets)])
            if k:
                iters += sorted(engine.iterations, key=lambda it: it.start_ns)
            engine.shutdown()
        fit = fit_params(iters, iteration_cycles(iters), self.model, hardware, self.dtype_bytes,
                         "plan --verify calibration run", weighting="absolute", wide_rows=wide_rows)
        summary = fit.summary()
        self.log(f"verify: calibrated on {len(iters)} iterations ({len(requests)} requests at once at budgets "
                 f"{', '.join(map(str, budgets))}, then spread over {LIGHT_SPAN_S:.0f} s; wide step above "
                 f"{wide_rows} rows): |error| p50 {summary['relative_error_abs_p50']:.0%}, "
                 f"total {summary['total_time_error']:+.0%}")
        return fit.params


def verify(ranked: Sequence[Any], workload_at: Callable[[float], list[Any]], slo: Any, verifier: Verifier,
           top: int, tolerance: float, run_dir: str | None = None, runs: int = 3) -> list[VerifyRow]:
    """Run the first `top` colocated candidates of `ranked` for real at their planned rate, `runs`
    times each, alternated (rank 1, rank 2, rank 1, ...); run j of rank i is written to
    run_dir/rank-i/run-j."""
    from phaselab.sim.loop import simulate
    from phaselab.workload.arrivals import ArrivalPlan

    if runs < 1:
        raise ConfigError(f"--verify-runs must be >= 1 (got {runs})")
    chosen = [c for c in ranked if c.error is None and c.rate > 0 and c.deployment.mode == "colocated"][:top]
    if not chosen:
        raise ConfigError("no colocated configuration met the SLOs in simulation: nothing to verify; loosen "
                          "--slo-ttft-ms / --slo-tbt-ms or --attainment")
    rows, workloads = [], []
    for c in chosen:
        requests = workload_at(c.rate)
        predicted = simulate(c.deployment, requests, ArrivalPlan(self_timed=True), record_iterations=False).requests
        rows.append(VerifyRow(c.deployment.describe(), c.rate, len(requests),
                              *attainment_and_goodput(predicted, slo.ttft_s, slo.tpot_s)))
        workloads.append(requests)
    for j in range(1, runs + 1):
        for i, (c, row, requests) in enumerate(zip(chosen, rows, workloads), start=1):
            d = c.deployment
            where = None if run_dir is None else os.path.join(run_dir, f"rank-{i}", f"run-{j}")
            verifier.log(f"verify run {j}/{runs} of [{i}/{len(chosen)}] {d.describe()} at {c.rate:.3g} req/s: "
                         f"{len(requests)} requests")
            measured, load = verifier.run(d.scheduler_config(d.colocated), requests, where)
            row.runs.append(MeasuredRun(*attainment_and_goodput(measured, slo.ttft_s, slo.tpot_s), load, where))
            verifier.log(f"  attainment {row.runs[-1].attainment:.0%} (predicted {row.attainment_predicted:.0%}), "
                         f"goodput {row.runs[-1].goodput:.3g}/s (predicted {row.goodput_predicted:.3g}/s)")
    return rows


def render(rows: Sequence[VerifyRow], tolerance: float) -> str:
    lines = ["verified on this machine (the bundled model, in process): goodput at the planned rate = requests "
             "meeting both SLOs per second of the run",
             f"{'rank':>4}  {'rate':>8}  {'attain pred':>11}  {'attain meas':>11}  {'goodput pred':>12}  "
             f"{'goodput meas':>12}  {'error':>6}  {'load':>4}  verdict  configuration"]
    for i, r in enumerate(rows, start=1):
        verdict = "ok" if r.within(tolerance) else "OFF"
        lines.append(f"{i:>4}  {r.rate:>6.3g}/s  {r.attainment_predicted:>11.0%}  {r.attainment_measured:>11.0%}  "
                     f"{r.goodput_predicted:>10.3g}/s  {r.goodput_measured:>10.3g}/s  {r.error:>+6.0%}  "
                     f"{r.loadavg_1m:>4.1f}  {verdict:<7}  {r.configuration}")
        if len(r.runs) > 1:
            lines.append(f"{'':>4}  runs (median above): goodput "
                         f"{', '.join(f'{m.goodput:.3g}/s' for m in r.runs)}; attainment "
                         f"{', '.join(f'{m.attainment:.0%}' for m in r.runs)}")
    off = [i for i, r in enumerate(rows, start=1) if not r.within(tolerance)]
    if off:
        lines.append(f"VERIFY FAILED: measured goodput off the prediction by more than {tolerance:.0%} for rank(s) "
                     f"{', '.join(map(str, off))}; recalibrate on a run of this machine (`phaselab simulate calibrate "
                     "RUN_DIR`, or drop --params to calibrate now), or rerun when the machine is quieter (load above)")
    else:
        lines.append(f"verify passed: every measured goodput within {tolerance:.0%} of the prediction")
    return "\n".join(lines)
