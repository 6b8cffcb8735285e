"""The predicted effect of a suggested change: the run's own workload, simulated with the engine's
own scheduler and a cost model calibrated on the run itself, before and after the change.

    run dir ─▶ replay_inputs (sim/replay.py): deployment, requests at their real arrival offsets
            ─▶ calibrate (cost/record_fit.py): the cost model's efficiencies fitted to the run's iterations
            ─▶ simulate as recorded ("before") and with the change ("after")
            ─▶ predicted after = measured x (simulated after / simulated before), per figure

Where the run cannot separate what a change depends on (every decode step at one batch: the step's
cost from each sequence's), the calibration is repeated with each of the two coefficients pinned at
0 (all per step, all per sequence: both fit the run), the change is simulated under each reading,
and the prediction carries the range (`Prediction.range`). On a decode-kv run whose decodes all ran
32 sequences, `--max-num-seqs 16` was predicted at -45% ITL p99 by the fit alone and measured at
-29%.

Scaling the measured figure by the simulated ratio cancels the cost model's bias on this run (the
same model, same workload, both sides), but not a bias that differs between before and after. Two
were found on this machine's runs: (1) the calibration caps every efficiency at 1 of the hardware
entry's ceilings, and ceilings measured on another CPU were below what the run achieved (a 768-token
prefill ran in 0.47 s, the capped GEMM term alone said 1.02 s; 131 ms chunks were priced right), so
a change that trades long prefills for short chunks was predicted to cost nothing while it cost
+68% E2E; a ceiling below what the run itself achieved is raised to it here (`achieved_ceilings`).
(2) iterations above max_native_rows pay one widening of the weights whatever their number of
chunks (cost/record_fit.py's o_wide), which a per-chunk overhead priced twice when a change batches
several prompts in one iteration. A change is `Change(knobs)` in the simulator's RoleConfig
names plus the serve flags a user would type, or a whole Deployment field: a disaggregated run
(its pools, its link as its transfers measured it: sim/replay.py measured_link) is predicted
against `--mode colocated`, one engine with the run's engine args.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from phaselab.analysis.stats import percentile
from phaselab.core.timing import RequestMetrics

# longest_pause_s: the longest gap between two tokens of any stream (the stall's symptom figure)
FIGURES = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "longest_pause_s", "e2e_mean_s",
           "output_tokens_per_s")
LOWER_IS_BETTER = {"ttft_p50_s": True, "ttft_p99_s": True, "itl_p50_s": True, "itl_p99_s": True,
                   "longest_pause_s": True, "e2e_mean_s": True, "output_tokens_per_s": False}
HURT_TOLERANCE = 0.05  # E2E or throughput predicted worse by more than this: flagged with its cost
# tails: a mean cost per iteration does not give them, so each is also simulated on a noisy machine
# whose per-shape error is the run's own (sim/noise.py fitted_noise), NOISE_SEEDS draws, and shown as
# the range of those readings
TAIL_FIGURES = ("ttft_p99_s", "itl_p99_s", "longest_pause_s")
NOISE_SEEDS = 5


@dataclass(frozen=True)
class Change:
    knobs: dict[str, Any]  # RoleConfig fields: max_num_seqs, policy, max_num_batched_tokens, num_blocks
    flags: str  # what to pass to `phaselab serve` / `compare`
    engine_args: dict[str, Any] = field(default_factory=dict)  # EngineArgs for --verify
    deployment: dict[str, Any] = field(default_factory=dict)  # Deployment fields: {"mode": "colocated"}


@dataclass
class Prediction:
    change: Change
    measured: dict[str, float | None]
    sim_before: dict[str, float | None]
    sim_after: dict[str, float | None]
    cost_model_error: float | None  # the calibration's mean |relative error| per iteration
    caveats: list[str] = field(default_factory=list)  # what the calibration run could not separate
    # the relative change under each other reading of what the run cannot separate (Predictor)
    readings: list[dict[str, float | None]] = field(default_factory=list)
    # the relative change on a machine as noisy as the run's, per noise draw (TAIL_FIGURES only)
    tail_readings: list[dict[str, float | None]] = field(default_factory=list)

    def predicted(self, name: str) -> float | None:
        m, b, a = self.measured.get(name), self.sim_before.get(name), self.sim_after.get(name)
        if m is None or not b or a is None:
            return None
        return m * a / b

    def relative(self, name: str) -> float | None:
        b, a = self.sim_before.get(name), self.sim_after.get(name)
        return (a - b) / b if b and a is not None else None

    def range(self, name: str) -> tuple[float, float] | None:
        """(lowest, highest) relative change over this prediction and its other readings; None
        without other readings (the run separated what the change depends on) or where they agree
        within half a percent (the change does not depend on the split)."""
        others = self.readings + (self.tail_readings if name in TAIL_FIGURES else [])
        vals = [v for v in [self.relative(name)] + [r.get(name) for r in others] if v is not None]
        if not others or not vals or max(vals) - min(vals) < 0.005:  # the readings agree
            return None
        return min(vals), max(vals)

    def hurts(self) -> list[str]:
        """User-facing figures the change is predicted to worsen by more than HURT_TOLERANCE."""
        out = []
        for name in ("e2e_mean_s", "output_tokens_per_s"):
            r = self.relative(name)
            if r is not None and (r > HURT_TOLERANCE if LOWER_IS_BETTER[name] else r < -HURT_TOLERANCE):
                out.append(name)
        return out

    def table(self) -> list[tuple[str, float | None, float | None, float | None]]:
        return [(n, self.measured.get(n), self.predicted(n), self.relative(n)) for n in FIGURES]

    def to_json(self) -> dict[str, Any]:
        return {"flags": self.change.flags, "knobs": self.change.knobs, "measured": self.measured,
                "predicted": {n: self.predicted(n) for n in FIGURES}, "sim_before": self.sim_before,
                "sim_after": self.sim_after, "cost_model_error": self.cost_model_error, "hurts": self.hurts(),
                "caveats": self.caveats,
                "range": {n: self.range(n) for n in FIGURES} if self.readings or self.tail_readings else None}


def figures(requests: list[RequestMetrics]) -> dict[str, float | None]:
    """The user-facing figures of a run's records (finished, ok requests)."""
    ok = [m for m in requests if m.finish_reason not in ("abort", "error") and m.first_token_sent_ns is not None]
    ttft = [m.ttft_s for m in ok if m.ttft_s is not None]
    itl = [g for m in ok for g in m.itl_s]
    e2e = [m.e2e_s for m in ok if m.e2e_s is not None]
    out_tokens = sum(m.num_output_tokens for m in ok)
    t0 = min((m.arrived_ns for m in ok), default=0)
    t1 = max((m.finished_ns or 0 for m in ok), default=0)
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "longest_pause_s": max(itl, default=None),
            "e2e_mean_s": sum(e2e) / len(e2e) if e2e else None,
            "output_tokens_per_s": out_tokens / ((t1 - t0) / 1e9) if t1 > t0 else None}


