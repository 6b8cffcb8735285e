"""`phaselab plan`: a deployment for stated SLOs, searched with the simulator (issue 17, item 3).

    SLOs (--slo-ttft-ms, --slo-tbt-ms, --attainment)  +  a workload (random lengths or a trace)
        +  a target (a catalog/file GPU cluster, or this machine: --hardware cpu --params CALIBRATION)
    ─▶ candidates: policy (prefill-first, chunked at fixed budgets, the adaptive budget at the TBT
       target), max_num_seqs, and on clusters TP and the prefill:decode ratio (sim/search.py)
    ─▶ each candidate's goodput (DistServe's: the highest request rate at which >= attainment of
       the requests meet TTFT <= target and TPOT <= the TBT target), by simulation
    ─▶ the top configurations, with goodput per GPU

The TBT target serves twice: as the goodput's TPOT bound and as the adaptive candidates' target.
`--verify` (this machine only: --hardware cpu, the bundled model, colocated) calibrates the
simulator on a short run unless --params is given, plans, then runs the top configurations for
real at their planned rate and prints predicted vs measured attainment and goodput (phaselab/experiments/plan_verify.py);
exit 3 when a measured goodput is off by more than --verify-tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from phaselab.core.config import BUDGETS_TRIED_TEXT
from phaselab.sim.deployment import TPS_TRIED_TEXT
from phaselab.errors import ConfigError


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="search a deployment for TTFT/TBT SLOs with the simulator (docs/slo.md)",
        description="Search policy, chunk budget (fixed or adaptive), max_num_seqs and, on clusters, the "
                    "prefill:decode ratio and tensor parallelism for the best goodput per GPU under the given SLOs "
                    "(DistServe's goodput), by simulation; print the top configurations.")
    s = p.add_argument_group("SLOs")
    s.add_argument("--slo-ttft-ms", type=float, required=True, help="time-to-first-token target (ms)")
    s.add_argument("--slo-tbt-ms", type=float, required=True,
                   help="time-between-tokens target (ms): goodput's TPOT bound and the adaptive budget's target")
    s.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting both (default: 0.9)")
    t = p.add_argument_group("target")
    t.add_argument("--model", default="llama-3-8b", help="catalog model or a Hugging Face config.json / directory")
    t.add_argument("--hardware", default="h100", help="catalog hardware (cpu: this machine, with --params)")
    t.add_argument("--params", default=None, help="cost parameters JSON (`phaselab simulate calibrate RUN_DIR`)")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "int8"])
    t.add_argument("--max-gpus", type=int, default=8, help="GPUs of one deployment unit (default: 8)")
    t.add_argument("--modes", default="colocated,disagg", help="(default: colocated,disagg)")
    t.add_argument("--tps", default=TPS_TRIED_TEXT, help="tensor parallelism to try (default: %(default)s)")
    t.add_argument("--budgets", default=BUDGETS_TRIED_TEXT, help="fixed chunk budgets to try (default: %(default)s)")
    t.add_argument("--max-num-seqs", default="64,256", help="seats per engine to try (default: 64,256)")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="a bench trace JSONL (arrivals rescaled per tried rate)")
    w.add_argument("--num-prompts", type=int, default=200, help="requests per simulation (default: 200)")
    w.add_argument("--input-len", default="uniform:256:2048", help="(default: uniform:256:2048)")
    w.add_argument("--output-len", default="uniform:64:512", help="(default: uniform:64:512)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--bisections", type=int, default=5, help="rate bisection steps (default: 5)")
    p.add_argument("--top", type=int, default=5, help="configurations to print (default: 5)")
    v = p.add_argument_group("verify (this machine)")
    v.add_argument("--verify", action="store_true",
                   help="run the top colocated configurations for real with the bundled model at their planned rate "
                        "and compare with the prediction (needs --hardware cpu; calibrates first unless --params)")
    v.add_argument("--verify-top", type=int, default=2, help="configurations to run (default: 2)")
    v.add_argument("--verify-tolerance", type=float, default=0.2,
                   help="largest |measured - predicted| / predicted goodput that passes (default: 0.2)")
    v.add_argument("--verify-runs", type=int, default=3,
                   help="real runs of each configuration, alternated between them; the median counts (default: 3)")
    v.add_argument("--verify-dir", default=None,
                   help="write each measured run's run directory under this folder (rank-I/run-J)")
    p.add_argument("--result-json", default=None, help="write every candidate, ranked, here")


def _csv(text: str, kind: type) -> list[Any]:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def trace_workload_at(path: str, num_prompts: int | None) -> Any:
    """A trace's requests with their arrival gaps scaled so that its mean rate is the tried rate."""
    from phaselab.sim.workload import trace_requests

    base = trace_requests(path, num_prompts)
    span = max(r.arrival_s for r in base) if base else 0.0
    native = (len(base) - 1) / span if span > 0 else None
    if native is None:
        raise ConfigError(f"{path}: the trace's requests all arrive at once; give one with arrival times")

    def at(rate: float) -> list[Any]:
        return [dataclasses.replace(r, arrival_s=r.arrival_s * native / rate) for r in base]

    return at


