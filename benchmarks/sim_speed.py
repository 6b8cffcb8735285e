"""How fast the simulator runs: 10,000 requests on 16-GPU deployments (issue 10: < 60 s here).

    python benchmarks/sim_speed.py [--num-prompts 10000] [--out benchmarks/results/sim_speed.json]

Scenarios (each a random workload, Poisson arrivals, seed 0):
  colocated   Llama-3-8B, 16 x H100, 16 replicas of TP1, chunked (budget 2048)
  disagg      Llama-3-70B, 16 x H100, 2 prefill (TP4) : 2 decode (TP4), KV over NVLink 4
Reports wall and CPU time of the simulation alone (workload generation and run-directory writing
apart), iterations, events, and the share spent inside core's Scheduler.schedule/update (measured by
wrapping them, which adds a little overhead of its own). The machine is shared: CPU time is the
steadier figure; wall time is what the issue's budget is about.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from phaselab.core.scheduler import Scheduler  # noqa: E402
from phaselab.cost.catalog import get_hardware, get_model  # noqa: E402
from phaselab.sim.deployment import Deployment, RoleConfig  # noqa: E402
from phaselab.sim.loop import simulate  # noqa: E402
from phaselab.sim.summary import summarize  # noqa: E402
from phaselab.sim.workload import random_requests  # noqa: E402
from phaselab.workload.arrivals import ArrivalPlan  # noqa: E402

SCENARIOS = {
    "colocated": (lambda: Deployment(get_model("llama-3-8b"), get_hardware("h100"), num_replicas=16),
                  "uniform:256:1024", "uniform:64:256", 150.0),
    "disagg": (lambda: Deployment(get_model("llama-3-70b"), get_hardware("h100"), "disagg", num_prefill=2,
                                  num_decode=2, prefill=RoleConfig(tp=4), decode=RoleConfig(tp=4)),
               "uniform:256:1024", "uniform:64:256", 20.0),
}


class SchedulerTimer:
    """Wraps Scheduler.schedule/update to measure the time spent inside core's scheduler."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig = (Scheduler.schedule, Scheduler.update)

    def __enter__(self) -> "SchedulerTimer":
        schedule, update = self._orig
        timer = self

        def timed_schedule(sched):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return schedule(sched)
            finally:
                timer.seconds += time.perf_counter() - t

        def timed_update(sched, plan, result):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return update(sched, plan, result)
            finally:
                timer.seconds += time.perf_counter() - t

        Scheduler.schedule, Scheduler.update = timed_schedule, timed_update  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Scheduler.schedule, Scheduler.update = self._orig  # type: ignore[method-assign]


def run(name: str, num_prompts: int, measure_scheduler: bool) -> dict:
    make, input_len, output_len, rate = SCENARIOS[name]
    d = make()
    t = time.perf_counter()
    reqs = random_requests(num_prompts, input_len, output_len, seed=0, arrivals=ArrivalPlan(request_rate=rate))
    workload_s = time.perf_counter() - t
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if measure_scheduler:
        with SchedulerTimer() as timer:
            result = simulate(d, reqs)
    else:
        result = simulate(d, reqs)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s = summarize(result.requests)
    out = {
        "scenario": name, "deployment": d.describe(), "num_gpus": d.num_gpus, "num_requests": num_prompts,
        "request_rate": rate, "input_len": input_len, "output_len": output_len,
        "wall_s": wall, "cpu_s": cpu, "workload_s": workload_s, "iterations": len(result.iterations),
        "events": result.num_events, "simulated_s": result.sim_duration_s,
        "iterations_per_s": len(result.iterations) / wall,
        "mean_batch_tokens": sum(r.num_prefill_tokens + r.num_decode_tokens for r in result.iterations)
        / max(1, len(result.iterations)),
        "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"], "tpot_p50_s": s["tpot_s"]["p50"],
        "load_average": os.getloadavg()[0],
    }
    if measure_scheduler:
        out["scheduler_s"] = timer.seconds
        out["scheduler_share"] = timer.seconds / wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=10_000)
    ap.add_argument("--scenarios", default="colocated,disagg")
    ap.add_argument("--scheduler-share", action="store_true", help="also time core's scheduler (second run)")
    ap.add_argument("--out", default="benchmarks/results/sim_speed.json")
    args = ap.parse_args()
    results = []
    for name in args.scenarios.split(","):
        r = run(name, args.num_prompts, measure_scheduler=False)
        if args.scheduler_share:
            timed = run(name, args.num_prompts, measure_scheduler=True)
            r["scheduler_share"] = timed["scheduler_share"]
        results.append(r)
        print(f"{name:<10} {r['deployment']}: {r['num_requests']} requests, {r['iterations']} iterations, "
              f"{r['simulated_s']:.0f} s simulated in {r['wall_s']:.1f} s wall / {r['cpu_s']:.1f} s CPU "
              f"(load average {r['load_average']:.1f})"
              + (f"; {r['scheduler_share']:.0%} inside core's scheduler" if "scheduler_share" in r else ""))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "sim_speed", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results}, f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
