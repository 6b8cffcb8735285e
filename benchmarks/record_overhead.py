"""What the phase record costs: the same offline workload with recording on and off.

    python benchmarks/record_overhead.py [--trials 5] [--requests 32] [--out benchmarks/results/record_overhead.json]

"Recording" is everything the phase record adds to a step: the iteration record with its
modeled cost, Prometheus observations, and keeping every record for the run directory. The
per-request timestamps themselves are always taken. Trials alternate on/off on one engine so
drift on a shared machine hits both sides alike; the figure is the median throughput ratio.

The step timers (the attention / linear / elementwise split of a native decode step that
iterations.jsonl records, docs/run-directory.md) are measured apart, recording on in both arms: the
timers on and off alternated trial by trial, the median decode-only step of each arm compared (a
median over thousands of steps: a throughput ratio cannot resolve a few microseconds a step on a
shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _machine import cpu_model, write_json  # noqa: E402
from phaselab import LLM, SamplingParams  # noqa: E402


def workload(seed: int, n: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49152, (prompt_len,), generator=g).tolist() for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timer-tokens", type=int, default=400, help="decode steps per trial of the step-timer A/B")
    ap.add_argument("--out", default="benchmarks/results/record_overhead.json")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB", max_model_len=2048, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(workload(0, 4, args.prompt_len), params)  # warm-up
    # direct measure, robust to a noisy machine: time spent inside the recording code itself
    eng = llm.engine
    spent = {"record_ns": 0, "step_ns": 0}
    orig_record, orig_step = eng._record_iteration, eng.step

    def timed_record(*a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter_ns()
        orig_record(*a, **k)
        spent["record_ns"] += time.perf_counter_ns() - t0

    def timed_step():  # type: ignore[no-untyped-def]
        t0 = time.perf_counter_ns()
        out = orig_step()
        spent["step_ns"] += time.perf_counter_ns() - t0
        return out

    eng._record_iteration, eng.step = timed_record, timed_step  # type: ignore[method-assign]
    llm.generate(workload(500, args.requests, args.prompt_len), params)
    eng._record_iteration, eng.step = orig_record, orig_step  # type: ignore[method-assign]
    direct_pct = 100 * spent["record_ns"] / spent["step_ns"]
    print(f"time inside the iteration recording: {direct_pct:.2f}% of step time", file=sys.stderr, flush=True)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for t in range(args.trials):
        for mode in ("on", "off") if t % 2 == 0 else ("off", "on"):
            llm.engine.recording = mode == "on"
            prompts = workload(1000 + t, args.requests, args.prompt_len)  # same prompts for both modes
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            rates[mode].append(sum(len(o.token_ids) for o in outs) / dt)
            print(f"trial {t} recording {mode}: {rates[mode][-1]:.1f} output tok/s", file=sys.stderr, flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    timers = step_timer_overhead(llm, args)
    result = {
        "benchmark": "record_overhead",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu": cpu_model(),
        "workload": vars(args),
        "output_tokens_per_s": {"recording_on": rates["on"], "recording_off": rates["off"]},
        "median_on": on,
        "median_off": off,
        "overhead_pct": 100 * (off - on) / off,
        "record_iteration_share_of_step_pct": direct_pct,
        "step_timers": timers,
    }
    write_json(args.out, result)
    print(f"recording: {direct_pct:.2f}% of step time spent in it; A/B overhead {result['overhead_pct']:.2f}% of throughput (median on {on:.1f} vs off {off:.1f} "
          f"tok/s); wrote {args.out}", file=sys.stderr)



def step_timer_overhead(llm: LLM, args: argparse.Namespace) -> dict[str, object]:
    """Median decode-only step with the native call's timers on and off, alternated per trial."""
    from phaselab.model import kernels

    eng = llm.engine
    eng.recording = True
    if not eng.executor.step_timers:
        return {"skipped": "this engine runs no native decode call with timers (PHASELAB_STEP_TIMERS=0, "
                           "PHASELAB_DECODE_LAYERS=0 or no native kernels)"}
    steps: dict[str, list[float]] = {"on": [], "off": []}
    for t in range(args.trials):
        for mode in ("on", "off") if t % 2 == 0 else ("off", "on"):
            eng.executor.step_timers = mode == "on"
            if mode == "on":
                kernels.take_step_split()  # timers running, from zero
            else:
                kernels.decode_layers_profile(False)  # timers stopped: no clock reads in the call
            n = len(eng.iterations)
            # batch 1, many steps: where a step is shortest the timers' clock reads weigh most
            llm.generate(workload(2000 + t, 1, args.prompt_len),
                         SamplingParams(temperature=0, max_tokens=args.timer_tokens, ignore_eos=True))
            new = [r for r in list(eng.iterations)[n:] if r.num_prefill_tokens == 0 and r.num_decode_tokens > 0]
            steps[mode] += [r.duration_s for r in new]
            print(f"trial {t} step timers {mode}: median decode step {statistics.median(steps[mode]) * 1e3:.3f} ms "
                  f"({len(new)} steps)", file=sys.stderr, flush=True)
    eng.executor.step_timers = True
    kernels.take_step_split()
    on, off = statistics.median(steps["on"]), statistics.median(steps["off"])
    print(f"step timers: median decode step {on * 1e3:.3f} ms on vs {off * 1e3:.3f} ms off "
          f"({100 * (on - off) / off:+.2f}%)", file=sys.stderr, flush=True)
    return {"median_step_on_s": on, "median_step_off_s": off, "overhead_pct": 100 * (on - off) / off,
            "num_steps": {k: len(v) for k, v in steps.items()}}


if __name__ == "__main__":
    main()