HEADROOM = 2.0  # a raised ceiling: this x what the run achieved (the iteration also spent time elsewhere)


def achieved_ceilings(data: Any, hw: Any) -> Any:
    """`hw` with its peak FLOP/s and bandwidth raised above the most the run's own iterations achieved
    (modeled GEMM FLOPs / weight bytes over each iteration's measured time), where the run came near
    or beat them: HEADROOM x that rate, since the same iteration also ran attention and overheads, so
    its GEMMs alone ran faster still and a cap at the achieved rate would bind. `hw` itself where the
    run stayed below 1 / HEADROOM of its ceilings."""
    import dataclasses as dc

    its = [r for r in data.iterations if r.duration_s > 0]
    flops = max((r.modeled.matmul_flops / r.duration_s for r in its), default=0.0)
    nbytes = max((r.modeled.weight_bytes / r.duration_s for r in its), default=0.0)
    flops, nbytes = HEADROOM * flops, HEADROOM * nbytes
    if flops <= hw.peak_flops and nbytes <= hw.mem_bandwidth:
        return hw
    src = dict(hw.sources)
    if flops > hw.peak_flops:
        src["peak_flops"] = f"raised to {HEADROOM:g} x the GEMM rate the run achieved ({flops / 1e9:.0f} " \
                            f"GFLOP/s; {hw.name}'s {hw.peak_flops / 1e9:.0f} was measured elsewhere or capped the fit)"
    if nbytes > hw.mem_bandwidth:
        src["mem_bandwidth"] = f"raised to {HEADROOM:g} x the weight read rate the run achieved ({nbytes / 1e9:.1f} GB/s)"
    return dc.replace(hw, peak_flops=max(flops, hw.peak_flops), mem_bandwidth=max(nbytes, hw.mem_bandwidth),
                      sources=src)


