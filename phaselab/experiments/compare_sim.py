"""`phaselab compare --simulate`: the same comparison at cluster scale (phaselab/sim), the same report.

Every configuration is a deployment of `--gpus` devices simulated on the core Scheduler with the
roofline cost model: prefill-first and chunked colocated engines on all the GPUs, and disaggregated
prefill:decode pools on the same GPUs, under a `load` workload (the bench's random workload, open
loop) plus the interference workload and a length sweep.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phaselab.experiments.compare_cli import COMPARE_BUDGETS

from phaselab.analysis.diagnose import diagnose, write_diagnosis
from phaselab.experiments.compare import (
    DEFAULT_SIM_SLO_TBT_MS,
    adaptive_configs,
    CompareResult, ConfigResult, Plan, Progress, RunConfig, SimSpec, write_result,
)
from phaselab.workload.interference import InterferenceParams

SIM_SWEEP_LENS = (256, 1024, 2048, 4096, 8192)
SIM_SWEEP_OUTPUT_LEN = 4
# timed in seconds of simulated time: make_sim_plan sets SimSpec.long_start_s, long_interval_s
SIM_INTERFERENCE = InterferenceParams(num_streams=4, stream_input_len=512, stream_output_len=256, num_long_prompts=3,
                                      long_input_len=4096, long_output_len=8)


def auto_tp(model: Any, hardware: Any, num_gpus: int, dtype_bytes: int, utilization: float = 0.9) -> int:
    """The smallest tensor parallelism (a power of two dividing the attention heads, at most num_gpus)
    at which the weights take at most half of each GPU's usable memory, the rest being KV cache."""
    from phaselab.errors import ConfigError

    usable = hardware.memory_bytes * utilization
    weights = model.weight_bytes(dtype_bytes)
    tp = 1
    while tp <= num_gpus:
        if model.num_attention_heads % tp == 0 and weights / tp <= usable / 2:
            return tp
        tp *= 2
    raise ConfigError(f"{model.name} ({weights / 1e9:.0f} GB of weights) leaves less than half of each GPU for the KV "
                      f"cache on up to {num_gpus} x {hardware.name}: raise --gpus, or pass --tp explicitly")


def parse_split(text: str | None, num_engines: int) -> tuple[int, int]:
    """--prefill-decode P:D (engines; a ratio is scaled to num_engines) -> (prefill, decode);
    default: half the engines prefill (rounded down), the rest decode."""
    from phaselab.errors import ConfigError

    if text is None:
        return num_engines // 2, num_engines - num_engines // 2
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--prefill-decode {text!r}: write P:D, e.g. 1:1 or 3:1") from None
    if p < 1 or d < 1:
        raise ConfigError(f"--prefill-decode {text!r}: each pool needs at least one engine")
    if num_engines % (p + d):
        raise ConfigError(f"--prefill-decode {text}: {p + d} engines per unit do not divide the {num_engines} engines "
                          "(--gpus / --tp); change --gpus, --tp or the split")
    k = num_engines // (p + d)
    return p * k, d * k


def sim_spec(model: str, hardware: str, num_gpus: int = 8, tp: int | None = None, split: str | None = None,
             link: str | None = None, request_rate: float = 4.0, num_prompts: int = 500,
             input_len: str = "uniform:256:2048", output_len: str = "uniform:64:512", burstiness: float = 1.0,
             seed: int = 0, dtype: str = "bfloat16", params: str | None = None, first_token_from: str = "prefill",
             transfer_mode: str = "after-prefill") -> SimSpec:
    """Resolve `compare --simulate`'s options (catalog names checked, TP and the split chosen) into a SimSpec."""
    from phaselab.errors import ConfigError
    from phaselab.cost.catalog import get_hardware, get_link
    from phaselab.cost.catalog_files import is_file_ref
    from phaselab.sim.simulate_cli import DTYPE_BYTES, resolve_model

    m, hw = resolve_model(model), get_hardware(hardware)
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    if num_gpus < 1:
        raise ConfigError(f"--gpus {num_gpus}: give at least one GPU")
    tp = tp or auto_tp(m, hw, num_gpus, DTYPE_BYTES[dtype])
    if num_gpus % tp:
        raise ConfigError(f"--gpus {num_gpus} is not a multiple of --tp {tp}: each engine takes tp GPUs")
    if not request_rate > 0:
        raise ConfigError(f"--request-rate {request_rate}: give a positive rate (req/s; inf sends all at once)")
    from phaselab.workload.lengths import LengthDist, WorkloadError

    for flag, lengths in (("--input-len", input_len), ("--output-len", output_len)):
        try:
            LengthDist.parse(lengths)
        except WorkloadError as e:
            raise ConfigError(f"{flag}: {e}") from None
    num_engines = num_gpus // tp
    p, d = parse_split(split, num_engines) if num_engines >= 2 else (0, 0)
    link_name = get_link(link or hw.tp_link).name  # checked here; a device or link file is kept as its path
    return SimSpec(model if os.path.exists(model) else m.name, hardware if is_file_ref(hardware) else hw.name,
                   num_gpus, tp, p, d, link if link and is_file_ref(link) else link_name, request_rate, num_prompts,
                   input_len, output_len, burstiness, seed, dtype, params, first_token_from, transfer_mode)


