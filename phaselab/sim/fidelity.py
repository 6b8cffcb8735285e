"""Self-fidelity of the simulator: drive the real engine in real time, simulate the same run.

Shared by `benchmarks/sim_fidelity.py` (40 requests, three loads) and its CI test
`tests/test_sim_self_fidelity.py` (fewer, shorter requests, two loads):

    real_run       requests with arrival times into a real engine, offline, in real time (phaselab.workload's
                   run_arrivals, as compare); writes the run dir
    speed_probe    one fixed prefill alone, timed: the machine's speed just before (or after) a run
    simulate_like  the simulator's prediction of a real run (its scheduler config and KV blocks) under params
    compare        p50 / p99 TTFT and time between tokens, real vs simulated, with relative errors
    speed_ratio    median measured / predicted iteration time of a run: the machine's speed vs the calibration
    scaled         a cost model with every time multiplied by k (drift correction)
    by_kind        measured / predicted time per kind of iteration (prefill only, mixed, decode only)

Every prediction prices the run against the hardware its parameters were fitted on: `hardware=`
(calibrate's second result), by default the ceilings the engine measured on the run's host and
recorded in it (host.run_hardware), else the catalog's `cpu` entry.

The engine is passed in (built by the caller with `phaselab.LLM`): this module imports neither torch
nor `phaselab.engine`, like the rest of the simulator.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from phaselab.core.sampling_params import SamplingParams
from phaselab.obs.rundir import read_run_dir
from phaselab.cost import record_fit as cal
from phaselab.cost.catalog import HardwareSpec
from phaselab.cost.pricing import CostParams
from phaselab.cost.host import run_hardware
from phaselab.sim.loop import simulate
from phaselab.sim.replay import replay_inputs
from phaselab.sim.summary import summarize
from phaselab.sim.workload import SimRequest
from phaselab.workload.arrivals import ArrivalPlan
from phaselab.workload.driver import Arrival, run_arrivals


def real_run(engine: Any, reqs: list[SimRequest], text_ids: list[int], path: str, seed: int) -> float:
    """Run `reqs` (SimRequests with arrival_s) on the real engine in real time (run_arrivals: each
    added, stamped arrived at its scheduled time, at the first iteration boundary after it, as a
    server's engine thread would); returns the makespan. Outputs ignore EOS, so each request
    generates exactly its drawn length. Prompts are distinct stretches of `text_ids` (no prefix-cache
    hits across requests). The engine's records are cleared first and written to `path` after."""
    engine.iterations.clear()
    engine.finished_requests.clear()
    rng = np.random.default_rng(1000 + seed)
    arrivals = []
    for r in reqs:
        start = int(rng.integers(0, len(text_ids) - r.num_prompt_tokens))
        arrivals.append(Arrival(r.request_id, text_ids[start:start + r.num_prompt_tokens], r.max_tokens,
                                r.group, at_s=r.arrival_s))
    makespan = run_arrivals(engine, arrivals).makespan_s
    engine.write_record(path)
    return makespan


def speed_probe(engine: Any, text_ids: list[int], tag: str, n: int = 3, num_tokens: int = 192) -> float:
    """Median seconds of one `num_tokens`-token prefill alone (n times): the machine's speed at
    this moment. The probe's records are dropped by the next real_run."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        engine.add_request(text_ids[i * (num_tokens + 8):i * (num_tokens + 8) + num_tokens],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                           request_id=f"probe-{tag}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def simulate_like(run_dir: str, reqs: list[SimRequest], params: CostParams, speed: float = 1.0,
                  hardware: HardwareSpec | None = None) -> dict:
    """The simulator's prediction of a real run: its scheduler config and KV blocks, these requests
    (with their arrival times), the cost model `params` fitted against `hardware`'s ceilings (default:
    the run's own, host.run_hardware) (on a machine `speed` times slower than the calibration's: every
    time multiplied by it, see `scaled`); returns report.summarize's dict."""
    d_replay, _, _, _ = replay_inputs(read_run_dir(run_dir))
    hw = hardware or d_replay.hardware
    if speed != 1.0:  # the ceilings move, not the efficiencies (they stay fractions of them, <= 1)
        hw = dataclasses.replace(hw, peak_flops=hw.peak_flops / speed, mem_bandwidth=hw.mem_bandwidth / speed)
        params = scaled(params, speed)
    d = dataclasses.replace(d_replay, params=params, hardware=hw)
    return summarize(simulate(d, reqs, ArrivalPlan(self_timed=True)).requests)


def compare(real: dict, sim: dict) -> dict:
    """{"ttft_s_p50": {"real", "sim", "error"}, ...}: p50 and p99 of TTFT and time between tokens;
    error = (sim - real) / real."""
    out = {}
    for metric in ("ttft_s", "tbt_s"):
        for q in ("p50", "p99"):
            r, s = real[metric][q], sim[metric][q]
            out[f"{metric}_{q}"] = {"real": r, "sim": s, "error": (s - r) / r if r else math.nan}
    return out


def _measured_predicted(run_dir: str, params: CostParams, hardware: HardwareSpec | None = None
                        ) -> tuple[list, np.ndarray, np.ndarray]:
    """A run's iterations (by start), their measured and predicted (under `params`, fitted against
    `hardware`; default: the run's own ceilings) times in s."""
    data = read_run_dir(run_dir)
    model, dtype_bytes = cal.run_model(data.config)
    iters = sorted(data.iterations, key=lambda r: r.start_ns)
    pred = cal.predict_iterations(params, iters, model, hardware or run_hardware(data.config), dtype_bytes)
    return iters, np.asarray(cal.iteration_cycles(iters)) / 1e9, np.asarray(pred)


def speed_ratio(run_dir: str, params: CostParams, hardware: HardwareSpec | None = None) -> float:
    """Median measured / predicted iteration time of a run under `params`: how much faster or
    slower the (shared) machine was during this run than the calibration says."""
    _, meas, pred = _measured_predicted(run_dir, params, hardware)
    return float(np.median(meas / pred))


def scaled(params: CostParams, k: float) -> CostParams:
    """The fixed times multiplied by k; with the hardware's ceilings divided by k (simulate_like), every
    time of the cost model is multiplied by k and every efficiency stays what was fitted."""
    return dataclasses.replace(
        params, iteration_overhead_s=params.iteration_overhead_s * k, layer_overhead_s=params.layer_overhead_s * k,
        request_overhead_s=params.request_overhead_s * k, chunk_overhead_s=params.chunk_overhead_s * k,
        token_overhead_s=params.token_overhead_s * k)


def by_kind(run_dir: str, params: CostParams, hardware: HardwareSpec | None = None) -> dict:
    """Measured / predicted iteration time per kind of iteration (prefill only, mixed, decode only)."""
    iters, meas, pred = _measured_predicted(run_dir, params, hardware)
    kinds = np.array([("P" if r.num_prefill_tokens else "") + ("D" if r.num_decode_tokens else "") for r in iters])
    out = {}
    for kind, label in (("P", "prefill_only"), ("PD", "mixed"), ("D", "decode_only")):
        k = kinds == kind
        if k.any():
            out[label] = {"iterations": int(k.sum()), "measured_s": float(meas[k].sum()),
                          "predicted_s": float(pred[k].sum()), "ratio": float(meas[k].sum() / pred[k].sum()),
                          "median_ratio": float(np.median(meas[k] / pred[k]))}
    out["all"] = {"iterations": len(iters), "measured_s": float(meas.sum()), "predicted_s": float(pred.sum()),
                  "ratio": float(meas.sum() / pred.sum())}
    return out
