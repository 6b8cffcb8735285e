"""The adaptive prefill budget (issue 17) against fixed budgets, on this machine's bundled model.

    python benchmarks/slo_serving.py                 # interference + Poisson mix, every configuration
    python benchmarks/slo_serving.py --quick         # smaller workloads (a smoke run)

Workloads (the offline engine driven with arrival timing, phaselab.workload.driver.run_arrivals):
  interference  compare's: streams decode, long prompts arrive at token-time points of the streams
  poisson       a mix: Poisson arrivals (--rate req/s), 70% short prompts (32-128 tokens), 30% long
                (512-1024), 32-96 output tokens, EOS ignored
Configurations: prefill-first; chunked at fixed budgets (--budgets, a sweep); adaptive (--slo-tbt-ms)
at two targets, told the TTFT target too (--ttft-slo-s as --slo-ttft-ms: shortest prompt first until a
request has waited half of it); and, at the first --fcfs-adaptive targets, adaptive in FCFS order.
The targets, unless given, are 6x and 12x the median decode-only iteration of the interference streams measured first on this machine (a CPU's speed differs from run to run). They
must be targets some fixed budget can hold, or the acceptance has nothing to match: at 2x and 4x
(44 and 88 ms on an AMD EPYC whose step was 22 ms) none did, every fixed ITL p99 was >= 150 ms
(7x), since a mixed iteration of even 64 prefill tokens leaves the one-row kernel for the batched
GEMM.

Reported per workload and configuration: ITL p50/p99 (every inter-token gap of every request),
TBT attainment at each target (share of gaps within it), TTFT p50/p99, and goodput at each target
(DistServe's: completed requests per second whose TTFT <= --ttft-slo-s and TPOT <= the target).
The acceptance check, per workload and target: adaptive holds its target (ITL p99 <= 1.15 T)
wherever some fixed budget does, with TTFT p50 within 10% of the best fixed budget that holds it.
Every configuration runs --rounds times, interleaved (round k in forward order, round k+1 backward),
so that the load of the shared machine, which drifts during a benchmark, falls on all configurations
alike; each run's 1-minute load average is recorded next to it, the metrics pool every round's gaps
and TTFTs, and the acceptance is also given per round.
Writes benchmarks/results/slo_serving.json (--out), machine and versions included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from phaselab.workload.driver import Arrival, interference_arrivals, random_prompt, run_arrivals  # noqa: E402
from phaselab.workload.interference import InterferenceParams  # noqa: E402


def poisson_arrivals(n: int, rate: float, seed: int = 7) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for i in range(n):
        long = rng.random() < 0.3
        n_in = int(rng.integers(512, 1025) if long else rng.integers(32, 129))
        out.append(Arrival(f"mix-{i}", random_prompt(rng, n_in), int(rng.integers(32, 97)),
                           "long" if long else "short", at_s=t))
        t += float(rng.exponential(1.0 / rate))
    return out


def pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def run_once(engine: Any, arrivals: list[Arrival]) -> dict[str, Any]:
    """One run of `arrivals` on a fresh engine: its requests and iterations, wall time and the load
    average around it (the machine is shared: a run's numbers are read with its load)."""
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    run_arrivals(engine, arrivals)
    wall = time.monotonic() - t0
    learner = getattr(engine, "budget_learner", None)
    return {"requests": list(engine.finished_requests), "iterations": list(engine.iterations), "wall_s": wall,
            "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
            "error_factor": learner.error_factor if learner is not None else None}


def summarize(runs: list[dict[str, Any]], targets: list[float], ttft_slo_s: float) -> dict[str, Any]:
    """The metrics of a configuration over its runs, pooled (every gap and TTFT of every round), and
    each round's ITL p99 / TTFT p50 / load next to it, so a pooled figure can be read against its spread."""
    reqs = [m for r in runs for m in r["requests"]]
    iters = [it for r in runs for it in r["iterations"]]
    gaps = [g for m in reqs for g in m.itl_s]
    ttfts = [m.ttft_s for m in reqs if m.ttft_s is not None]
    spans = [(max(m.finished_ns for m in r["requests"]) - min(m.arrived_ns for m in r["requests"])) / 1e9
             for r in runs if r["requests"]]
    span = sum(spans)
    decode_iters = [r.duration_s for r in iters if r.num_decode_tokens]
    out: dict[str, Any] = {
        "num_runs": len(runs), "num_requests": len(reqs), "wall_s": sum(r["wall_s"] for r in runs), "span_s": span,
        "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
        "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
        "decode_iteration_p50_s": pct(decode_iters, 50), "decode_iteration_p99_s": pct(decode_iters, 99),
        "num_iterations": len(iters), "at": {},
        "rounds": [{"itl_p99_s": pct([g for m in r["requests"] for g in m.itl_s], 99),
                    "ttft_p50_s": pct([m.ttft_s for m in r["requests"] if m.ttft_s is not None], 50),
                    "wall_s": r["wall_s"], "loadavg_1m_before": r["loadavg_1m_before"],
                    "loadavg_1m_after": r["loadavg_1m_after"]} for r in runs],
    }
    budgets = [r.prefill_budget for r in iters if r.prefill_budget is not None]
    if budgets:
        pred = [abs(r.predicted_ns / 1e9 - r.duration_s) / r.duration_s for r in iters
                if r.predicted_ns is not None and r.duration_s > 0]
        mixed = [r for r in iters if r.num_decode_tokens and r.num_prefill_tokens]
        out["adaptive"] = {"budget_p50": pct(budgets, 50), "budget_min": min(budgets), "budget_max": max(budgets),
                           # the budget where it binds: iterations with decodes and prefill waiting
                           "mixed_prefill_tokens_p50": pct([r.num_prefill_tokens for r in mixed], 50),
                           "num_infeasible": sum(1 for r in iters if r.slo_feasible is False),
                           "prediction_error_p50": pct(pred, 50), "prediction_error_p90": pct(pred, 90),
                           "error_factor_end": [r["error_factor"] for r in runs]}
    for t in targets:
        good = [m for m in reqs if m.ttft_s is not None and m.ttft_s <= ttft_slo_s
                and (m.tpot_s is None or m.tpot_s <= t)]
        out["at"][f"{t * 1e3:g}"] = {
            "tbt_attainment": sum(1 for g in gaps if g <= t) / len(gaps) if gaps else None,
            "holds": bool(gaps) and pct(gaps, 99) <= 1.15 * t,  # type: ignore[operator]
            "goodput_rps": len(good) / span if span > 0 else None,
        }
    return out


def acceptance(results: dict[str, dict[str, Any]], targets: list[float]) -> list[dict[str, Any]]:
    checks = []
    for t in targets:
        key = f"{t * 1e3:g}"
        fixed = {n: r for n, r in results.items() if not n.startswith("adaptive")}
        holding = {n: r for n, r in fixed.items() if r["at"][key]["holds"]}
        mine = results.get(f"adaptive-{key}ms")
        if mine is None:
            continue
        best = min(holding.items(), key=lambda kv: kv[1]["ttft_p50_s"]) if holding else None
        check = {"target_ms": t * 1e3, "fixed_that_hold": sorted(holding), "adaptive_holds": mine["at"][key]["holds"],
                 "adaptive_itl_p99_s": mine["itl_p99_s"], "adaptive_ttft_p50_s": mine["ttft_p50_s"]}
        if best is not None:
            check.update(best_fixed=best[0], best_fixed_ttft_p50_s=best[1]["ttft_p50_s"],
                         ttft_ratio=mine["ttft_p50_s"] / best[1]["ttft_p50_s"],
                         passed=mine["at"][key]["holds"] and mine["ttft_p50_s"] <= 1.10 * best[1]["ttft_p50_s"])
        else:
            check["passed"] = None  # no fixed budget holds it: nothing to match
        checks.append(check)
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budgets", default=None, help="fixed chunk budgets, comma-separated (default 64,128,256,512,1024)")
    ap.add_argument("--slo-tbt-ms", default=None, help="the two adaptive targets (default: 6x and 12x the decode step)")
    ap.add_argument("--ttft-slo-s", type=float, default=10.0, help="TTFT target of goodput (default 10 s on a CPU)")
    ap.add_argument("--rate", type=float, default=None, help="Poisson mix: requests per second (default 1.0)")
    ap.add_argument("--num-mix", type=int, default=None, help="Poisson mix: requests (default 40; --quick 12)")
    ap.add_argument("--fcfs-adaptive", type=int, default=1,
                    help="also run the adaptive budget with the FCFS order at the first N targets (default 1)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every configuration (default 2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "slo_serving.json"))
    ns = ap.parse_args()

    import torch

    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import resolve_dtype
    from phaselab.model.loader import load_checkpoint
    from phaselab.serving_engine import make_engine

    budgets = [int(b) for b in (ns.budgets or ("64,256,1024" if ns.quick else "64,128,256,512,1024")).split(",")]
    inter = (InterferenceParams.in_tokens(4, 16, num_streams=3, stream_input_len=48, stream_output_len=48,
                                          num_long_prompts=2, long_input_len=768, long_output_len=4) if ns.quick
             else InterferenceParams.in_tokens(8, 24, stream_output_len=96))  # compare's interference
    mix = poisson_arrivals(ns.num_mix or (12 if ns.quick else 40), ns.rate or 1.0)
    workloads = {"interference": interference_arrivals(inter), "poisson": mix}
    dtype, dtype_why = resolve_dtype(ns.dtype)
    print(f"loading the bundled model ({dtype}: {dtype_why})", file=sys.stderr)
    ckpt = load_checkpoint(None, dtype)

    def engine(**kw: Any) -> Any:
        args = EngineArgs(dtype=str(dtype).removeprefix("torch."), kv_cache_memory="512MiB", max_model_len=2048, **kw)
        return make_engine(args, checkpoint=ckpt)

    if ns.slo_tbt_ms:
        targets = [float(t) / 1e3 for t in ns.slo_tbt_ms.split(",")]
        step = None
    else:  # the decode step of the interference streams, alone
        e = engine(policy="chunked", max_num_batched_tokens=64)
        streams = [a for a in interference_arrivals(inter) if a.group == "stream"]
        run_arrivals(e, streams)
        step = float(np.median([r.duration_s for r in e.iterations if r.num_decode_tokens and not r.num_prefill_tokens]))
        targets = [round(6 * step, 3), round(12 * step, 3)]
        print(f"decode step of {len(streams)} streams: {step * 1e3:.1f} ms -> targets "
              f"{', '.join(f'{t * 1e3:g} ms' for t in targets)}", file=sys.stderr)
    configs: list[tuple[str, dict[str, Any]]] = [("prefill-first", dict(policy="prefill-first"))]
    configs += [(f"chunked-{b}", dict(policy="chunked", max_num_batched_tokens=b)) for b in budgets]
    # SLO-aware serving is told both targets: the budget follows the TBT target, the prefill order
    # the TTFT target of goodput (core/adaptive_budget.py's prefill_rank); "-fcfs" keeps the order FCFS, to
    # show what each of the two does
    configs += [(f"adaptive-{t * 1e3:g}ms", dict(policy="chunked", max_num_batched_tokens=max(budgets),
                                                 slo_tbt_ms=t * 1e3, slo_ttft_ms=ns.ttft_slo_s * 1e3))
                for t in targets]
    configs += [(f"adaptive-{t * 1e3:g}ms-fcfs", dict(policy="chunked", max_num_batched_tokens=max(budgets),
                                                      slo_tbt_ms=t * 1e3)) for t in targets[:ns.fcfs_adaptive]]
    report: dict[str, Any] = {
        "machine": {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg_at_start": list(os.getloadavg()), "torch": torch.__version__,
                    "torch_num_threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                    "dtype": str(dtype)},
        "decode_step_s": step, "targets_s": targets, "ttft_slo_s": ns.ttft_slo_s, "budgets": budgets,
        "rounds": ns.rounds, "workloads": {}, "acceptance": {}, "acceptance_per_round": {},
    }
    try:
        with open("/proc/cpuinfo") as f:
            report["machine"]["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    # Interleaved: round k runs every configuration once, in forward order on even rounds and
    # backward on odd ones, so a load that drifts during the benchmark falls on all of them alike
    # (run one after another, the last configuration met a different machine than the first).
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {name: [] for name, _ in configs} for w in workloads}
    for k in range(ns.rounds):  # every workload in each round: a cut-short benchmark still has both
        for wname, arrivals in workloads.items():
            order = configs if k % 2 == 0 else configs[::-1]
            for name, kw in order:
                print(f"[round {k + 1}/{ns.rounds} {wname}] {name} ({len(arrivals)} requests, load "
                      f"{os.getloadavg()[0]:.1f})", file=sys.stderr)
                e = engine(**kw)
                run = run_once(e, arrivals)
                e.shutdown()
                runs[wname][name].append(run)
                r = summarize([run], targets, ns.ttft_slo_s)
                print(f"    ITL p50 {r['itl_p50_s'] * 1e3:.0f} ms p99 {r['itl_p99_s'] * 1e3:.0f} ms; TTFT p50 "
                      f"{r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s; wall {r['wall_s']:.0f} s", file=sys.stderr)
            wr = runs[wname]
            results = {name: summarize(rs, targets, ns.ttft_slo_s) for name, rs in wr.items() if rs}
            report["workloads"][wname] = results
            report["acceptance"][wname] = acceptance(results, targets)
            report["acceptance_per_round"][wname] = [
                acceptance({name: summarize([rs[i]], targets, ns.ttft_slo_s) for name, rs in wr.items()}, targets)
                for i in range(k + 1)]
            report["rounds_done"] = k + 1
            report["machine"]["loadavg_at_end"] = list(os.getloadavg())
            os.makedirs(os.path.dirname(ns.out), exist_ok=True)
            with open(ns.out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
    print(table(report))
    return 0


def table(report: dict[str, Any]) -> str:
    keys = [f"{t * 1e3:g}" for t in report["targets_s"]]
    lines = []
    for wname, results in report["workloads"].items():
        lines.append(f"\n{wname}")
        head = ["config", "ITL p50", "ITL p99", "TTFT p50", "TTFT p99"] + \
            [f"attain@{k}ms" for k in keys] + [f"goodput@{k}ms" for k in keys]
        lines.append(" | ".join(head))
        for name, r in results.items():
            cells = [name, f"{r['itl_p50_s'] * 1e3:.0f} ms", f"{r['itl_p99_s'] * 1e3:.0f} ms",
                     f"{r['ttft_p50_s']:.2f} s", f"{r['ttft_p99_s']:.2f} s"]
            cells += [f"{r['at'][k]['tbt_attainment'] * 100:.1f}%" + (" held" if r["at"][k]["holds"] else "")
                      for k in keys]
            cells += [f"{r['at'][k]['goodput_rps']:.3f}/s" for k in keys]
            lines.append(" | ".join(cells))
        for c in report["acceptance"].get(wname, []):
            lines.append(f"target {c['target_ms']:g} ms: fixed that hold {c['fixed_that_hold']}; adaptive holds "
                         f"{c['adaptive_holds']}; TTFT p50 ratio to the best holding fixed "
                         f"{c.get('ttft_ratio', float('nan')):.2f}; passed {c['passed']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
