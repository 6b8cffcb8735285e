"""This machine's ceilings and the floors they imply for the bundled model.

    python benchmarks/roofline.py [--quick] [--out benchmarks/results/roofline.json]

Measures with torch, in this process, with its thread settings:
  - GEMM rate (FLOP/s) for the model's linear shapes (hidden x (q+2kv), q x hidden, hidden x
    2*intermediate, intermediate x hidden, hidden x vocab) at 1 to 2048 rows, bf16 and fp32;
  - sustained memory bandwidth: read (sum), write (fill) and copy of arrays far beyond the caches.
Then computes floors from the model config (phaselab.obs.cost, the same modeled counts the phase
record uses): a prefill of N tokens and a decode step at batch B with context C each cost at
least max(FLOPs / GEMM rate, bytes / bandwidth), bytes = weights once + KV read + KV written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from phaselab.core.sampling_params import SamplingParams  # noqa: E402
from phaselab.model.loader import load_checkpoint  # noqa: E402
from phaselab.obs.cost import modeled_cost  # noqa: E402

ROWS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048]


def timeit(fn, min_time: float = 0.2, trials: int = 3) -> float:
    fn()
    best = []
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_time:
            fn()
            n += 1
        best.append((time.perf_counter() - t0) / n)
    return statistics.median(best)


def gemm_rates(config, dtype: torch.dtype, rows_list: list[int], min_time: float) -> dict:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {"qkv": (h, config.q_size + 2 * config.kv_size), "o": (config.q_size, h),
              "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, v)}
    out: dict = {}
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k).to(dtype)
        out[name] = {}
        for m in rows_list:
            x = torch.randn(m, k).to(dtype)
            t = timeit(lambda: torch.nn.functional.linear(x, w), min_time)
            out[name][str(m)] = 2 * m * k * n / t
    # the model's own mix: FLOP-weighted harmonic mean over the per-layer shapes at each row count
    mix = {}
    for m in rows_list:
        flops = {s: shapes[s][0] * shapes[s][1] for s in ("qkv", "o", "gate_up", "down")}
        total = sum(flops.values())
        mix[str(m)] = total / sum(flops[s] / out[s][str(m)] for s in flops)
    out["layer_mix"] = mix
    return out


def bandwidth(size_bytes: int, min_time: float) -> dict:
    a = torch.empty(size_bytes // 4, dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    read = size_bytes / timeit(lambda: a.sum(), min_time)
    write = size_bytes / timeit(lambda: b.fill_(1.0), min_time)
    copy = 2 * size_bytes / timeit(lambda: b.copy_(a), min_time)
    return {"read_bytes_per_s": read, "write_bytes_per_s": write, "copy_bytes_per_s": copy,
            "array_bytes": size_bytes}


def plan_of(entries: list[tuple[int, int, bool]]) -> SchedulerOutput:
    """(start_position, num_tokens, sample) per request -> a plan the cost model can count."""
    sp = SamplingParams()
    return SchedulerOutput(0, [ScheduledRequest(str(i), [0] * n, s, [], [], smp, n > 1, sp)
                               for i, (s, n, smp) in enumerate(entries)])


def floors(config, dtype_bytes: int, rate_at, bw: float) -> dict:
    out: dict = {"prefill": {}, "decode": {}}
    for n in (128, 512, 1024, 2048, 4096):
        c = modeled_cost(config, plan_of([(0, n, True)]), dtype_bytes)
        t_compute, t_bytes = c.flops / rate_at(n), c.total_bytes / bw
        out["prefill"][str(n)] = {"flops": c.flops, "bytes": c.total_bytes, "compute_s": t_compute,
                                  "memory_s": t_bytes, "floor_s": max(t_compute, t_bytes),
                                  "floor_tokens_per_s": n / max(t_compute, t_bytes)}
    for b in (1, 8, 32, 64):
        for ctx in (512,):
            c = modeled_cost(config, plan_of([(ctx - 1, 1, True)] * b), dtype_bytes)
            t_compute, t_bytes = c.flops / rate_at(b), c.total_bytes / bw
            out["decode"][f"{b}x{ctx}"] = {"flops": c.flops, "bytes": c.total_bytes, "compute_s": t_compute,
                                          "memory_s": t_bytes, "floor_s": max(t_compute, t_bytes)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter timings, fewer row counts")
    ap.add_argument("--out", default="benchmarks/results/roofline.json")
    args = ap.parse_args()
    min_time = 0.05 if args.quick else 0.3
    rows = [1, 32, 512, 2048] if args.quick else ROWS
    config = load_checkpoint(None).config
    result: dict = {"benchmark": "roofline", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "model": config.name}
    print("measuring memory bandwidth ...", file=sys.stderr, flush=True)
    result["bandwidth"] = bw = bandwidth(1 << 30 if not args.quick else 1 << 28, min_time)
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        print(f"measuring {name} GEMM rates ...", file=sys.stderr, flush=True)
        rates = gemm_rates(config, dtype, rows, min_time)
        mix = rates["layer_mix"]

        def rate_at(m: int, mix=mix) -> float:  # nearest measured row count at or above m
            keys = sorted(int(k) for k in mix)
            return mix[str(next((k for k in keys if k >= m), keys[-1]))]

        result[name] = {"gemm_flops_per_s": rates,
                        "floors": floors(config, torch.finfo(dtype).bits // 8, rate_at, bw["read_bytes_per_s"])}
        print(f"  {name}: layer-mix GEMM rate at 512 rows {rate_at(512) / 1e9:.0f} GFLOP/s; "
              f"read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s", file=sys.stderr)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
