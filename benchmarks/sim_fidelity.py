"""Self-fidelity of the simulator on this CPU: calibrate on one real run, predict two others.

    python benchmarks/sim_fidelity.py [--num-prompts 40] [--out benchmarks/results/sim_fidelity.json]

1. capacity: all requests at once on the real engine (bundled model, bf16, chunked); capacity =
   requests / makespan
2. calibration run: Poisson arrivals at 70% of capacity (seed 1) -> `phaselab simulate calibrate`
3. two test runs with other seeds at about 50% and 85% of capacity; each is simulated with the
   calibrated parameters (same scheduler config, KV blocks, request lengths and arrival times) and
   p50 / p99 TTFT and time between tokens (ITL, every gap) are compared with the real run's
   (issue 10's target: p50 within 10%, p99 within 20%)
4. the same with every predicted time scaled by the run's median measured/predicted iteration
   time ("drift-corrected"): information taken from the predicted run, reported apart, to separate
   the shared machine's speed drift between runs from the model's own error

The real engine is driven offline in real time: a request is added, with arrived_ns = its
scheduled arrival, at the first iteration boundary after its arrival time, as a server's engine
thread would. Outputs ignore EOS, so each request generates exactly its drawn length in both. The
machine is shared; the closing note reports the load average during each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from phaselab.obs.rundir import read_run_dir  # noqa: E402
from phaselab.sim.calibrate import calibrate  # noqa: E402
from phaselab.sim.catalog import get_hardware  # noqa: E402
from phaselab.sim.loop import simulate  # noqa: E402
from phaselab.sim.replay import replay_inputs  # noqa: E402
from phaselab.sim.report import summarize  # noqa: E402
from phaselab.sim.workload import ArrivalSpec, random_requests  # noqa: E402

INPUT_LEN, OUTPUT_LEN = "uniform:32:384", "uniform:8:48"


def real_run(engine, reqs, text_ids: list[int], path: str, seed: int) -> float:
    """Run `reqs` (SimRequests with arrival_s) on the real engine in real time; returns the makespan."""
    from phaselab import SamplingParams

    engine.iterations.clear()
    engine.finished_requests.clear()
    rng = np.random.default_rng(1000 + seed)
    prompts = []
    for r in reqs:  # distinct stretches of real text: no prefix-cache hits across requests
        start = int(rng.integers(0, len(text_ids) - r.num_prompt_tokens))
        prompts.append(text_ids[start:start + r.num_prompt_tokens])
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    t0 = time.monotonic_ns()
    k = 0
    while k < len(order) or engine.has_unfinished_requests():
        now = time.monotonic_ns()
        while k < len(order) and t0 + round(reqs[order[k]].arrival_s * 1e9) <= now:
            r = reqs[order[k]]
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(prompts[order[k]], params, request_id=r.request_id,
                               arrived_ns=t0 + round(r.arrival_s * 1e9))
            k += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif k < len(order):
            time.sleep(max(0.0, (t0 + reqs[order[k]].arrival_s * 1e9 - time.monotonic_ns()) / 1e9))
    makespan = (time.monotonic_ns() - t0) / 1e9
    engine.write_record(path)
    return makespan


def simulate_like(run_dir: str, reqs, params) -> dict:
    """The simulator's prediction of a real run: its scheduler config and KV blocks, these requests."""
    d_replay, _, _, _ = replay_inputs(read_run_dir(run_dir))
    d = dataclasses.replace(d_replay, params=params)
    return summarize(simulate(d, reqs, ArrivalSpec(self_timed=True)).requests)


def compare(real: dict, sim: dict) -> dict:
    out = {}
    for metric in ("ttft_s", "tbt_s"):
        for q in ("p50", "p99"):
            r, s = real[metric][q], sim[metric][q]
            out[f"{metric}_{q}"] = {"real": r, "sim": s, "error": (s - r) / r if r else math.nan}
    return out


def speed_ratio(run_dir: str, params) -> float:
    """Median measured / predicted iteration time of a run under `params`: how much faster or
    slower the (shared) machine was during this run than the calibration says."""
    from phaselab.obs.rundir import read_run_dir
    from phaselab.sim import calibrate as cal

    data = read_run_dir(run_dir)
    model, dtype_bytes = cal.run_model(data.config)
    iters = sorted(data.iterations, key=lambda r: r.start_ns)
    f = cal._features(iters, model, get_hardware("cpu"), dtype_bytes)
    pred, _, _ = cal._predict(cal._to_x(params, model.num_layers), f)
    return float(np.median(np.asarray(cal.iteration_cycles(iters)) / 1e9 / pred))


