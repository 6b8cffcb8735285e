"""The machine's ceilings the diagnosis compares against: memory bandwidth and GEMM rate.

Looked up in this order: an explicit path (`--roofline FILE`), `$PHASELAB_ROOFLINE`; then the run's
own host's ceilings (phaselab/engine/ceilings.py: recorded in the run's config.json, else cached for
the run's CPU model, ISA flags, threads, dtype and model under ~/.cache/phaselab/ceilings, see
phaselab/cost/host.py); then the JSON `benchmarks/roofline.py` writes
(`./benchmarks/results/roofline.json`, then the same path next to the installed `phaselab` package,
a source checkout), marked "another CPU's" when it was measured on another CPU than the run's.
Without any, the documented defaults below are used and every figure that depends on them says
"assumed". A simulated run (phaselab/sim) is judged against the hardware it simulated, from its
config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from phaselab import envs
from phaselab.obs.rundir import RunDirError, engine_config

# Assumed when no roofline.json exists: a 2-core slice of a current x86 server (DDR4/DDR5 reads
# from two cores; bf16 GEMM through oneDNN). Run `python benchmarks/roofline.py` to measure.
DEFAULT_BANDWIDTH_BYTES_PER_S = 20e9
DEFAULT_GEMM_FLOPS_PER_S = 200e9
ROOFLINE_RELATIVE = Path("benchmarks") / "results" / "roofline.json"


@dataclass(frozen=True)
class Ceilings:
    bandwidth_bytes_per_s: float  # what decode steps are judged against (simulated: a decode engine's GPUs)
    gemm_flops_per_s: float  # what prefill is judged against (simulated: a prefill engine's GPUs)
    source: str  # the file read, "assumed default", or the simulated hardware
    kind: str = "measured"  # "measured" | "foreign" (another CPU's) | "assumed" | "simulated"
    link_name: str | None = None  # simulated disaggregation: the KV transfer link
    link_bandwidth_bytes_per_s: float | None = None  # one engine pair's share of it, per direction
    host: bool = False  # the run's own host's (engine/ceilings.py: recorded in the run or cached for its CPU)

    @property
    def measured(self) -> bool:
        """Measured on the run's own kind of CPU (or the simulated hardware's datasheet): figures
        may be bounded by them."""
        return self.kind in ("measured", "simulated")

    @property
    def adjective(self) -> str:
        """The kind, as a figure's qualifier: "measured 28 GB/s", "another CPU's 28 GB/s"."""
        return "another CPU's" if self.kind == "foreign" else self.kind

    @property
    def where(self) -> str:
        """What the figures describe, for sentences: "this machine" or the simulated hardware."""
        return f"the simulated {self.source.split(' (config.json')[0]}" if self.kind == "simulated" else "this machine"

    def label(self) -> str:
        if self.kind == "simulated":
            return f"simulated hardware: {self.source}"
        if self.kind == "foreign":
            return (f"another CPU's ({self.source}); on the run's machine, `python -m phaselab.engine.ceilings --run "
                    f"RUN_DIR --cached` caches its own (or run benchmarks/roofline.py there and pass --roofline FILE)")
        return f"measured ({self.source})" if self.measured else (
            f"assumed default ({DEFAULT_BANDWIDTH_BYTES_PER_S / 1e9:.0f} GB/s, "
            f"{DEFAULT_GEMM_FLOPS_PER_S / 1e9:.0f} GFLOP/s; `python -m phaselab.engine.ceilings --run RUN_DIR "
            f"--cached` caches this machine's)")


