"""`phaselab compare`: the same workloads under prefill-first, chunked prefill (two budgets) and
disaggregated 1P1D serving, on the bundled model, with every phase accounted for.

    load the checkpoint once (the dtype and weight path `phaselab serve` picks with its defaults: on
    the bundled model, its Q4_1 blocks for the native kernels) ─▶ this host's ceilings (measured once
    per machine, cached: engine/ceilings.py host_ceilings) ─▶ for each configuration: an engine
    (colocated: built from the loaded checkpoint; disagg: a router + 1 prefill + 1 decode worker on
    Ray, each loading the model itself), recording the ceilings in its run directories
        ─▶ interference workload ─▶ run directory ─▶ diagnosis (.md/.html/.json)
        ─▶ input-length sweep    ─▶ run directory ─▶ diagnosis
    ─▶ side-by-side tables on the terminal, summary.md/.json, timeline.png/.html, report.html

The runs are offline engine runs driven with arrival timing (phaselab.workload.driver's
`run_arrivals`): prompts are token ids of exact lengths built before the run; each arrival fires at
a time offset, when every stream has received some number of tokens (token time: every
configuration sees a long prompt at the same point of the streams' progress, whatever the
machine's speed), or when an earlier request finished (the sweep sends one request at a time).

An experiment orchestrator, not an analysis: it builds engines (importing torch lazily, inside
functions) or simulations (compare_sim.py), then hands the run directories to phaselab.analysis
(diagnose, report), which only reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from phaselab.analysis.diagnose import Diagnosis, diagnose, write_diagnosis
from phaselab.engine_args import SPIN_COUNT
from phaselab.core.config import knob
from phaselab.workload.driver import interference_arrivals, run_arrivals, sweep_arrivals
from phaselab.workload.interference import InterferenceParams

# -- the runs -----------------------------------------------------------------------------------------------------
def write_slice(engine: Any, path: str | Path, since_requests: int, since_iterations: int) -> None:
    """The requests and iterations an engine recorded since the given counts, as one run directory
    (several workloads run on one engine; metrics.prom is left out: it would be cumulative)."""
    from phaselab.obs.rundir import write_run_dir

    if hasattr(engine, "worker_stats"):
        engine.worker_stats()  # disaggregated: collect the last iteration reports
    reqs = list(engine.finished_requests[since_requests:])
    iters = sorted(engine.iterations[since_iterations:], key=lambda r: (r.worker, r.start_ns))
    write_run_dir(path, reqs, iters, engine.run_config())


# -- configurations -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    name: str
    label: str
    mode: str = "colocated"  # | "disagg"
    policy: str = knob("policy")
    budget: int | None = None  # max_num_batched_tokens (None: the policy's default)
    slo_tbt_ms: float | None = None  # set: the adaptive budget holding this TBT target (chunked, docs/slo.md)


@dataclass(frozen=True)
class SimSpec:
    """`compare --simulate`: what is simulated (phaselab/sim) instead of run on the bundled model.

    Every configuration is a deployment of `num_gpus` devices: colocated, num_gpus / tp engines of
    TP `tp`; disaggregated, `num_prefill` + `num_decode` engines of TP `tp`, KV over `link`."""

    model: str
    hardware: str
    num_gpus: int
    tp: int
    num_prefill: int
    num_decode: int
    link: str  # the disaggregated deployment's KV transfer link
    request_rate: float
    num_prompts: int
    input_len: str
    output_len: str
    burstiness: float = 1.0
    seed: int = 0
    dtype: str = "bfloat16"
    params: str | None = None  # cost parameters JSON (simulate calibrate); None: the hardware's defaults
    first_token_from: str = "prefill"
    transfer_mode: str = "after-prefill"
    long_start_s: float = 1.0  # interference: first long prompt (seconds: arrivals are timed in the simulator)
    long_interval_s: float = 1.0

    @property
    def num_engines(self) -> int:
        return self.num_gpus // self.tp


@dataclass(frozen=True)
class Plan:
    interference: InterferenceParams
    sweep_lens: tuple[int, ...]
    sweep_output_len: int
    configs: tuple[RunConfig, ...]
    kv_cache_memory: str = "256MiB"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    simulation: SimSpec | None = None  # set: every run is simulated (compare_sim.run_sim_compare)

    def to_json(self) -> dict[str, Any]:
        """summary.json's "plan" (load_compare reads it back)."""
        d = dataclasses.asdict(self)
        d["interference"] = self.interference.to_json()
        return dict(json.loads(json.dumps(d)))