class Predictor:
    """Calibrates once per run, then simulates any number of changes."""

    def __init__(self, path: str | PathLike[str]) -> None:
        from phaselab.obs.rundir import read_run_dir
        from phaselab.sim.calibrate import calibrate
        from phaselab.sim.replay import replay_inputs

        data = read_run_dir(path)
        self.deployment, self.requests, _, self.notes = replay_inputs(data, at="arrival")
        fit, hw = calibrate(path)
        lifted = achieved_ceilings(data, hw)
        if lifted is not hw:
            fit, hw = calibrate(path, hardware=lifted)
        self.cost_model_error = fit.summary()["relative_error_abs_mean"]
        self.caveats = fit.spread
        self.deployment = dataclasses.replace(self.deployment, hardware=hw, params=fit.params)
        self.measured = figures(data.requests)
        args = data.config.get("engine_args") or {}
        one = f"{args['num_threads']} threads" if args.get("num_threads") else "all the machine's cores"
        self.threads_caveat = (
            f"the run's workers computed on {args.get('prefill_threads')} (prefill) and {args.get('decode_threads')} "
            f"(decode) threads; one engine is priced at their speed, though it computes on {one}: its "
            "compute may be faster than predicted")
        self._before = self._simulate({})
        # the run's own per-shape iteration error against this fit, for the tails (TAIL_FIGURES)
        from phaselab.cost.record_fit import iteration_cycles, predict_iterations, run_model
        from phaselab.obs.rundir import engine_config
        from phaselab.sim.noise import fitted_noise

        iters = sorted(data.iterations, key=lambda r: r.start_ns)
        model, dtype_bytes = run_model(engine_config(data.config))  # disaggregated: the workers' model
        measured_s = [c / 1e9 for c in iteration_cycles(iters)]
        self.noise = fitted_noise(iters, measured_s, list(predict_iterations(fit.params, iters, model, hw, dtype_bytes)))
        self._noisy_before = [self._simulate({}, noise=dataclasses.replace(self.noise, seed=k))
                              for k in range(NOISE_SEEDS)] if self.noise.sigma else []
        # what the run cannot separate, read each way it allows (each coefficient of a pair pinned at 0
        # in turn: all per step, all per sequence): a change that depends on the split is predicted
        # under every reading, and the prediction shows the range
        self._readings: list[tuple[Any, dict[str, float | None]]] = []
        for cols in fit.unseparated:
            for col in cols:
                with warnings.catch_warnings():  # the host warning, if any, was given by the calibration above
                    warnings.simplefilter("ignore")
                    alt, _ = calibrate(path, hardware=hw, fixed={col: 0.0})
                d = dataclasses.replace(self.deployment, params=alt.params)
                self._readings.append((d, self._simulate({}, d)))

    def _simulate(self, knobs: dict[str, Any], deployment: Any = None,
                  whole: dict[str, Any] | None = None, noise: Any = None) -> dict[str, float | None]:
        from phaselab.sim.loop import Simulator
        from phaselab.workload.arrivals import ArrivalPlan

        d = deployment or self.deployment
        if knobs:
            d = dataclasses.replace(d, colocated=dataclasses.replace(d.colocated, **knobs))
        if whole:
            d = dataclasses.replace(d, **whole)
        sim = Simulator(d, self.requests, ArrivalPlan(self_timed=True), record_iterations=False,
                        workload_info={"kind": "diagnose prediction"}, noise=noise)
        return figures(sim.run().requests)

    def predict(self, change: Change) -> Prediction:
        readings = []
        for d, before in self._readings:
            after = self._simulate(change.knobs, d, change.deployment)
            readings.append({n: (a - b) / b if (b := before.get(n)) and (a := after.get(n)) is not None else None
                             for n in FIGURES})
        caveats = list(self.caveats)
        if self.deployment.mode == "disagg" and change.deployment.get("mode") == "colocated":
            caveats.append(self.threads_caveat)
        tails = []
        for k, before in enumerate(self._noisy_before):
            after = self._simulate(change.knobs, None, change.deployment, dataclasses.replace(self.noise, seed=k))
            tails.append({n: (a - b) / b if (b := before.get(n)) and (a := after.get(n)) is not None else None
                          for n in TAIL_FIGURES})
        return Prediction(change, self.measured, self._before, self._simulate(change.knobs, None, change.deployment),
                          self.cost_model_error, caveats, readings, tails)


def make_predictor(path: str | PathLike[str] | None) -> tuple[Predictor | None, str | None]:
    """A predictor for a real one-engine run directory, or (None, why not)."""
    if path is None:
        return None, "no run directory (records given in memory): no prediction"
    try:
        return Predictor(path), None
    except Exception as e:  # noqa: BLE001 - a run the simulator cannot replay: the diagnosis goes on without
        return None, f"no prediction: {e}"