def at_least_achieved(ceilings: Ceilings, iterations: list[Any]) -> Ceilings:
    """`ceilings` (the run's own host's, measured by phaselab: a roofline file given or found is taken as
    it is), each rate raised to the most the run's own iterations achieved where they beat it: the bytes a decode-only step must read (weights and unique K/V) over its time, the
    GEMM FLOPs of an iteration with prefill over its time. A ceiling measured while the machine was
    busy is below the true one (a shared machine only ever slows a trial down), and a floor computed
    from it would be above what the run did; the source says when a rate was raised."""
    if ceilings.kind != "measured" or not ceilings.host:
        return ceilings
    its = [r for r in iterations if r.duration_s > 0 and r.modeled is not None]
    read = max(((r.modeled.weight_bytes + r.modeled.kv_read_bytes - r.modeled.kv_repeat_read_bytes) / r.duration_s
                for r in its if r.num_prefill_tokens == 0 and r.num_decode_tokens > 0), default=0.0)
    flops = max((r.modeled.matmul_flops / r.duration_s for r in its if r.num_prefill_tokens > 0), default=0.0)
    raised = []
    if read > ceilings.bandwidth_bytes_per_s:
        raised.append(f"bandwidth raised from {ceilings.bandwidth_bytes_per_s / 1e9:.2f} to the {read / 1e9:.2f} GB/s "
                      "a decode step of this run read")
    if flops > ceilings.gemm_flops_per_s:
        raised.append(f"GEMM rate raised from {ceilings.gemm_flops_per_s / 1e9:.0f} to the {flops / 1e9:.0f} GFLOP/s "
                      "an iteration of this run computed")
    if not raised:
        return ceilings
    return replace(ceilings, bandwidth_bytes_per_s=max(read, ceilings.bandwidth_bytes_per_s),
                   gemm_flops_per_s=max(flops, ceilings.gemm_flops_per_s),
                   source=f"{ceilings.source}; {', '.join(raised)} (the measurement was below it: made under load?)")


def simulated_ceilings(config: dict[str, Any]) -> Ceilings | None:
    """A simulated run (config.json `"simulated": true`) is judged against the hardware it simulated
    (config.json["hardware"]: datasheet peak FLOP/s and bandwidth), never this machine's roofline:
    prefill against one prefill engine's GPUs (peak x its TP), decode against one decode engine's
    (bandwidth x its TP); colocated engines do both. A disaggregated run also names its KV link."""
    hw = config.get("hardware") if config.get("simulated") else None
    if not isinstance(hw, dict) or not hw.get("mem_bandwidth") or not hw.get("peak_flops"):
        return None
    dep = config.get("deployment") or {}
    disagg = dep.get("mode") == "disagg"

    def tp(role: str) -> int:
        return int((dep.get(role) or {}).get("tp") or 1)

    tp_p, tp_d = (tp("prefill"), tp("decode")) if disagg else (tp("colocated"), tp("colocated"))
    name = hw.get("name", "device")
    where = f"{name} x TP{tp_d}" if tp_p == tp_d else f"{name} x TP{tp_p} (prefill) / TP{tp_d} (decode)"
    link = (config.get("transfer") or {}).get("link") if disagg else None
    link_bw = None
    if isinstance(link, dict) and link.get("bandwidth"):  # per port; per-GPU links: one port per GPU (sim/transfer)
        link_bw = float(link["bandwidth"]) * (min(tp_p, tp_d) if link.get("per_gpu", True) else 1)
    return Ceilings(float(hw["mem_bandwidth"]) * tp_d, float(hw["peak_flops"]) * tp_p,
                    f"{where} (config.json: {float(hw['peak_flops']) / 1e12:g} TFLOP/s, "
                    f"{float(hw['mem_bandwidth']) / 1e12:g} TB/s per device)", "simulated",
                    link.get("name") if isinstance(link, dict) else None, link_bw)


def run_engine_config(config: dict[str, Any], role: str | None = None) -> dict[str, Any]:
    """The engine part of a run's config.json (a disaggregated run: its first worker's of `role`), or
    the config itself when a disaggregated run recorded no worker."""
    try:
        return engine_config(config, role)
    except RunDirError:
        return config


def run_machine(config: dict[str, Any]) -> dict[str, Any] | None:
    """The CPU a run was made on (config.json's "machine"; a disaggregated run: its workers')."""
    return run_engine_config(config).get("machine")


def _describe(d: dict[str, Any], where: str) -> str:
    host = d.get("host") or {}
    if host.get("cache_file") and "cached" not in where:
        where += f", cached in {host['cache_file']}"
    return (f"this machine's, {where}: {host.get('cpu_model', '?')}, {host.get('threads', '?')} threads, "
            f"{host.get('dtype', '?')}, measured {host.get('measured_at', '?')}")


