"""This host's ceilings, measured in a few seconds: the hardware entry a CPU calibration is bounded by.

    python -m phaselab.engine.ceilings [--run RUN_DIR | --model PATH] [--dtype bfloat16] [--threads N]
                                       [--out host.json]

The cost model's efficiencies are fractions of a device's peak FLOP/s and memory bandwidth, at most 1
(phaselab/cost/efficiency.py). On a CPU the "peak" is what this host reaches, not a datasheet, and it
differs between the hosts these sessions run on (an AMD EPYC with AVX512-BF16 does ~215 GFLOP/s bf16
on the bundled model's shapes with 2 threads, the Intel Xeon the catalog's `cpu` entry was measured
on ~180). So the ceilings are measured on the host that makes the run, with the run's dtype, model
shapes and torch threads:

    peak_flops     the fastest GEMM (torch.nn.functional.linear, as the model's nn.Linear runs it) of
                   the model's per-layer linear shapes (qkv, o, gate_up, down) at 256, 1024 and 2048
                   rows: the best of several short trials per shape (a shared machine only ever slows
                   a trial down, so the best one is the closest to the ceiling)
    mem_bandwidth  the read bandwidth of a 256 MiB array (sum), best of several trials
    memory_bytes   MemTotal of /proc/meminfo

The result is a hardware file (phaselab/cost/catalog_files.py's schema, usable as `--hardware
FILE.json` anywhere) whose `host` object names the CPU model, its ISA flags, torch's CPU capability,
the threads, dtype and model, where and when it was measured, the load average before and after,
and every rate measured.

`host_ceilings` measures them once per key and caches them (phaselab/cost/host.py: one file per CPU
model + ISA flags + threads + dtype + the model's layer shapes, under ~/.cache/phaselab/ceilings by
default, `PHASELAB_CEILINGS_DIR` moves it; `--cached` here). The engine records them in the run
directory's config.json ("ceilings") when asked (EngineArgs.measure_ceilings, LLMEngine.record_ceilings();
`phaselab compare` always does), `phaselab simulate calibrate` bounds its fit by them and `phaselab
diagnose` prints its floors against them (docs/simulator.md, "CPU ceilings"; docs/analysis.md,
"Machine ceilings").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from phaselab.cost.host import ISA_FLAGS, ceilings_key, ceilings_file, model_shapes, read_cached, this_cpu  # noqa: F401
from phaselab.modelinfo.model_config import ModelConfig

GEMM_ROWS = (256, 1024, 2048)
BANDWIDTH_BYTES = 256 * 2**20  # far beyond any L3 of these hosts (32 MiB on the EPYC)
LOADED = 0.25  # 1-minute load average per logical CPU from which a measurement counts as made under load
MEASUREMENTS = 3  # at most this many measurements made under load are combined (best of each rate)


def cpu_identity() -> dict[str, Any]:
    """The CPU model name and the ISA flags that decide matmul speed (from /proc/cpuinfo), torch's CPU
    capability and the logical CPUs: what config.json's "machine" and the ceilings' "host" both name,
    so that calibrate can tell whether a run and its ceilings come from the same kind of CPU."""
    model, isa = this_cpu()
    return {"cpu_model": model, "isa": isa,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "logical_cpus": os.cpu_count()}


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def best_time(fn: Callable[[], Any], trials: int, trial_s: float) -> float:
    """Seconds per call of `fn`: the fastest of `trials` trials, each averaging the calls of at least
    `trial_s` seconds (one warm-up call first)."""
    fn()
    best = float("inf")
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= trial_s:
                break
        best = min(best, elapsed / n)
    return best


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, trials: int = 5, trial_s: float = 0.03) -> float:
    """Bytes per second torch's sum reads from an `nbytes` float32 array (best of `trials`)."""
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_time(lambda: a.sum(), trials, trial_s)


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of one layer's linear layers as the model builds them (q/k/v and
    gate/up fused)."""
    return model_shapes(config)


def measure_ceilings(config: ModelConfig, dtype: torch.dtype = torch.bfloat16, rows: tuple[int, ...] = GEMM_ROWS,
                     trials: int = 5, trial_s: float = 0.03, bandwidth_bytes: int = BANDWIDTH_BYTES,
                     log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this host's ceilings in this process (its torch threads); a hardware-file dict (module
    docstring). About 3 s on 2 quiet cores for the bundled model."""
    say = log or (lambda _msg: None)
    dtype_name = str(dtype).removeprefix("torch.")
    ident = cpu_identity()
    load_before, t_start = os.getloadavg(), time.perf_counter()
    measured_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    say(f"measuring this host's ceilings ({ident['cpu_model']}, {torch.get_num_threads()} threads, {dtype_name}) ...")
    gen = torch.Generator().manual_seed(0)
    rates: dict[str, dict[str, float]] = {}
    for name, (k, n) in layer_shapes(config).items():
        w = torch.randn(n, k, generator=gen).to(dtype)
        rates[name] = {}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            t = best_time(lambda x=x, w=w: torch.nn.functional.linear(x, w), trials, trial_s)
            rates[name][str(m)] = 2 * m * k * n / t
    best_shape, best_rows = max(((s, r) for s in rates for r in rates[s]), key=lambda sr: rates[sr[0]][sr[1]])
    peak = rates[best_shape][best_rows]
    read = read_bandwidth(bandwidth_bytes, trials, trial_s)
    load_after, duration = os.getloadavg(), time.perf_counter() - t_start
    host_name = platform.node()
    where = (f"{ident['cpu_model']} ({', '.join(ident['isa']) or 'no AVX2/AVX-512/AMX flags'}), host {host_name}, "
             f"{measured_at}, {torch.get_num_threads()} torch threads, load average {load_before[0]:.1f}")
    say(f"  {dtype_name} GEMM peak {peak / 1e9:.0f} GFLOP/s ({best_shape} at {best_rows} rows); read bandwidth "
        f"{read / 1e9:.1f} GB/s; {duration:.1f} s, load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    return {
        "name": "measured-cpu",
        "peak_flops": peak,
        "mem_bandwidth": read,
        "memory_bytes": _memory_bytes(),
        "tp_link": "pcie4",
        "description": f"this host's CPU as measured: {ident['cpu_model']}, {torch.get_num_threads()} threads, "
                       f"{dtype_name}",
        "sources": {
            "peak_flops": f"measured: phaselab.engine.ceilings on {where}: the fastest {dtype_name} GEMM of "
                          f"{config.name or 'the model'}'s layer shapes, {best_shape} at {best_rows} rows, best of "
                          f"{trials} trials of {trial_s * 1e3:.0f} ms",
            "mem_bandwidth": f"measured: phaselab.engine.ceilings on {where}: read (sum) of a "
                             f"{bandwidth_bytes / 2**20:.0f} MiB array, best of {trials} trials",
            "memory_bytes": "measured: /proc/meminfo MemTotal",
            "tp_link": "default: unused (one device)"},
        "host": {
            **ident, "hostname": host_name, "measured_at": measured_at, "threads": torch.get_num_threads(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "dtype": dtype_name, "model": config.name,
            "load_average_before": list(load_before), "load_average_after": list(load_after),
            "duration_s": round(duration, 2), "gemm_flops_per_s": rates, "read_bytes_per_s": read,
            "torch": torch.__version__, "method": "phaselab.engine.ceilings.measure_ceilings"},
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`.lock: two processes that need one key's ceilings at once (the
    workers of a disaggregated engine) measure them once, not side by side on the same cores."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - closed below
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()


def _loaded(d: dict[str, Any]) -> bool:
    """Whether a cached measurement is worth making again: made on a busy machine (a 1-minute load
    average before it of at least LOADED per logical CPU: a shared machine only ever slows a trial
    down, so its rates are below the ceiling), and fewer than MEASUREMENTS made so far."""
    host = d.get("host") or {}
    load = (host.get("load_average_before") or [0.0])[0]
    return (load >= LOADED * (host.get("logical_cpus") or os.cpu_count() or 1)
            and len(host.get("measurements") or [None]) < MEASUREMENTS)


def _best_of(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` with each rate (peak_flops, mem_bandwidth) the higher of the two measurements, its source
    the one that measured it; host["measurements"] keeps every measurement's date, load and rates."""
    def brief(d: dict[str, Any]) -> dict[str, Any]:
        h = d.get("host") or {}
        return {"measured_at": h.get("measured_at"), "load_average_before": h.get("load_average_before"),
                "peak_flops": d["peak_flops"], "mem_bandwidth": d["mem_bandwidth"]}

    out = json.loads(json.dumps(new))
    out["host"]["measurements"] = list(old["host"].get("measurements") or [brief(old)]) + [brief(new)]
    for rate in ("peak_flops", "mem_bandwidth"):
        if old[rate] > new[rate]:
            out[rate] = old[rate]
            out["sources"][rate] = old["sources"][rate]
    n = len(out["host"]["measurements"])
    out["description"] = f"{new['description']}; each rate the best of {n} measurements made under load"
    return out


def host_ceilings(config: ModelConfig, dtype: torch.dtype = torch.bfloat16, refresh: bool = False,
                  log: Callable[[str], None] | None = None, improve: bool = False) -> dict[str, Any]:
    """This host's ceilings for `config`'s shapes, `dtype` and this process's torch threads: the cached
    file of that key (phaselab/cost/host.py) when it was measured on this CPU with this torch, else
    measured now (measure_ceilings, a few seconds) and cached. `refresh`: measure anew even when
    cached. `improve`: when the cached file was measured on a busy machine (_loaded: at most
    MEASUREMENTS times in all), measure again and keep the higher of each rate (what `phaselab compare` and `--cached` ask before any engine
    runs; an engine recording them takes the cached file as it is, so that every run of one compare
    records the same). The result's host names the file ("cache_file")."""
    say = log or (lambda _msg: None)
    model, isa = this_cpu()
    dtype_name = str(dtype).removeprefix("torch.")
    key = ceilings_key(model, isa, torch.get_num_threads(), dtype_name, model_shapes(config))
    path = ceilings_file(key)
    with _locked(path):
        found = None if refresh else read_cached(key)
        old = found[0] if found and found[0]["host"].get("torch") == torch.__version__ else None
        if old is not None and not (improve and _loaded(old)):
            d = old
            say(f"this host's ceilings ({model}, {key['threads']} threads, {dtype_name}): cached in {path}, measured "
                f"{d['host'].get('measured_at')}: {d['peak_flops'] / 1e9:.0f} GFLOP/s, "
                f"{d['mem_bandwidth'] / 1e9:.1f} GB/s")
        else:
            if old is not None:
                say(f"this host's cached ceilings were measured under load (load average "
                    f"{old['host']['load_average_before'][0]:.1f}): measuring again, keeping the best of each rate")
            d = measure_ceilings(config, dtype, log=log)
            d["host"]["cache_key"] = key
            if old is not None:
                d = _best_of(old, d)
                say(f"  best of {len(d['host']['measurements'])} measurements: {d['peak_flops'] / 1e9:.0f} GFLOP/s, "
                    f"{d['mem_bandwidth'] / 1e9:.1f} GB/s")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
                os.replace(tmp, path)
                say(f"  cached in {path}")
            except OSError as e:
                say(f"  not cached ({path}: {e}); measured again next time")
                return d
    d["host"]["cache_file"] = str(path)
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m phaselab.engine.ceilings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--run", metavar="RUN_DIR",
                     help="take the model, dtype and torch threads from this run's config.json (a disaggregated "
                          "run: its decode workers')")
    src.add_argument("--model", default=None, help="HF model directory or .gguf (default: the bundled model)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: the run's, else bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the run's, else torch's)")
    ap.add_argument("--out", default=None, help="write the hardware JSON here (default: stdout)")
    ap.add_argument("--cached", action="store_true",
                    help="this host's cached ceilings for the key (measured and cached when absent; "
                         "phaselab/cost/host.py says where)")
    ap.add_argument("--refresh", action="store_true", help="with --cached: measure again and replace the cached file")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    dtype_name, threads = args.dtype, args.threads
    if args.run:
        from phaselab.obs.rundir import read_run_dir

        from phaselab.obs.rundir import engine_config

        cfg = engine_config(read_run_dir(args.run).config, "decode")  # a disaggregated run: its decode workers'
        config = ModelConfig.from_dict(cfg["model"]["config"])
        dtype_name = dtype_name or str(cfg.get("dtype", "bfloat16"))
        threads = threads or (cfg.get("machine") or {}).get("torch_num_threads")
    else:
        from phaselab.model.loader import load_checkpoint

        config = load_checkpoint(args.model).config
    if threads:
        torch.set_num_threads(int(threads))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    dtype = getattr(torch, dtype_name or "bfloat16")
    if args.cached:
        result = host_ceilings(config, dtype, args.refresh, log, improve=True)
    else:
        result = measure_ceilings(config, dtype, log=log)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}; calibrate with `phaselab simulate calibrate RUN_DIR --hardware {args.out}`",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