def scaled(params, k: float):
    """The same cost model, every time multiplied by k."""
    return dataclasses.replace(
        params, compute_efficiency=params.compute_efficiency / k, attention_efficiency=params.attention_efficiency / k,
        memory_efficiency=params.memory_efficiency / k, iteration_overhead_s=params.iteration_overhead_s * k,
        layer_overhead_s=params.layer_overhead_s * k, request_overhead_s=params.request_overhead_s * k,
        token_overhead_s=params.token_overhead_s * k)


RUNS = {"calibration": (1, 0.70), "load-50": (2, 0.50), "load-85": (3, 0.85)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results/sim_fidelity.json")
    ap.add_argument("--workdir", default="/tmp/phaselab-sim-fidelity")
    ap.add_argument("--analyze-only", action="store_true", help="reuse the real runs already in --workdir")
    args = ap.parse_args()
    n = args.num_prompts
    report: dict = {"benchmark": "sim_fidelity", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "num_prompts": n,
                    "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "runs": {}}
    if args.analyze_only:
        with open(args.out) as f:
            previous = json.load(f)
        capacity = previous["capacity_req_per_s"]
        report["runs"] = {k: {key: v for key, v in r.items() if not key.startswith("comparison")}
                          for k, r in previous["runs"].items()}
    else:
        from phaselab import LLM
        from tests._model_helpers import long_text

        llm = LLM(dtype="bfloat16", kv_cache_memory="128MiB", max_model_len=1024, policy="chunked",
                  max_num_batched_tokens=256, max_num_seqs=16, enable_prefix_caching=False)
        engine = llm.engine
        text_ids = engine.tokenizer.encode(long_text(60))
        # 1. capacity: everything at once
        burst = random_requests(n, INPUT_LEN, OUTPUT_LEN, seed=0)
        makespan = real_run(engine, burst, text_ids, os.path.join(args.workdir, "capacity"), seed=0)
        capacity = n / makespan
        print(f"capacity: {capacity:.3f} req/s ({n} requests in {makespan:.1f} s)", flush=True)
        # 2. calibration at 70%, 3. test runs at 50% and 85%
        for name, (seed, frac) in RUNS.items():
            reqs = random_requests(n, INPUT_LEN, OUTPUT_LEN, seed=seed,
                                   arrivals=ArrivalSpec(request_rate=capacity * frac))
            load0 = os.getloadavg()[0]
            span = real_run(engine, reqs, text_ids, os.path.join(args.workdir, name), seed)
            report["runs"][name] = {"seed": seed, "fraction_of_capacity": frac, "rate": capacity * frac,
                                    "makespan_s": span, "load_average": [load0, os.getloadavg()[0]]}
            print(f"{name}: {span:.1f} s (load average {load0:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    report["capacity_req_per_s"] = capacity

    fit, _ = calibrate(os.path.join(args.workdir, "calibration"))
    report["fit"] = fit.summary()
    report["params"] = fit.params.to_json()
    print(f"fit: |rel error| p50 {fit.summary()['relative_error_abs_p50']:.1%}, "
          f"p90 {fit.summary()['relative_error_abs_p90']:.1%}; total time {fit.summary()['total_time_error']:+.1%}",
          flush=True)
    for name, (seed, frac) in RUNS.items():
        run_dir = os.path.join(args.workdir, name)
        reqs = random_requests(n, INPUT_LEN, OUTPUT_LEN, seed=seed,
                               arrivals=ArrivalSpec(request_rate=report["runs"][name]["rate"]))
        real = summarize(read_run_dir(run_dir).requests)
        ratio = speed_ratio(run_dir, fit.params)
        raw = compare(real, simulate_like(run_dir, reqs, fit.params))
        corrected = compare(real, simulate_like(run_dir, reqs, scaled(fit.params, ratio)))
        report["runs"][name].update(comparison=raw, machine_speed_ratio=ratio, comparison_drift_corrected=corrected)
        for label, cmp_ in (("predicted", raw), (f"drift-corrected x{ratio:.2f}", corrected)):
            print(f"{name} {label}: " + ", ".join(
                f"{k} real {v['real'] * 1e3:.0f} ms sim {v['sim'] * 1e3:.0f} ms ({v['error']:+.0%})"
                for k, v in cmp_.items()), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
