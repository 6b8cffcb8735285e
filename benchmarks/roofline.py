"""This machine's ceilings and the floors they imply for the bundled model.

    python benchmarks/roofline.py [--quick] [--out benchmarks/results/roofline.json]

Measures with torch, in this process, with its thread settings:
  - GEMM rate (FLOP/s) for the model's linear shapes (hidden x (q+2kv), q x hidden, hidden x
    2*intermediate, intermediate x hidden, hidden x vocab) at 1 to 2048 rows, bf16 and fp32;
  - sustained memory bandwidth: read (sum), write (fill) and copy of arrays far beyond the caches.
Then computes floors from the model config (phaselab.cost.formulas, the same modeled counts the phase
record uses): a prefill of N tokens and a decode step at batch B with context C each cost at
least max(FLOPs / GEMM rate, bytes / bandwidth), bytes = weights once + KV read + KV written.

Importable (benchmarks/engine.py uses it): `measure()` returns the JSON this script writes,
`Roofline(result)` answers rates and floors for any plan, `load_or_measure(path)` reads a JSON
written here or measures quickly when there is none.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
from phaselab.core.sampling_params import SamplingParams
from phaselab.engine.ceilings import cpu_identity
from phaselab.cost.formulas import modeled_cost

ROWS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048]
QUICK_ROWS = [1, 32, 512, 2048]
PREFILL_FLOOR_LENGTHS = (128, 512, 1024, 2048, 4096)
DECODE_FLOOR_BATCHES = (1, 8, 32, 64)
DECODE_FLOOR_CONTEXTS = (512,)
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the model's linear layers, q/k/v and gate/up fused."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    return {"qkv": (h, config.q_size + 2 * config.kv_size), "o": (config.q_size, h),
            "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, v)}


def gemm_rates(config, dtype: torch.dtype, rows_list: list[int], min_time: float,
               include_lm_head: bool = True) -> dict:
    shapes = linear_shapes(config)
    if not include_lm_head:
        del shapes["lm_head"]
    out: dict = {}
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k).to(dtype)
        out[name] = {}
        for m in rows_list:
            x = torch.randn(m, k).to(dtype)
            t = timeit(lambda x=x, w=w: torch.nn.functional.linear(x, w), min_time)
            out[name][str(m)] = 2 * m * k * n / t
    # the model's own mix: FLOP-weighted harmonic mean over the per-layer shapes at each row count
    mix = {}
    for m in rows_list:
        flops = {s: shapes[s][0] * shapes[s][1] for s in LAYER_SHAPES}
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


def plan_floor(config, plan: SchedulerOutput, dtype_bytes: int, rate_at: Callable[[int], float],
               bw: float, rows: int | None = None) -> dict:
    """The floor of executing `plan` once: max(modeled FLOPs / GEMM rate at its row count,
    modeled bytes / read bandwidth). `rows` overrides the row count the rate is taken at."""
    c = modeled_cost(config, plan, dtype_bytes)
    rows = rows or sum(e.num_tokens for e in plan.scheduled)
    t_compute, t_bytes = c.flops / rate_at(rows), c.total_bytes / bw
    return {"flops": c.flops, "bytes": c.total_bytes, "compute_s": t_compute, "memory_s": t_bytes,
            "floor_s": max(t_compute, t_bytes), "bound": "compute" if t_compute >= t_bytes else "memory",
            "gemm_rate_flops_per_s": rate_at(rows)}


def prefill_floor(config, n: int, dtype_bytes: int, rate_at, bw: float) -> dict:
    """One prompt of n tokens in one forward pass that samples its last row."""
    f = plan_floor(config, plan_of([(0, n, True)]), dtype_bytes, rate_at, bw)
    f["floor_tokens_per_s"] = n / f["floor_s"]
    return f


def decode_floor(config, batch: int, context: int, dtype_bytes: int, rate_at, bw: float) -> dict:
    """One decode step of `batch` requests, each with `context` tokens already cached."""
    return plan_floor(config, plan_of([(context, 1, True)] * batch), dtype_bytes, rate_at, bw)


def floors(config, dtype_bytes: int, rate_at, bw: float) -> dict:
    out: dict = {"prefill": {}, "decode": {}}
    for n in PREFILL_FLOOR_LENGTHS:
        f = prefill_floor(config, n, dtype_bytes, rate_at, bw)
        out["prefill"][str(n)] = {k: f[k] for k in ("flops", "bytes", "compute_s", "memory_s", "floor_s",
                                                     "floor_tokens_per_s")}
    for b in DECODE_FLOOR_BATCHES:
        for ctx in DECODE_FLOOR_CONTEXTS:
            # context ctx: ctx - 1 tokens cached before the step, the step's own K/V makes ctx
            f = decode_floor(config, b, ctx - 1, dtype_bytes, rate_at, bw)
            out["decode"][f"{b}x{ctx}"] = {k: f[k] for k in ("flops", "bytes", "compute_s", "memory_s", "floor_s")}
    return out


def make_rate_at(mix: dict[str, float]) -> Callable[[int], float]:
    """Rate at m rows: the nearest measured row count at or above m (the largest one beyond it)."""
    keys = sorted(int(k) for k in mix)

    def rate_at(m: int) -> float:
        return mix[str(next((k for k in keys if k >= m), keys[-1]))]

    return rate_at


def measure(config, quick: bool = False, rows: list[int] | None = None, min_time: float | None = None,
            bandwidth_bytes: int | None = None, dtypes: tuple[str, ...] = ("bfloat16", "float32"),
            include_lm_head: bool = True, log: Callable[[str], None] = _log) -> dict:
    """Measure the ceilings in this process and compute the floors; the JSON the CLI writes."""
    min_time = min_time if min_time is not None else (0.05 if quick else 0.3)
    rows = rows or (QUICK_ROWS if quick else ROWS)
    result: dict = {"benchmark": "roofline", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "model": config.name,
                    "machine": cpu_identity(),  # a diagnosis uses these ceilings only for runs of this CPU
                    "quick": quick, "rows": rows, "min_time_s": min_time}
    log("measuring memory bandwidth ...")
    result["bandwidth"] = bw = bandwidth(bandwidth_bytes or (1 << 28 if quick else 1 << 30), min_time)
    for name in dtypes:
        dtype = getattr(torch, name)
        log(f"measuring {name} GEMM rates ...")
        rates = gemm_rates(config, dtype, rows, min_time, include_lm_head)
        rate_at = make_rate_at(rates["layer_mix"])
        result[name] = {"gemm_flops_per_s": rates,
                        "floors": floors(config, torch.finfo(dtype).bits // 8, rate_at, bw["read_bytes_per_s"])}
        log(f"  {name}: layer-mix GEMM rate at 512 rows {rate_at(512) / 1e9:.0f} GFLOP/s; "
            f"read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s")
    return result


class Roofline:
    """Rates, bandwidth and floors from a roofline result (measure()'s dict or its JSON)."""

    def __init__(self, result: dict, source: str = "") -> None:
        self.result, self.source = result, source

    def has(self, dtype_name: str) -> bool:
        return dtype_name in self.result

    @property
    def read_bandwidth(self) -> float:
        return self.result["bandwidth"]["read_bytes_per_s"]

    def rate_at(self, dtype_name: str) -> Callable[[int], float]:
        return make_rate_at(self.result[dtype_name]["gemm_flops_per_s"]["layer_mix"])

    def rate_rows(self, dtype_name: str, m: int) -> int:
        """The measured row count rate_at(m) reads."""
        keys = sorted(int(k) for k in self.result[dtype_name]["gemm_flops_per_s"]["layer_mix"])
        return next((k for k in keys if k >= m), keys[-1])

    def max_rate(self, dtype_name: str) -> float:
        return max(self.result[dtype_name]["gemm_flops_per_s"]["layer_mix"].values())

    def plan_floor(self, config, plan: SchedulerOutput, dtype_name: str, rows: int | None = None) -> dict:
        bytes_ = torch.finfo(getattr(torch, dtype_name)).bits // 8
        return plan_floor(config, plan, bytes_, self.rate_at(dtype_name), self.read_bandwidth, rows)

    def prefill_floor(self, config, n: int, dtype_name: str) -> dict:
        bytes_ = torch.finfo(getattr(torch, dtype_name)).bits // 8
        return prefill_floor(config, n, bytes_, self.rate_at(dtype_name), self.read_bandwidth)

    def decode_floor(self, config, batch: int, context: int, dtype_name: str) -> dict:
        bytes_ = torch.finfo(getattr(torch, dtype_name)).bits // 8
        return decode_floor(config, batch, context, bytes_, self.rate_at(dtype_name), self.read_bandwidth)

    def summary(self) -> dict:
        out = {"source": self.source, "date": self.result.get("date"), "quick": self.result.get("quick"),
               "read_bytes_per_s": self.read_bandwidth, "threads": self.result.get("threads")}
        for name in ("bfloat16", "float32"):
            if self.has(name):
                out[f"{name}_layer_mix_gemm_flops_per_s"] = self.result[name]["gemm_flops_per_s"]["layer_mix"]
        return out


def load_or_measure(path: str | None, config, dtypes: tuple[str, ...], quick: bool = True,
                    log: Callable[[str], None] = _log, **measure_options) -> Roofline:
    """The roofline JSON at `path` when it exists and covers `dtypes`; else measure now (quick by
    default: a floor from a short measurement is better than none, and the JSON says which)."""
    if path and os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        if all(d in result for d in dtypes):
            return Roofline(result, source=path)
        log(f"{path} lacks {[d for d in dtypes if d not in result]}; measuring the roofline now")
    else:
        log(f"no roofline JSON at {path}; measuring the roofline now (quick={quick})")
    return Roofline(measure(config, quick=quick, dtypes=dtypes, log=log, **measure_options),
                    source=f"measured in this run (quick={quick})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter timings, fewer row counts")
    ap.add_argument("--out", default="benchmarks/results/roofline.json")
    args = ap.parse_args()
    from phaselab.model.loader import load_checkpoint

    config = load_checkpoint(None).config
    result = measure(config, quick=args.quick)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
