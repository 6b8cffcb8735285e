"""`phaselab simulate`: run, replay, calibrate and search simulated deployments (docs/simulator.md).

    phaselab simulate run --model llama-3-70b --hardware h100 --mode disagg --prefill-workers 2 \\
        --decode-workers 2 --tp-prefill 4 --tp-decode 4 --transfer-link 25gbe --request-rate 4 --out DIR
    phaselab simulate replay RUN_DIR            the real run's iteration times in, its plans compared
    phaselab simulate calibrate RUN_DIR --out cpu.json
    phaselab simulate fit --vidur a100 --out a100.json   a device's curves from operator profile tables
    phaselab simulate search --model llama-3-8b --hardware h100 --max-gpus 8 --ttft-slo 0.5 --tpot-slo 0.05
    phaselab simulate catalog                   hardware, links and models with their sources

Wired into `phaselab` by cli.py: `add_simulate_parser(sub)` and `run_simulate(ns)`. Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from phaselab.cliargs import add_fields, field_values
from phaselab.core.config import BUDGETS_TRIED_TEXT
from phaselab.errors import ConfigError
from phaselab.cost.catalog import GiB, HARDWARE, LINKS, MODELS, get_hardware, get_model, model_from_hf_config
from phaselab.sim.deployment import TPS_TRIED_TEXT, Deployment, RoleConfig
from phaselab.modelinfo.model_config import ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "float32": 4}
MODEL_FIELDS = ("gpu_memory_utilization", "max_model_len")  # Deployment fields among the model options
ROLE_FIELDS = ("policy", "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
               "max_num_partial_prefills", "num_blocks", "slo_tbt_ms", "slo_ttft_ms", "slo_margin", "slo_min_chunk")
DEPLOYMENT_FIELDS = ("block_size", "enable_prefix_caching", "tp_link", "transfer_link", "transfer_mode",
                     "first_token_from", "routing_policy")


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="simulate deployments with the engine's own scheduler on a virtual clock (docs/simulator.md)",
        description="Simulate GPU deployments (colocated replicas or disaggregated prefill/decode pools) with "
                    "phaselab's own scheduler and router on a virtual clock and a per-iteration cost model; "
                    "writes the same run directory as a real run.")
    sub = p.add_subparsers(dest="sim_command", required=True, metavar="SUBCOMMAND")

    run = sub.add_parser("run", help="simulate one deployment under one workload",
                         description="Simulate one deployment under one workload; print a summary and optionally "
                                     "write a run directory (--out) that diagnose, timeline and compare read.")
    _add_deployment_args(run)
    _add_workload_args(run)
    run.add_argument("--out", metavar="DIR", default=None, help="write the run directory here")
    run.add_argument("--result-json", default=None, help="write the summary JSON here")
    run.add_argument("--no-iterations", action="store_true",
                     help="keep no iteration records (faster, smaller; the run directory has no iterations)")

    rp = sub.add_parser("replay", help="replay a real run's measured iteration times; compare the plans",
                        description="Feed the simulator the measured iteration times of a real run: its scheduler "
                                    "must take the same decisions, iteration by iteration.")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--out", metavar="DIR", default=None, help="write the replayed run directory here")

    cal = sub.add_parser("calibrate", help="fit efficiencies and overheads to a real run's iteration log",
                         description="Fit the cost model's efficiencies and overheads to a real run (measured "
                                     "iteration times vs the plans' FLOPs and bytes, least squares) and report the "
                                     "fit error.")
    cal.add_argument("run_dir", metavar="RUN_DIR")
    cal.add_argument("--hardware", default=None,
                     help="hardware JSON file (or catalog entry) whose ceilings bound the fit (default: the ceilings "
                          "the engine recorded in the run, else this CPU's cached ones for the run (measured now, "
                          "once, when the run was made on this CPU), else the catalog's cpu entry, with a warning)")
    cal.add_argument("--measure-host", metavar="FILE.json", default=None,
                     help="measure this host's ceilings now (the run's model, dtype and threads; a few seconds), write "
                          "them to FILE.json and bound the fit by them")
    cal.add_argument("--out", default=None, help="write the fitted parameters (JSON, with sources) here")
    cal.add_argument("--weighting", default="sqrt", choices=["sqrt", "relative", "absolute"],
                     help="least-squares weight of each iteration's error: 1/sqrt(time), 1/time or 1 "
                          "(default: %(default)s)")

    from phaselab.cost.profile_fit import add_fit_parser

    add_fit_parser(sub)

    se = sub.add_parser("search", help="find the deployment with the best goodput (or capacity) per GPU",
                        description="Search deployments (prefill:decode ratio, tensor parallelism per phase, chunk "
                                    "budget, policy) for the highest goodput per GPU under TTFT and TPOT SLOs at an "
                                    "attainment (DistServe), or the highest capacity under a P99 time-between-tokens "
                                    "SLO (Sarathi-Serve).")
    _add_model_args(se)
    se.add_argument("--max-gpus", type=int, default=8, help="GPUs of one deployment unit (default: %(default)s)")
    se.add_argument("--modes", default="colocated,disagg", help="(default: %(default)s)")
    se.add_argument("--tps", default=TPS_TRIED_TEXT, help="tensor parallelism to try (default: %(default)s)")
    se.add_argument("--budgets", default=BUDGETS_TRIED_TEXT, help="token budgets to try (default: %(default)s)")
    se.add_argument("--policies", default="chunked,prefill-first", help="colocated policies (default: %(default)s)")
    se.add_argument("--max-pool", type=int, default=4, help="most engines per disagg pool (default: %(default)s)")
    se.add_argument("--prefill-decode", default=None, metavar="P:D,...",
                    help="disagg engine ratios to try, e.g. 1:1,2:1 (default: every coprime pair up to --max-pool)")
    se.add_argument("--prefill-policies", default="chunked", help="disagg prefill pool policies (default: %(default)s)")
    add_fields(se, RoleConfig, ("max_num_seqs", "long_prefill_token_threshold"))
    add_fields(se, Deployment, ("transfer_link", "transfer_mode", "first_token_from"))
    g = se.add_argument_group("SLO")
    g.add_argument("--objective", default="goodput", choices=["goodput", "capacity"],
                   help="goodput: DistServe's (TTFT and TPOT SLOs at an attainment); capacity: Sarathi-Serve's "
                        "(P99 time between tokens) (default: %(default)s)")
    g.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default: %(default)s)")
    g.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default: %(default)s)")
    g.add_argument("--attainment", type=float, default=0.9, help="(default: %(default)s)")
    g.add_argument("--tbt-slo", type=float, default=0.1, help="P99 time between tokens, seconds (default: %(default)s)")
    g.add_argument("--max-queue", type=float, default=2.0, help="capacity: median scheduling delay bound, s")
    w = se.add_argument_group("workload (random, Poisson)")
    w.add_argument("--num-prompts", type=int, default=300, help="requests per simulation (default: %(default)s)")
    w.add_argument("--input-len", default="uniform:256:1024", help="(default: %(default)s)")
    w.add_argument("--output-len", default="uniform:64:256", help="(default: %(default)s)")
    w.add_argument("--burstiness", type=float, default=1.0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--bisections", type=int, default=6, help="rate bisection steps (default: %(default)s)")
    se.add_argument("--result-json", default=None, help="write the ranked candidates here")

    sub.add_parser("catalog", help="list hardware, links and models with their sources")
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", default="llama-3-8b",
                   help=f"catalog name ({', '.join(MODELS)}) or a Hugging Face config.json / model directory "
                        "(default: %(default)s)")
    m.add_argument("--hardware", default="h100", help=f"{', '.join(HARDWARE)}, or a hardware JSON file "
                                                      "(docs/simulator.md) (default: %(default)s)")
    m.add_argument("--params", default=None, help="cost parameters JSON (from `simulate calibrate`)")
    m.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_BYTES),
                   help="weights and KV (default: %(default)s)")
    add_fields(m, Deployment, MODEL_FIELDS)


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    # every flag generated from Deployment's and RoleConfig's fields (phaselab/cliargs.py)
    d = p.add_argument_group("deployment", "the scheduler options apply to the colocated and prefill engines; "
                                           "decode engines take --max-num-seqs and --num-blocks")
    add_fields(d, Deployment, ["mode", "num_replicas"])
    add_fields(d, RoleConfig, ["tp"], help_suffix=", colocated")
    add_fields(d, Deployment, ["num_prefill", "num_decode"])
    add_fields(d, RoleConfig, ["tp"], flag_suffix="-prefill", dest_suffix="_prefill", help_suffix=", disagg prefill")
    add_fields(d, RoleConfig, ["tp"], flag_suffix="-decode", dest_suffix="_decode", help_suffix=", disagg decode")
    add_fields(d, RoleConfig, ROLE_FIELDS)
    add_fields(d, Deployment, DEPLOYMENT_FIELDS)
    d.add_argument("--interconnect", dest="tp_link", default=argparse.SUPPRESS, metavar="TP_LINK",
                   help="the same as --tp-link: a link name or a link JSON file (docs/simulator.md)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    from phaselab.workload.interference import InterferenceParams
    from phaselab.workload.params import SharedPrefixParams

    w = p.add_argument_group("workload (the same generators and seeds as the bench's: phaselab/workload)")
    w.add_argument("--workload", default="random", choices=["random", "shared-prefix", "interference", "trace"])
    w.add_argument("--num-prompts", type=int, default=1000)
    w.add_argument("--input-len", default="512",
                   help="length spec: N, uniform:LO:HI, normal:M:S, lognormal:M:S, choice:A,B")
    w.add_argument("--output-len", default="128")
    add_fields(w, SharedPrefixParams, ("num_groups", "prefix_len", "suffix_len"))
    add_fields(w, InterferenceParams)
    w.add_argument("--trace", default=None, help="JSONL trace (arrival, input and output token counts)")
    w.add_argument("--time-scale", type=float, default=1.0)
    w.add_argument("--tokenizer", default=None,
                   help="build the bench's exact prompts with this tokenizer ('bundled', a .gguf, an HF directory or "
                        "tokenizer.json) and simulate their token ids (prefix hits of real text included); "
                        "default: token counts only")
    w.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                   help="with --tokenizer: count prompt tokens as the bench's endpoint does (default: %(default)s)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="open loop, req/s (default: inf, all at once)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    a.add_argument("--concurrency", type=int, default=None, help="closed loop: N users")
    a.add_argument("--seed", type=int, default=0)


# -- building blocks from arguments -------------------------------------------------------------------------
def resolve_model(name: str) -> ModelConfig:
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return model_from_hf_config(json.load(f), name=os.path.basename(os.path.dirname(os.path.abspath(path))))
    return get_model(name)


def build_deployment(ns: argparse.Namespace) -> Any:
    from phaselab.cost.pricing import CostParams

    params = CostParams.load(ns.params) if ns.params else None
    role = field_values(ns, RoleConfig, ROLE_FIELDS)
    decode = {k: role[k] for k in ("max_num_seqs", "num_blocks")}
    return Deployment(
        resolve_model(ns.model), get_hardware(ns.hardware), ns.mode, num_replicas=ns.num_replicas,
        num_prefill=ns.num_prefill, num_decode=ns.num_decode,
        colocated=RoleConfig(tp=ns.tp, **role), prefill=RoleConfig(tp=ns.tp_prefill, **role),
        decode=RoleConfig(tp=ns.tp_decode, **decode), dtype_bytes=DTYPE_BYTES[ns.dtype], params=params,
        **field_values(ns, Deployment, MODEL_FIELDS + DEPLOYMENT_FIELDS))


def build_workload(ns: argparse.Namespace) -> tuple[list[Any], Any, dict[str, Any]]:
    from phaselab.sim.workload import interference_requests, random_requests, shared_prefix_requests, trace_requests
    from phaselab.workload.arrivals import ArrivalPlan
    from phaselab.workload.interference import InterferenceParams

    self_timed = ns.workload in ("interference", "trace")
    if self_timed and (ns.concurrency is not None or not math.isinf(ns.request_rate)):
        raise ConfigError(f"the {ns.workload} workload carries its own arrival times; "
                          "drop --request-rate/--concurrency")
    arrivals = ArrivalPlan(request_rate=ns.request_rate, burstiness=ns.burstiness, concurrency=ns.concurrency,
                           self_timed=self_timed)
    info: dict[str, Any] = {"kind": ns.workload, "seed": ns.seed}
    if ns.tokenizer:
        return exact_workload(ns, arrivals), arrivals, {**info, "tokenizer": ns.tokenizer, "endpoint": ns.endpoint}
    if ns.workload == "random":
        reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, arrivals)
        info |= {"input_len": ns.input_len, "output_len": ns.output_len}
    elif ns.workload == "shared-prefix":
        reqs = shared_prefix_requests(ns.num_prompts, ns.num_groups, ns.prefix_len, ns.suffix_len,
                                      ns.output_len, ns.seed, arrivals)
        info |= {"num_prefix_groups": ns.num_groups, "prefix_len": ns.prefix_len, "suffix_len": ns.suffix_len}
    elif ns.workload == "interference":
        params = InterferenceParams(**field_values(ns, InterferenceParams))
        reqs = interference_requests(params)
        info |= {"params": params.to_json()}
    else:
        if not ns.trace:
            raise ConfigError("--workload trace needs --trace FILE")
        reqs = trace_requests(ns.trace, ns.num_prompts, ns.time_scale)
        info |= {"trace": ns.trace, "time_scale": ns.time_scale}
    return reqs, arrivals, info


def exact_workload(ns: argparse.Namespace, arrivals: Any) -> list[Any]:
    """The bench's own requests for these options and seed (its build_workload, its prompt builder),
    tokenized as its endpoint counts them, with its arrival times."""
    from phaselab.sim.workload import from_bench_specs
    from phaselab.workload.arrivals import arrival_offsets, workload_seeds
    from phaselab.workload.prompts import PromptBuilder, build_specs, load_bench_tokenizer

    builder = PromptBuilder(load_bench_tokenizer(None if ns.tokenizer == "bundled" else ns.tokenizer), ns.endpoint)
    rng_workload, rng_arrivals = workload_seeds(ns.seed)  # as the bench splits them
    bench_ns = argparse.Namespace(**{**vars(ns), "num_warmups": 0})
    specs, _ = build_specs(bench_ns, builder, rng_workload)
    ids = [builder.ids(spec.prompt) for spec in specs]
    if arrivals.self_timed:
        offsets = [(spec.arrival_s or 0.0) * ns.time_scale for spec in specs]
    elif arrivals.concurrency is None:
        offsets = arrival_offsets(len(specs), arrivals.request_rate, arrivals.burstiness, rng_arrivals)
    else:
        offsets = None
    return from_bench_specs(specs, ids, offsets)


# -- commands -------------------------------------------------------------------------------------------
def run_simulate(ns: argparse.Namespace) -> int:
    try:
        return {"run": _cmd_run, "replay": _cmd_replay, "calibrate": _cmd_calibrate, "search": _cmd_search,
                "catalog": _cmd_catalog, "fit": _cmd_fit}[ns.sim_command](ns)
    except (ConfigError, ValueError, OSError) as e:
        print(f"phaselab simulate: error: {e}", file=sys.stderr)
        return 2


def _cmd_run(ns: argparse.Namespace) -> int:
    from phaselab.sim.loop import simulate
    from phaselab.sim.summary import format_summary, summarize

    d = build_deployment(ns)
    reqs, arrivals, info = build_workload(ns)
    print(f"simulating {len(reqs)} requests ({arrivals.describe()}) on {d.describe()}", file=sys.stderr)
    kib = d.model.kv_bytes_per_token(d.dtype_bytes) / 2**10
    print(f"  {d.model.describe()}; KV {kib:.0f} KiB/token", file=sys.stderr)
    result = simulate(d, reqs, arrivals, record_iterations=not ns.no_iterations, workload_info=info)
    summary = summarize(result.requests)
    print(f"simulated {result.sim_duration_s:.2f} s in {result.wall_s:.2f} s ({result.num_events} events, "
          f"{sum(w['num_iterations'] for w in result.worker_stats)} iterations)")
    print(format_summary(summary), end="")
    for w in result.worker_stats:
        print(f"  {w['worker']:<12} {w['role']:<9} TP{w['tp']}  busy {w['busy_fraction']:.0%}  "
              f"{w['num_iterations']} iterations, {w['num_preemptions']} preemptions")
    if ns.out:
        result.write(ns.out)
        print(f"run directory written to {ns.out} (config.json marked simulated)", file=sys.stderr)
    if ns.result_json:
        _write_json(ns.result_json, {"deployment": d.to_json(), "summary": summary, "workers": result.worker_stats,
                                     "wall_s": result.wall_s})
    return 0


def _cmd_replay(ns: argparse.Namespace) -> int:
    from phaselab.sim.replay import replay

    r = replay(ns.run_dir)
    print(r.describe())
    for note in r.notes:
        print(f"  note: {note}")
    if ns.out:
        r.result.write(ns.out)
    return 0 if r.identical else 1


def _cmd_calibrate(ns: argparse.Namespace) -> int:
    import warnings

    from phaselab.cost.record_fit import write_params
    from phaselab.sim.calibrate import calibrate
    from phaselab.cost.host import write_hardware
    from phaselab.sim.measure_host import measure_host

    if ns.measure_host and ns.hardware:
        raise ConfigError("pass either --hardware or --measure-host, not both")
    hardware = measure_host(ns.run_dir, ns.measure_host) if ns.measure_host else ns.hardware
    if hardware is None:  # a run of this CPU is priced against this host's ceilings: measured once, cached
        from phaselab.sim.measure_host import cache_run_host, read_config

        cache_run_host(ns.run_dir, read_config(ns.run_dir),
                       log=lambda m: print(f"phaselab simulate calibrate: {m}", file=sys.stderr))
    with warnings.catch_warnings():  # printed below, once
        warnings.simplefilter("ignore")
        fit, hw = calibrate(ns.run_dir, hardware, ns.weighting)
    for note in fit.notes:
        print(f"warning: {note}", file=sys.stderr)
    s = fit.summary()
    print(f"fitted on {s['num_iterations']} iterations of {ns.run_dir} against {hw.name} "
          f"(peak {hw.peak_flops / 1e9:.0f} GFLOP/s, {hw.mem_bandwidth / 1e9:.1f} GB/s"
          + (f", measured on {hw.host.get('cpu_model')} {hw.host.get('measured_at', '')}" if hw.host else "") + ")")
    print(f"  fit error per iteration: |rel| mean {s['relative_error_abs_mean']:.1%}, p50 "
          f"{s['relative_error_abs_p50']:.1%}, p90 {s['relative_error_abs_p90']:.1%}, p99 "
          f"{s['relative_error_abs_p99']:.1%}; RMS {s['relative_error_rms']:.1%}; total time "
          f"{s['total_time_error']:+.1%}")
    for k, v in fit.params.to_json().items():
        if k != "sources":
            print(f"  {k:<22} {'-' if v is None else format(v, '.6g')}   ({fit.params.source(k)})")
    if ns.out:
        write_params(fit, hw, ns.out)
        hw_ref = ns.measure_host or ns.hardware or hw.name
        if hw_ref == hw.name and hw.host is not None and hw.name != "cpu":  # the run's recorded ceilings
            hw_ref = os.path.splitext(ns.out)[0] + ".hardware.json"  # as a file the simulator can take
            write_hardware(hw, hw_ref)
        print(f"parameters written to {ns.out}; use them with --hardware {hw_ref} --params {ns.out}")
    return 0


def _cmd_fit(ns: argparse.Namespace) -> int:
    from phaselab.cost.profile_fit import run_fit

    return run_fit(ns)


def _cmd_search(ns: argparse.Namespace) -> int:
    from phaselab.cost.pricing import CostParams
    from phaselab.sim.search import SLO, candidates, random_workload_at, search

    slo = SLO(ns.objective, ns.ttft_slo, ns.tpot_slo, ns.attainment, ns.tbt_slo, ns.max_queue)
    model, hw = resolve_model(ns.model), get_hardware(ns.hardware)
    params = CostParams.load(ns.params) if ns.params else None
    base = dict(dtype_bytes=DTYPE_BYTES[ns.dtype], gpu_memory_utilization=ns.gpu_memory_utilization,
                max_model_len=ns.max_model_len, transfer_link=ns.transfer_link, transfer_mode=ns.transfer_mode,
                first_token_from=ns.first_token_from)
    ratios = [tuple(int(v) for v in r.split(":")) for r in _csv(ns.prefill_decode, str)] if ns.prefill_decode \
        else None
    role = dict(max_num_seqs=ns.max_num_seqs, long_prefill_token_threshold=ns.long_prefill_token_threshold)
    deps = candidates(model, hw, ns.max_gpus, _csv(ns.modes, str), _csv(ns.tps, int), _csv(ns.budgets, int),
                      _csv(ns.policies, str), ns.max_pool, params, base, role=role, ratios=ratios,
                      prefill_policies=_csv(ns.prefill_policies, str))
    print(f"objective: {slo.definition()}")
    print(f"searching {len(deps)} deployments of {model.name} on {hw.name} (<= {ns.max_gpus} GPUs), "
          f"{ns.num_prompts} requests per simulation", file=sys.stderr)
    workload = random_workload_at(ns.num_prompts, ns.input_len, ns.output_len, ns.seed, ns.burstiness)

    def progress(i: int, n: int, c: Any) -> None:
        print(f"  [{i}/{n}] {c.deployment.describe()}: {c.rate:.3g} req/s = {c.per_gpu:.3g} req/s/GPU",
              file=sys.stderr)

    result = search(deps, workload, slo, num_bisections=ns.bisections, progress=progress)
    print(f"{'rank':>4}  {'req/s/GPU':>10}  {'req/s':>8}  deployment")
    for i, c in enumerate(result.ranked()[:15], start=1):
        print(f"{i:>4}  {c.per_gpu:>10.3g}  {c.rate:>8.3g}  {c.deployment.describe()}"
              + (f"  ({c.error})" if c.error else ""))
    best = result.best
    print(f"best: {best.deployment.describe()}, {best.per_gpu:.3g} req/s per GPU" if best
          else "no deployment met the SLO")
    if ns.result_json:
        _write_json(ns.result_json, result.to_json())
    return 0 if best else 1


def _cmd_catalog(ns: argparse.Namespace) -> int:
    from phaselab.cost.catalog import source_of
    from phaselab.cost.pricing import default_params

    print("hardware:")
    for h in HARDWARE.values():
        print(f"  {h.name:<6} {h.description}: {h.peak_flops / 1e12:g} TFLOP/s, {h.mem_bandwidth / 1e12:g} TB/s, "
              f"{h.memory_bytes / GiB:.0f} GiB, TP over {h.tp_link}")
        for f in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            print(f"           {f}: {source_of(h, f)}")
        p = default_params(h)
        print(f"           cost: e_max {p.compute_efficiency:.3g} (T_half {p.rows_half:.3g}), e_mem "
              f"{p.memory_efficiency:.3g}, e_att {p.attention_efficiency:.3g}, e_ar {p.allreduce_efficiency:.3g}: "
              f"{p.source('compute_efficiency')}")
    print("links:")
    for link in LINKS.values():
        print(f"  {link.name:<8} {link.bandwidth / 1e9:g} GB/s per direction{' per GPU' if link.per_gpu else ''}, "
              f"{link.latency_s * 1e6:g} us: {link.description}")
    print("models (KV per token at 2 bytes):")
    for m in MODELS.values():
        print(f"  {m.describe()}; KV {m.kv_bytes_per_token(2) / 2**10:g} KiB/token  [{m.sources.get('*', '')}]")
    return 0


def _csv(text: str, kind: type) -> list[Any]:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    """`python -m phaselab.sim.simulate_cli ...` until cli.py wires `phaselab simulate`."""
    parser = argparse.ArgumentParser(prog="phaselab")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return run_simulate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
