"""`phaselab compare`: the same workloads under prefill-first, chunked prefill (two budgets) and
disaggregated 1P1D serving, on the bundled model, with every phase accounted for.

    load the checkpoint once ─▶ for each configuration: an engine (colocated: built from the loaded
    checkpoint; disagg: a router + 1 prefill + 1 decode worker on Ray)
        ─▶ interference workload ─▶ run directory ─▶ diagnosis (.md/.html/.json)
        ─▶ input-length sweep    ─▶ run directory ─▶ diagnosis
    ─▶ side-by-side tables on the terminal, summary.md/.json, timeline.png/.html, report.html

The runs are offline engine runs driven with arrival timing (`drive`): prompts are token ids of
exact lengths built before the run; each arrival fires at a time offset, when every stream has
received some number of tokens (token time: every configuration sees a long prompt at the same
point of the streams' progress, whatever the machine's speed), or when an earlier request
finished (the sweep sends one request at a time). A request is stamped arrived (and, its prompt
being token ids already, tokenized and queued) at the moment its trigger fired; the loop adds it
at the next step boundary, as a server's engine thread would, so a step in progress counts as
queue time.

This module imports the engine (torch) lazily inside functions: the rest of `analysis/` reads
run directories only.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phaselab.analysis import fmt
from phaselab.analysis.diagnose import Diagnosis, diagnose, write_diagnosis

PROMPT_TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary entries of the bundled model


# -- workloads ----------------------------------------------------------------------------------------------------
@dataclass
class Arrival:
    """One request of a driven workload and the trigger that releases it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    group: str = "default"
    at_s: float | None = None  # seconds after the run's start
    after_group_tokens: tuple[str, int] | None = None  # every request of the group has >= n tokens (or finished)
    after_finished: str | None = None  # that request finished


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*PROMPT_TOKEN_RANGE, size=n).tolist()


@dataclass(frozen=True)
class InterferenceSpec:
    """`phaselab bench`'s interference workload (docs/bench.md) in token time: streams start at once,
    long prompt k arrives when every stream has received `first_at + k * every` tokens."""

    num_streams: int = 4
    stream_input_len: int = 64
    stream_output_len: int = 96
    num_long_prompts: int = 3
    long_input_len: int = 1024
    long_output_len: int = 8
    first_at: int = 8
    every: int = 24


def interference_arrivals(spec: InterferenceSpec, seed: int = 0) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    out = [Arrival(f"stream-{i}", random_prompt(rng, spec.stream_input_len), spec.stream_output_len, "stream", at_s=0.0)
           for i in range(spec.num_streams)]
    out += [Arrival(f"long-{k}", random_prompt(rng, spec.long_input_len), spec.long_output_len, "long",
                    after_group_tokens=("stream", spec.first_at + k * spec.every))
            for k in range(spec.num_long_prompts)]
    return out


def sweep_arrivals(input_lens: Sequence[int], output_len: int = 4, seed: int = 1) -> list[Arrival]:
    """One request at a time (each after the previous finished): prefill alone at each length."""
    rng = np.random.default_rng(seed)
    out: list[Arrival] = []
    for n in input_lens:
        prev = out[-1].request_id if out else None
        out.append(Arrival(f"sweep-{n}", random_prompt(rng, n), output_len, "sweep",
                           at_s=0.0 if prev is None else None, after_finished=prev))
    return out


# -- the driver ---------------------------------------------------------------------------------------------------
def drive(engine: Any, arrivals: Sequence[Arrival], on_progress: Callable[[int, int], None] | None = None,
          poll_s: float = 0.01) -> None:
    """Run `arrivals` on an engine (LLMEngine or DisaggEngine: add_request / step /
    has_unfinished_requests / tracked) to completion, greedy, ignoring EOS."""
    from phaselab.core.sampling_params import SamplingParams

    t0 = time.monotonic_ns()
    pending = list(arrivals)
    groups: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    finished: set[str] = set()

    def due(a: Arrival, now: int) -> bool:
        if a.at_s is not None:
            return now >= t0 + int(a.at_s * 1e9)
        if a.after_finished is not None:
            return a.after_finished in finished
        if a.after_group_tokens is not None:
            g, n = a.after_group_tokens
            members = groups.get(g, [])
            return bool(members) and all(tokens.get(r, 0) >= n or r in finished for r in members)
        return True

    while pending or engine.has_unfinished_requests():
        now = time.monotonic_ns()
        for a in [a for a in pending if due(a, now)]:
            pending.remove(a)
            arrived = t0 + int(a.at_s * 1e9) if a.at_s is not None else now
            params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
            rid = engine.add_request(list(a.prompt), params, request_id=a.request_id, arrived_ns=arrived)
            tracked = engine.tracked(rid)
            m = getattr(tracked, "metrics", None)
            if m is not None:  # token-id prompts: tokenized before arrival; queued from the moment it arrived
                m.tokenized_ns = arrived
                if getattr(engine, "role", None) != "router":
                    m.queued_ns = arrived
            groups.setdefault(a.group, []).append(rid)
        if engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    finished.add(out.request_id)
                    if on_progress:
                        on_progress(len(finished), len(arrivals))
        elif pending:
            timed = [t0 + int(a.at_s * 1e9) for a in pending if a.at_s is not None]
            if not timed and not any(due(a, time.monotonic_ns()) for a in pending):
                # nothing runs and no trigger can fire any more: release the rest now
                for a in pending:
                    a.at_s, a.after_finished, a.after_group_tokens = (time.monotonic_ns() - t0) / 1e9, None, None
                continue
            wait = poll_s if not timed else min(poll_s, max(0.0, (min(timed) - time.monotonic_ns()) / 1e9))
            time.sleep(wait)


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
    policy: str = "chunked"
    budget: int | None = None  # max_num_batched_tokens (None: the policy's default)


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
    interference: InterferenceSpec
    sweep_lens: tuple[int, ...]
    sweep_output_len: int
    configs: tuple[RunConfig, ...]
    kv_cache_memory: str = "256MiB"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    simulation: SimSpec | None = None  # set: every run is simulated (run_sim_compare)