def host_ceilings(config: dict[str, Any]) -> Ceilings | None:
    """The run's own host's ceilings (phaselab/cost/host.py run_ceilings: recorded in its config.json,
    else cached for its CPU, threads, dtype and model); a disaggregated run: the decode workers'
    bandwidth and the prefill workers' GEMM rate. None when the run has neither."""
    from phaselab.cost.host import run_ceilings

    roles = {"decode": run_engine_config(config, "decode"), "prefill": run_engine_config(config, "prefill")}
    found = {}
    for role, cfg in roles.items():
        got = run_ceilings(cfg)
        if got is not None and other_cpu(got[0].get("host"), cfg.get("machine")) is None:
            found[role] = got
    if not found:
        return None
    dec = found.get("decode") or found["prefill"]
    pre = found.get("prefill") or dec
    try:
        bw, gemm = float(dec[0]["mem_bandwidth"]), float(pre[0]["peak_flops"])
    except (KeyError, TypeError, ValueError):
        return None
    source = _describe(dec[0], dec[1]) if dec is pre or dec == pre else \
        f"decode: {_describe(dec[0], dec[1])}; prefill: {_describe(pre[0], pre[1])}"
    return Ceilings(bw, gemm, source, "measured", host=True)


def _explicit(explicit: str | None) -> list[Path]:
    out = []
    if explicit:
        out.append(Path(explicit))
    roofline = envs.ROOFLINE.get()
    if roofline:
        out.append(Path(roofline))
    return out


def _implicit() -> list[Path]:
    return [Path.cwd() / ROOFLINE_RELATIVE, Path(__file__).resolve().parents[2] / ROOFLINE_RELATIVE]


def other_cpu(file_machine: dict[str, Any] | None, run_machine: dict[str, Any] | None) -> str | None:
    """Why a roofline file's ceilings are not those of the CPU that made a run (None: the same CPU
    model and ISA flags, or either side does not name its CPU: nothing to compare)."""
    if not file_machine or not run_machine or not file_machine.get("cpu_model") or not run_machine.get("cpu_model"):
        return None
    fcpu, rcpu = file_machine["cpu_model"], run_machine["cpu_model"]
    fisa, risa = file_machine.get("isa"), run_machine.get("isa")
    if fcpu != rcpu or (fisa is not None and risa is not None and set(fisa) != set(risa)):
        return (f"measured on {fcpu} ({', '.join(fisa or []) or 'ISA not recorded'}), the run on {rcpu} "
                f"({', '.join(risa or []) or 'ISA not recorded'})")
    return None


def _from_roofline(p: Path, dtype: str, machine: dict[str, Any] | None) -> Ceilings | None:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        bw = float(data["bandwidth"]["read_bytes_per_s"])
        mix = (data.get(dtype) or data.get("bfloat16") or {}).get("gemm_flops_per_s", {}).get("layer_mix", {})
        gemm = float(max(mix.values())) if mix else DEFAULT_GEMM_FLOPS_PER_S
    except (KeyError, ValueError, TypeError, json.JSONDecodeError):
        return None
    why = other_cpu(data.get("machine"), machine)
    if why:
        return Ceilings(bw, gemm, f"{p}, {why}", "foreign")
    return Ceilings(bw, gemm, str(p), "measured")


def load_ceilings(path: str | None = None, dtype: str = "bfloat16", machine: dict[str, Any] | None = None,
                  config: dict[str, Any] | None = None) -> Ceilings:
    """The ceilings a run is judged against (module docstring). `config`: the run's config.json (its
    own host's ceilings, its CPU, its dtype); `machine`: the run's CPU when no config is given. A
    roofline file measured on another CPU is kept for scale but marked "foreign": its figures are
    labeled so and never bound a fit (another CPU's bandwidth is no floor on this one's)."""
    if config is not None:
        machine = machine or run_machine(config)
        dtype = str(run_engine_config(config).get("dtype") or dtype)
    for p in _explicit(path):
        if p.is_file():
            found = _from_roofline(p, dtype, machine)
            if found is not None:
                return found
        elif path and p == Path(path):
            raise FileNotFoundError(f"roofline file {path} does not exist (write one with benchmarks/roofline.py)")
    own = host_ceilings(config) if config is not None else None
    if own is not None:
        return own
    for p in _implicit():
        if p.is_file():
            found = _from_roofline(p, dtype, machine)
            if found is not None:
                return found
    return Ceilings(DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_GEMM_FLOPS_PER_S, "assumed default", "assumed")