def make_sim_plan(spec: SimSpec, budgets: Sequence[int] = COMPARE_BUDGETS, disagg: bool = True,
                  slo_tbt_ms: Sequence[float] = (DEFAULT_SIM_SLO_TBT_MS,)) -> Plan:
    """prefill-first, chunked at each budget, and disaggregated P:D, all on spec.num_gpus devices."""
    e, tp = spec.num_engines, spec.tp
    where = f"{e} x TP{tp}"
    configs = [RunConfig("prefill-first", f"prefill-first (unchunked), {where}", policy="prefill-first")]
    configs += [RunConfig(f"chunked-{b}", f"chunked, budget {b}, {where}", budget=b) for b in budgets]
    configs += adaptive_configs(slo_tbt_ms, max(budgets, default=None), f", {where}")
    if disagg and spec.num_prefill and spec.num_decode:
        configs.append(RunConfig(f"disagg-{spec.num_prefill}p{spec.num_decode}d",
                                 f"disaggregated {spec.num_prefill}P:{spec.num_decode}D (TP{tp}), KV over {spec.link}",
                                 mode="disagg", budget=budgets[0] if budgets else None))
    from phaselab.sim.simulate_cli import resolve_model

    context = resolve_model(spec.model).max_position_embeddings
    lens = tuple(n for n in SIM_SWEEP_LENS if n + SIM_SWEEP_OUTPUT_LEN < context)  # (and what the KV cache holds)
    inter = dataclasses.replace(SIM_INTERFERENCE, long_start_s=spec.long_start_s, long_interval_s=spec.long_interval_s)
    return Plan(inter, lens, SIM_SWEEP_OUTPUT_LEN, tuple(configs), "from device memory", spec.dtype, 0,
                spec)


def sim_deployment(spec: SimSpec, cfg: RunConfig) -> Any:
    from phaselab.cost.catalog import get_hardware
    from phaselab.sim.simulate_cli import DTYPE_BYTES, resolve_model
    from phaselab.cost.pricing import CostParams
    from phaselab.sim.deployment import Deployment, RoleConfig

    common: dict[str, Any] = dict(dtype_bytes=DTYPE_BYTES[spec.dtype], transfer_link=spec.link,
                                  transfer_mode=spec.transfer_mode, first_token_from=spec.first_token_from,
                                  params=CostParams.load(spec.params) if spec.params else None)
    model, hw = resolve_model(spec.model), get_hardware(spec.hardware)
    if cfg.mode == "disagg":
        return Deployment(model, hw, "disagg", num_prefill=spec.num_prefill, num_decode=spec.num_decode,
                          prefill=RoleConfig(tp=spec.tp, policy="chunked", max_num_batched_tokens=cfg.budget),
                          decode=RoleConfig(tp=spec.tp), **common)
    return Deployment(model, hw, "colocated", num_replicas=spec.num_engines,
                      colocated=RoleConfig(tp=spec.tp, policy=cfg.policy, max_num_batched_tokens=cfg.budget,
                                           slo_tbt_ms=cfg.slo_tbt_ms or 0.0), **common)


