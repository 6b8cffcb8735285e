"""Threads between kernel calls (issue 18): OpenMP's wait policy and the kernel pool, alone and two at once.

A decode step of the bundled model calls ~120 small native kernels back to back, with a few
microseconds of Python between them. How the threads wait between two calls decides whether the
next call starts at once:

    PASSIVE           OpenMP's team (PHASELAB_POOL=0), OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0:
                      the threads sleep at once; each call wakes them again, and waking an idle
                      (virtual) core costs more than a small call
    spin-20000        OpenMP's team, GOMP_SPINCOUNT=20000: the threads spin 20000 pause loops, then
                      sleep; OpenMP's static split waits at its barrier for a descheduled thread
    pool              phaselab's kernel pool (phaselab/model/kernels/pool.c, the default), OpenMP
                      PASSIVE: workers spin 200 us after a call, yielding to other runnable threads,
                      then sleep; chunks are claimed, so nobody waits for a descheduled worker
    pool+spin-20000   the pool, and OpenMP's team (torch's own ops, the GEMMs above the kernel's
                      row count) spinning too: what `generate` runs (cli.py's `auto`)

Each configuration runs in its own process (OpenMP reads the variables when torch loads it): the
engine (`--dtype auto`, as served) decodes --batches of 512-token prompts, and the median
decode-only iteration is kept, with the process's CPU seconds per step (both threads: what the
spinning costs). "alone" runs one process; "two at once" runs two identical processes side by
side on the same cores, as two disaggregated workers do, where a spinning thread holds a core the
other process's thread needs. Rounds alternate the configurations (the machine's speed drifts).

Writes benchmarks/results/wait_policy.json (--out), naming the CPU. Usage:
`python benchmarks/wait_policy.py [--rounds 2] [--batches 1 4 16] [--policies pool PASSIVE]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from phaselab.engine_args import SPIN_COUNT  # noqa: E402  (no torch: the children load it)

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
POLICIES = {"PASSIVE": {**PASSIVE, "PHASELAB_POOL": "0"},
            f"spin-{SPIN_COUNT}": {**PASSIVE, "GOMP_SPINCOUNT": SPIN_COUNT, "PHASELAB_POOL": "0"},
            "pool": {**PASSIVE, "PHASELAB_POOL": "1"},
            f"pool+spin-{SPIN_COUNT}": {**PASSIVE, "GOMP_SPINCOUNT": SPIN_COUNT, "PHASELAB_POOL": "1"}}


def log(msg: str) -> None:
    print(f"[wait_policy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child(batches: list[int], output_len: int) -> dict[str, Any]:
    """One engine in this process: median decode-only iteration per batch, and CPU s per step."""
    import numpy as np

    from phaselab.engine_args import EngineArgs
    from phaselab.serving_engine import make_engine
    from phaselab.workload.driver import Arrival, random_prompt, run_arrivals

    eng = make_engine(EngineArgs(dtype="auto", kv_cache_memory="1GiB", max_model_len=1024,
                                 max_num_batched_tokens=1024))
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for b in batches:
        arrivals = [Arrival(f"b{b}-{i}", random_prompt(rng, 512), output_len, "x", at_s=0.0) for i in range(b)]
        n0 = len(eng.iterations)
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        run_arrivals(eng, arrivals)
        cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - t0
        its = [it for it in eng.iterations[n0:]]
        steps = [it.duration_s for it in its if it.num_decode_tokens == b and not it.num_prefill_tokens]
        cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        out[str(b)] = {"step_ms": float(np.median(steps)) * 1e3, "num_steps": len(steps),
                       "cpu_s_per_wall_s": cpu / wall if wall > 0 else None}
    eng.shutdown()
    return out


def spawn(policy: str, batches: list[int], output_len: int) -> subprocess.Popen[str]:
    env = {**os.environ, **POLICIES[policy], "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "--child", "--batches", *map(str, batches), "--output-len", str(output_len)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def result(p: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, _ = p.communicate(timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"a benchmark process failed (exit {p.returncode}); run it alone with --child to see why")
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--output-len", type=int, default=48, help="decode steps per batch (default 48)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
                    help="configurations to run (default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "wait_policy.json"))
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(child(ns.batches, ns.output_len)))
        return 0
    from phaselab.engine.ceilings import cpu_identity

    report: dict[str, Any] = {"cpu": cpu_identity(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "loadavg_at_start": os.getloadavg()[0], "batches": ns.batches,
                              "policies": POLICIES, "runs": []}
    order = ns.policies
    for k in range(ns.rounds):
        for policy in (order if k % 2 == 0 else order[::-1]):
            for together in (1, 2):
                log(f"round {k + 1}/{ns.rounds}: {policy}, {'alone' if together == 1 else 'two at once'} "
                    f"(load {os.getloadavg()[0]:.1f})")
                load = os.getloadavg()[0]
                procs = [spawn(policy, ns.batches, ns.output_len) for _ in range(together)]
                outs = [result(p) for p in procs]
                for i, o in enumerate(outs):
                    report["runs"].append({"round": k, "policy": policy, "processes": together, "process": i,
                                           "loadavg_1m": load, "batches": o})
                log("    " + "; ".join(f"batch {b}: " + " / ".join(f"{o[str(b)]['step_ms']:.1f}" for o in outs)
                                       + " ms" for b in ns.batches))
    report["loadavg_at_end"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    log(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