# the adaptive column's default TBT target: on this machine's bundled model (a CPU decode step of a
# few streams takes tens of ms, a 1024-token prefill about a second), and on a simulated GPU cluster
DEFAULT_SLO_TBT_MS = 200.0
DEFAULT_SIM_SLO_TBT_MS = 50.0


def adaptive_configs(targets_ms: Sequence[float], budget: int | None, where: str = "") -> list[RunConfig]:
    return [RunConfig(f"adaptive-{t:g}ms", f"chunked, adaptive budget, TBT target {t:g} ms{where}", budget=budget,
                      slo_tbt_ms=t) for t in targets_ms]


def make_plan(quick: bool = False, disagg: bool = True, slo_tbt_ms: Sequence[float] = (DEFAULT_SLO_TBT_MS,)) -> Plan:
    if quick:
        # long prompts long enough that, unchunked, their prefill clearly dominates the streams'
        # time (with 512 the stall and decode-step shares came within a few points of each other), and
        # streams short enough that their decoding does not (with 32 tokens each, prefill-first's stall
        # and decode shares were 0.40-0.44 vs 0.36-0.42 on quiet reruns: the top cause flipped)
        inter = InterferenceParams.in_tokens(4, 12, num_streams=3, stream_input_len=48, stream_output_len=24,
                                             num_long_prompts=2, long_input_len=768, long_output_len=4)
        lens: tuple[int, ...] = (64, 256, 512)
        out_len = 2
    else:
        inter = InterferenceParams.in_tokens(8, 24, stream_output_len=96)
        lens = (64, 256, 512, 768, 1024, 1536)
        out_len = 4
    big, small = inter.long_input_len // 2, max(32, inter.long_input_len // 8)
    configs = [RunConfig("prefill-first", "prefill-first (unchunked)", policy="prefill-first"),
               RunConfig(f"chunked-{big}", f"chunked, budget {big}", budget=big),
               RunConfig(f"chunked-{small}", f"chunked, budget {small}", budget=small)]
    configs += adaptive_configs(slo_tbt_ms, None)
    if disagg:
        configs.append(RunConfig("disagg-1p1d", "disaggregated 1P1D", mode="disagg", budget=big))
    return Plan(inter, lens, out_len, tuple(configs))


def disagg_available() -> tuple[bool, str]:
    try:
        import phaselab.disagg  # noqa: F401
        from phaselab.disagg.router import DisaggEngine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: leave it out, and say why
        return False, f"phaselab.disagg is not usable here ({type(e).__name__}: {e})"
    return True, ""