def sim_workloads(plan: Plan, max_model_len: int) -> list[tuple[str, list[Any], Any, dict[str, Any]]]:
    """(name, requests, arrivals, info) of the three workloads: `load` (the bench's random workload,
    open loop), `interference` (streams, then long prompts at timed arrivals) and `sweep` (one
    request at a time: a closed loop of one user)."""
    from phaselab.sim.workload import SimRequest, interference_requests, random_requests
    from phaselab.workload.arrivals import ArrivalPlan

    spec = plan.simulation
    assert spec is not None
    load_arrivals = ArrivalPlan(request_rate=spec.request_rate, burstiness=spec.burstiness)
    load = random_requests(spec.num_prompts, spec.input_len, spec.output_len, spec.seed, load_arrivals)
    i = plan.interference
    long_len = min(i.long_input_len, max_model_len - i.long_output_len - 1)
    ip = InterferenceParams(i.num_streams, i.stream_input_len, i.stream_output_len, i.num_long_prompts, long_len,
                            i.long_output_len, i.long_start_s, i.long_interval_s)
    inter = interference_requests(ip)
    for r in inter:  # the names the real compare gives them (the report picks streams and long prompts by name)
        r.request_id = r.request_id.removeprefix("req-")
    lens = [n for n in plan.sweep_lens if n + plan.sweep_output_len < max_model_len]
    sweep = [SimRequest(f"sweep-{n}", n, plan.sweep_output_len, index=k) for k, n in enumerate(lens)]
    return [("load", load, load_arrivals, {"kind": "random", "seed": spec.seed, "input_len": spec.input_len,
                                           "output_len": spec.output_len}),
            ("interference", inter, ArrivalPlan(self_timed=True), {"kind": "interference",
                                                                   "params": ip.to_json()}),
            ("sweep", sweep, ArrivalPlan(concurrency=1), {"kind": "sweep", "input_lens": lens})]


def run_sim_configuration(plan: Plan, cfg: RunConfig, out_dir: Path, progress: Progress) -> ConfigResult:
    from phaselab.sim.loop import simulate

    res = ConfigResult(cfg)
    t0 = time.monotonic()
    d = sim_deployment(plan.simulation, cfg)  # type: ignore[arg-type]
    progress.stage(f"{cfg.label}: {d.describe()}")
    for name, reqs, arrivals, info in sim_workloads(plan, d.resolved_max_model_len()):
        progress.stage(f"{cfg.label}: {name} ({len(reqs)} requests, {arrivals.describe()})")
        path = out_dir / f"{name}-{cfg.name}"
        simulate(d, reqs, arrivals, workload_info=info).write(str(path))
        diag = diagnose(path)
        write_diagnosis(diag, path)
        res.runs[name], res.diagnoses[name] = path, diag
    res.wall_s = time.monotonic() - t0
    progress.done()
    return res


def run_sim_compare(out_dir: str | Path, spec: SimSpec, budgets: Sequence[int] = COMPARE_BUDGETS, disagg: bool = True,
                    show_progress: bool = True, stream: Any = None,
                    slo_tbt_ms: Sequence[float] = (DEFAULT_SIM_SLO_TBT_MS,)) -> CompareResult:
    """`compare --simulate`: every configuration simulated on `spec`'s cluster, the same report."""
    t_start = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(show_progress)
    plan = make_sim_plan(spec, budgets, disagg, slo_tbt_ms)
    notes = [f"simulated (phaselab simulate): {spec.model} on {spec.num_gpus} x {spec.hardware}; every time is the "
             "cost model's prediction (its parameters and their sources are in each run's config.json)"]
    if disagg and not spec.num_prefill:
        why = (f"one engine of TP{spec.tp} on {spec.num_gpus} GPUs cannot be split into pools; "
               "raise --gpus or lower --tp")
        notes.append(f"disaggregated left out: {why}")
        print(f"phaselab compare: note: disaggregated left out: {why}", file=stream or sys.stderr)
    elif not disagg:
        notes.append("disaggregated left out (--no-disagg)")
    results = []
    for i, cfg in enumerate(plan.configs):
        progress.stage(f"[{i + 1}/{len(plan.configs)}] {cfg.label}")
        results.append(run_sim_configuration(plan, cfg, out, progress))
    return write_result(out, plan, results, notes, progress, t_start)