def run_plan(ns: argparse.Namespace) -> int:
    from phaselab.cost.catalog import get_hardware
    from phaselab.sim.simulate_cli import DTYPE_BYTES, resolve_model
    from phaselab.cost.pricing import CostParams
    from phaselab.sim.search import SLO, candidates, random_workload_at, search

    if ns.slo_ttft_ms <= 0 or ns.slo_tbt_ms <= 0:
        raise ConfigError("--slo-ttft-ms and --slo-tbt-ms must be > 0 (milliseconds)")
    slo = SLO("goodput", ns.slo_ttft_ms / 1e3, ns.slo_tbt_ms / 1e3, ns.attainment)
    model, hw = resolve_model(ns.model), get_hardware(ns.hardware)
    params = CostParams.load(ns.params) if ns.params else None
    workload = (trace_workload_at(ns.trace, ns.num_prompts) if ns.trace
                else random_workload_at(ns.num_prompts, ns.input_len, ns.output_len, ns.seed))
    verifier = None
    if ns.verify:
        from phaselab.experiments.plan_verify import Verifier

        if ns.verify_runs < 1:
            raise ConfigError(f"--verify-runs must be >= 1 (got {ns.verify_runs})")
        if hw.name != "cpu":
            raise ConfigError(f"--verify runs the planned configurations on this machine; plan with --hardware cpu "
                              f"(got {hw.name!r}), or drop --verify to plan for {hw.name} by simulation alone")
        verifier = Verifier("float32" if ns.dtype == "float32" else "bfloat16")
        model = verifier.model  # the model that will run, as loaded
        ns.modes, ns.tps = "colocated", "1"
        print(f"phaselab plan: --verify plans the bundled model ({model.name or model.architecture}), colocated, "
              "on this machine", file=sys.stderr)
        if params is None:
            if hw.name == "cpu":  # the catalog's default, another session's CPU: bound the fit by this one's
                hw = verifier.host_hardware()
            params = verifier.calibrate(workload, _csv(ns.budgets, int), hw)
    elif hw.name == "cpu" and params is None:
        print("phaselab plan: note: --hardware cpu without --params uses placeholder efficiencies; calibrate on a "
              "run of this machine first (`phaselab simulate calibrate RUN_DIR --out cpu.json`)", file=sys.stderr)
    deps = candidates(model, hw, ns.max_gpus, _csv(ns.modes, str), _csv(ns.tps, int), _csv(ns.budgets, int),
                      ("chunked", "prefill-first"), 4, params, {"dtype_bytes": DTYPE_BYTES[ns.dtype]},
                      adaptive_tbt_ms=(ns.slo_tbt_ms,), max_num_seqs=_csv(ns.max_num_seqs, int))
    if not deps:
        raise ConfigError(f"no deployment of {model.name} fits {ns.max_gpus} x {hw.name}; raise --max-gpus")
    print(f"objective: {slo.definition()}")
    print(f"planning {model.name} on {hw.name}: {len(deps)} configurations, {ns.num_prompts} requests per simulation",
          file=sys.stderr)

    def progress(i: int, n: int, c: Any) -> None:
        print(f"  [{i}/{n}] {c.deployment.describe()}: {c.rate:.3g} req/s", file=sys.stderr)

    result = search(deps, workload, slo, num_bisections=ns.bisections, progress=progress)
    ranked = [c for c in result.ranked() if c.error is None]
    print(f"{'rank':>4}  {'goodput/GPU':>11}  {'goodput':>8}  {'attain':>6}  configuration")
    for i, c in enumerate(ranked[: ns.top], start=1):
        print(f"{i:>4}  {c.per_gpu:>9.3g}/s  {c.rate:>6.3g}/s  {c.figure:>6.0%}  {c.deployment.describe()}")
    out = {**result.to_json(), "arguments": {k: v for k, v in vars(ns).items()
                                             if isinstance(v, (str, int, float, bool, type(None)))}}
    code = 0 if result.best else 1
    if verifier is None:
        print("predicted by the simulator (phaselab/sim); not verified by a real run (--verify runs them on this "
              "machine)")
    else:
        from phaselab.experiments.plan_verify import render, verify

        rows = verify(ranked, workload, slo, verifier, ns.verify_top, ns.verify_tolerance, ns.verify_dir,
                      ns.verify_runs)
        print(render(rows, ns.verify_tolerance))
        from phaselab.model.kernels.linear_timing import cpu_info

        out["verify"] = {"tolerance": ns.verify_tolerance, "cpu": cpu_info()["model"],
                         "hardware": {"name": hw.name, "peak_flops": hw.peak_flops, "mem_bandwidth": hw.mem_bandwidth,
                                      "sources": dict(hw.sources)},
                         "rows": [r.to_json(ns.verify_tolerance) for r in rows]}
        if not all(r.within(ns.verify_tolerance) for r in rows):
            code = 3
    if ns.result_json:
        with open(ns.result_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
    return code