def make_plan(quick: bool = False, disagg: bool = True) -> Plan:
    if quick:
        # long prompts long enough that, unchunked, their prefill clearly dominates the streams'
        # time (with 512 the stall and decode-step shares came within a few points of each other)
        inter = InterferenceSpec(num_streams=3, stream_input_len=48, stream_output_len=32, num_long_prompts=2,
                                 long_input_len=768, long_output_len=4, first_at=4, every=12)
        lens: tuple[int, ...] = (64, 256, 512)
        out_len = 2
    else:
        inter = InterferenceSpec()
        lens = (64, 256, 512, 768, 1024, 1536)
        out_len = 4
    big, small = inter.long_input_len // 2, max(32, inter.long_input_len // 8)
    configs = [RunConfig("prefill-first", "prefill-first (unchunked)", policy="prefill-first"),
               RunConfig(f"chunked-{big}", f"chunked, budget {big}", budget=big),
               RunConfig(f"chunked-{small}", f"chunked, budget {small}", budget=small)]
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


def _engine_args(plan: Plan, cfg: RunConfig) -> Any:
    from phaselab.config import EngineArgs

    kw: dict[str, Any] = dict(dtype=plan.dtype, kv_cache_memory=plan.kv_cache_memory, max_model_len=plan.max_model_len,
                              policy=cfg.policy)
    if cfg.policy == "chunked" and cfg.budget:
        kw["max_num_batched_tokens"] = cfg.budget
    if cfg.mode == "disagg":
        kw.update(mode="disagg", prefill_workers=1, decode_workers=1)
    return EngineArgs(**kw)


def _build_engine(plan: Plan, cfg: RunConfig, checkpoint: Any) -> Any:
    args = _engine_args(plan, cfg)
    if cfg.mode == "disagg":
        from phaselab.disagg.router import DisaggEngine

        if "checkpoint" in inspect.signature(DisaggEngine.__init__).parameters:
            return DisaggEngine(args, checkpoint=checkpoint)
        return DisaggEngine(args)
    from phaselab.engine.engine import LLMEngine

    return LLMEngine(args, checkpoint=checkpoint)


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
            drive(engine, arrivals, lambda done, total: progress.update(f"{done}/{total} requests finished"))
            path = out_dir / f"{name}-{cfg.name}"
            write_slice(engine, path, n_req, n_it)
            diag = diagnose(path)
            write_diagnosis(diag, path)
            res.runs[name], res.diagnoses[name] = path, diag
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        del engine
    res.wall_s = time.monotonic() - t0
    progress.done()
    return res


def _write_result(out: Path, plan: Plan, results: list[Any], notes: list[str], progress: Progress,
                  t_start: float) -> CompareResult:
    """The report, diagnosis and index of a finished compare run (real or simulated alike)."""
    from phaselab.analysis.report import write_compare_outputs

    progress.stage("writing the report")
    result = CompareResult(out, plan, results, notes)
    result.wall_s = time.monotonic() - t_start
    result.files = write_compare_outputs(result)
    result.wall_s = time.monotonic() - t_start  # including the report
    progress.stage(f"done in {result.wall_s:.0f} s: {result.files['report']}")
    return result


def run_compare(out_dir: str | Path, quick: bool = False, disagg: bool = True, show_progress: bool = True,
                stream: Any = None) -> CompareResult:
    """Run every configuration and write the report. Returns what was written."""
    t_start = time.monotonic()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (docs: threads on a small machine)
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
    plan = make_plan(quick, use_disagg)
    progress.stage("loading the bundled model (once, bf16)")
    import torch

    from phaselab.model.loader import load_checkpoint

    checkpoint = load_checkpoint(None, torch.bfloat16)
    results = []
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
    return _write_result(out, plan, results, notes, progress, t_start)