# -- progress -------------------------------------------------------------------------------------------------------
class Progress:
    """One status line on stderr (rewritten in place on a terminal, one line per stage otherwise)."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._last = ""

    def stage(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.monotonic() - self.t0:6.1f}s] {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line + "\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last = text

    def update(self, text: str) -> None:
        if self.enabled and self.tty:
            self.stream.write(f"\r\033[K[{time.monotonic() - self.t0:6.1f}s] {self._last}: {text}")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


# -- running -------------------------------------------------------------------------------------------------------
@dataclass
class ConfigResult:
    config: RunConfig
    runs: dict[str, Path] = field(default_factory=dict)  # workload -> run directory
    diagnoses: dict[str, Diagnosis] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None


@dataclass
class CompareResult:
    out_dir: Path
    plan: Plan
    results: list[ConfigResult]
    notes: list[str]
    files: dict[str, Path] = field(default_factory=dict)
    wall_s: float = 0.0
    predictions: Any = None  # analysis.compare_predict's (rows, notes), computed once by the report


def _engine_args(plan: Plan, cfg: RunConfig) -> Any:
    from phaselab.engine_args import EngineArgs

    # dtype and weights "auto", as `phaselab serve` runs them (the packed blocks through the native
    # kernels where they measure fastest; plan.dtype is what auto chose in run_compare);
    # measure_ceilings: this host's ceilings (cached) recorded in every run, so that diagnose and the
    # predictions price the runs against this machine's own
    kw: dict[str, Any] = dict(dtype="auto", weights="auto", kv_cache_memory=plan.kv_cache_memory,
                              max_model_len=plan.max_model_len, policy=cfg.policy, measure_ceilings=True)
    if cfg.policy == "chunked" and cfg.budget:
        kw["max_num_batched_tokens"] = cfg.budget
    if cfg.slo_tbt_ms:
        kw["slo_tbt_ms"] = cfg.slo_tbt_ms
    if cfg.mode == "disagg":
        kw.update(mode="disagg", prefill_workers=1, decode_workers=1)
    return EngineArgs(**kw)


def _build_engine(plan: Plan, cfg: RunConfig, checkpoint: Any) -> Any:
    from phaselab.serving_engine import make_engine

    # the disaggregated workers load the model themselves, as `phaselab serve --mode disagg` does (the
    # packed blocks do not travel through Ray's object store)
    return make_engine(_engine_args(plan, cfg), checkpoint=None if cfg.mode == "disagg" else checkpoint)


def disagg_threads() -> int:
    """Torch threads of each disaggregated worker here (1 prefill + 1 decode: the cores split, as
    disagg/pool.py's start_workers splits them)."""
    return max(1, (os.cpu_count() or 1) // 2)


def measure_host(model_config: Any, dtype: Any, threads: Sequence[int], progress: Progress) -> list[dict[str, Any]]:
    """This host's ceilings at each torch thread count, cached (engine/ceilings.py host_ceilings):
    measured here, once per machine (again while the cached ones were measured under load, keeping the
    best of each rate), before any engine runs, so that no measurement shares the cores with an engine
    (the engines and workers then find them in the cache)."""
    import torch

    from phaselab.engine.ceilings import host_ceilings

    saved, out = torch.get_num_threads(), []
    try:
        for n in dict.fromkeys(threads):
            torch.set_num_threads(n)
            out.append(host_ceilings(model_config, dtype, log=progress.stage, improve=True))
    finally:
        torch.set_num_threads(saved)
    return out


def run_configuration(plan: Plan, cfg: RunConfig, checkpoint: Any, out_dir: Path,
                      progress: Progress) -> ConfigResult:
    res = ConfigResult(cfg)
    t0 = time.monotonic()
    progress.stage(f"{cfg.label}: starting the engine" + (" (Ray, 1 prefill + 1 decode worker)"
                                                         if cfg.mode == "disagg" else ""))
    engine = _build_engine(plan, cfg, checkpoint)
    try:
        workloads = [("interference", interference_arrivals(plan.interference)),
                     ("sweep", sweep_arrivals(plan.sweep_lens, plan.sweep_output_len))]
        for name, arrivals in workloads:
            progress.stage(f"{cfg.label}: {name} ({len(arrivals)} requests)")
            n_req, n_it = len(engine.finished_requests), len(engine.iterations)
            run_arrivals(engine, arrivals, lambda done, total: progress.update(f"{done}/{total} requests finished"))
            path = out_dir / f"{name}-{cfg.name}"
            write_slice(engine, path, n_req, n_it)
            diag = diagnose(path)
            write_diagnosis(diag, path)
            res.runs[name], res.diagnoses[name] = path, diag
    finally:
        engine.shutdown()
        del engine
    res.wall_s = time.monotonic() - t0
    progress.done()
    return res


def write_result(out: Path, plan: Plan, results: list[Any], notes: list[str], progress: Progress,
                  t_start: float) -> CompareResult:
    """The report, diagnosis and index of a finished compare run (real or simulated alike)."""
    from phaselab.experiments.compare_report import write_compare_outputs

    progress.stage("writing the report")
    result = CompareResult(out, plan, results, notes)
    result.wall_s = time.monotonic() - t_start
    result.files = write_compare_outputs(result)
    result.wall_s = time.monotonic() - t_start  # including the report
    progress.stage(f"done in {result.wall_s:.0f} s: {result.files['report']}")
    return result


@contextlib.contextmanager
def warnings_once() -> Iterator[None]:
    """Show each warning (category and text) once within the block, wherever it is raised from. (The
    "once" filter is not enough: every warnings.catch_warnings() inside, as the predictions' own,
    clears the registry it keeps.)"""
    with warnings.catch_warnings():
        show, seen = warnings.showwarning, set()

        def once(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            key = (category, str(message))
            if key not in seen:
                seen.add(key)
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = once
        yield


def run_compare(out_dir: str | Path, quick: bool = False, disagg: bool = True, show_progress: bool = True,
                stream: Any = None, slo_tbt_ms: Sequence[float] = (DEFAULT_SLO_TBT_MS,)) -> CompareResult:
    """Run every configuration and write the report. Returns what was written."""
    t_start = time.monotonic()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (docs: threads on a small machine)
    # the colocated engines run here one at a time, alone on the cores: a bounded spin between
    # kernel calls (cli.py); the disaggregated workers get none (disagg/process.py's worker_env)
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(show_progress)
    notes: list[str] = []
    use_disagg = disagg
    if disagg:
        ok, why = disagg_available()
        if not ok:
            use_disagg = False
            notes.append(f"disaggregated 1P1D left out: {why}")
            print(f"phaselab compare: note: disaggregated 1P1D left out: {why}", file=stream or sys.stderr)
    else:
        notes.append("disaggregated 1P1D left out (--no-disagg)")
    import torch

    from phaselab.engine.engine import resolve_dtype
    from phaselab.model.kernels import linear_probe
    from phaselab.model.loader import load_checkpoint

    # the dtype and weight path `phaselab serve` picks with its defaults (--dtype auto --weights auto)
    dtype, _ = resolve_dtype("auto", True, "auto")
    decision = linear_probe.decide("auto", dtype, True)
    plan = dataclasses.replace(make_plan(quick, use_disagg, slo_tbt_ms), dtype=str(dtype).removeprefix("torch."))
    progress.stage(f"loading the bundled model (once, {plan.dtype}, "
                   f"{'packed blocks' if decision.keep_packed else 'dense'} for the {decision.path} path)")
    checkpoint = load_checkpoint(None, dtype, None, decision.keep_packed)
    measure_host(checkpoint.config, dtype, [torch.get_num_threads()] + ([disagg_threads()] if use_disagg else []),
                 progress)
    results = []
    # the runs are priced against this host's ceilings (recorded in each run): a warning that a
    # calibration disagrees with them would repeat once per run and per prediction; show it once
    with warnings_once():
        for i, cfg in enumerate(plan.configs):
            progress.stage(f"[{i + 1}/{len(plan.configs)}] {cfg.label}")
            try:
                results.append(run_configuration(plan, cfg, checkpoint, out, progress))
            except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others
                if cfg.mode != "disagg":
                    raise
                msg = f"disaggregated 1P1D failed and is left out: {type(e).__name__}: {e}"
                notes.append(msg)
                print(f"phaselab compare: note: {msg}", file=stream or sys.stderr)
        return write_result(out, plan, results, notes, progress, t_start)


def load_compare(out_dir: str | Path) -> CompareResult:
    """Rebuild a finished compare from its directory (summary.json + run directories), re-diagnosing
    every run: `phaselab compare --from DIR` re-renders a report without running anything."""
    out = Path(out_dir)
    data = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    p = data["plan"]
    sim = SimSpec(**p["simulation"]) if p.get("simulation") else None
    plan = Plan(InterferenceParams.from_json(p["interference"]), tuple(p["sweep_lens"]), p["sweep_output_len"],
                tuple(RunConfig(**c) for c in p["configs"]), p["kv_cache_memory"], p["dtype"], p["max_model_len"],
                sim)
    results = []
    for c in data["configs"]:
        res = ConfigResult(RunConfig(**c["config"]), wall_s=c.get("wall_s", 0.0))
        for w, entry in c["workloads"].items():
            path = out / Path(entry["run_dir"]).name
            res.runs[w], res.diagnoses[w] = path, diagnose(path)
        results.append(res)
    return CompareResult(out, plan, results, list(data.get("notes", [])), wall_s=data.get("wall_s", 0.0))