# -- simulated: the same comparison at cluster scale (phaselab/sim) -------------------------------------------------
SIM_SWEEP_LENS = (256, 1024, 2048, 4096, 8192)
SIM_SWEEP_OUTPUT_LEN = 4
SIM_INTERFERENCE = InterferenceSpec(num_streams=4, stream_input_len=512, stream_output_len=256, num_long_prompts=3,
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
    from phaselab.sim.catalog import get_hardware, get_link
    from phaselab.sim.catalog_files import is_file_ref
    from phaselab.sim.cli import DTYPE_BYTES, resolve_model

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
    from phaselab.bench.workloads import LengthDist, WorkloadError

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


def make_sim_plan(spec: SimSpec, budgets: Sequence[int] = (2048, 512), disagg: bool = True) -> Plan:
    """prefill-first, chunked at each budget, and disaggregated P:D, all on spec.num_gpus devices."""
    e, tp = spec.num_engines, spec.tp
    where = f"{e} x TP{tp}"
    configs = [RunConfig("prefill-first", f"prefill-first (unchunked), {where}", policy="prefill-first")]
    configs += [RunConfig(f"chunked-{b}", f"chunked, budget {b}, {where}", budget=b) for b in budgets]
    if disagg and spec.num_prefill and spec.num_decode:
        configs.append(RunConfig(f"disagg-{spec.num_prefill}p{spec.num_decode}d",
                                 f"disaggregated {spec.num_prefill}P:{spec.num_decode}D (TP{tp}), KV over {spec.link}",
                                 mode="disagg", budget=budgets[0] if budgets else None))
    from phaselab.sim.cli import resolve_model

    context = resolve_model(spec.model).max_position_embeddings
    lens = tuple(n for n in SIM_SWEEP_LENS if n + SIM_SWEEP_OUTPUT_LEN < context)  # (and what the KV cache holds)
    return Plan(SIM_INTERFERENCE, lens, SIM_SWEEP_OUTPUT_LEN, tuple(configs), "from device memory", spec.dtype, 0,
                spec)


def sim_deployment(spec: SimSpec, cfg: RunConfig) -> Any:
    from phaselab.sim.catalog import get_hardware
    from phaselab.sim.cli import DTYPE_BYTES, resolve_model
    from phaselab.sim.cost import CostParams
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
                      colocated=RoleConfig(tp=spec.tp, policy=cfg.policy, max_num_batched_tokens=cfg.budget), **common)


def sim_workloads(plan: Plan, max_model_len: int) -> list[tuple[str, list[Any], Any, dict[str, Any]]]:
    """(name, requests, arrivals, info) of the three workloads: `load` (the bench's random workload,
    open loop), `interference` (streams, then long prompts at timed arrivals) and `sweep` (one
    request at a time: a closed loop of one user)."""
    from phaselab.bench.workloads import InterferenceParams
    from phaselab.sim.workload import ArrivalSpec, SimRequest, interference_requests, random_requests

    spec = plan.simulation
    assert spec is not None
    load_arrivals = ArrivalSpec(request_rate=spec.request_rate, burstiness=spec.burstiness)
    load = random_requests(spec.num_prompts, spec.input_len, spec.output_len, spec.seed, load_arrivals)
    i = plan.interference
    long_len = min(i.long_input_len, max_model_len - i.long_output_len - 1)
    ip = InterferenceParams(i.num_streams, i.stream_input_len, i.stream_output_len, i.num_long_prompts, long_len,
                            i.long_output_len, spec.long_start_s, spec.long_interval_s)
    inter = interference_requests(ip)
    for r in inter:  # the names the real compare gives them (the report picks streams and long prompts by name)
        r.request_id = r.request_id.removeprefix("req-")
    lens = [n for n in plan.sweep_lens if n + plan.sweep_output_len < max_model_len]
    sweep = [SimRequest(f"sweep-{n}", n, plan.sweep_output_len, index=k) for k, n in enumerate(lens)]
    return [("load", load, load_arrivals, {"kind": "random", "seed": spec.seed, "input_len": spec.input_len,
                                           "output_len": spec.output_len}),
            ("interference", inter, ArrivalSpec(self_timed=True), {"kind": "interference",
                                                                   "params": dataclasses.asdict(ip)}),
            ("sweep", sweep, ArrivalSpec(concurrency=1), {"kind": "sweep", "input_lens": lens})]


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


def run_sim_compare(out_dir: str | Path, spec: SimSpec, budgets: Sequence[int] = (2048, 512), disagg: bool = True,
                    show_progress: bool = True, stream: Any = None) -> CompareResult:
    """`compare --simulate`: every configuration simulated on `spec`'s cluster, the same report."""
    t_start = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(show_progress)
    plan = make_sim_plan(spec, budgets, disagg)
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
    return _write_result(out, plan, results, notes, progress, t_start)


def load_compare(out_dir: str | Path) -> CompareResult:
    """Rebuild a finished compare from its directory (summary.json + run directories), re-diagnosing
    every run: `phaselab compare --from DIR` re-renders a report without running anything."""
    out = Path(out_dir)
    data = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    p = data["plan"]
    sim = SimSpec(**p["simulation"]) if p.get("simulation") else None
    plan = Plan(InterferenceSpec(**p["interference"]), tuple(p["sweep_lens"]), p["sweep_output_len"],
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


def plan_json(plan: Plan) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(plan)))


def fmt_duration(s: float) -> str:
    return fmt.s(s)
