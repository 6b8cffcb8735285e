"""Which ceilings bound a CPU calibration, and whether they are the run's own CPU's.

A calibration's efficiencies are fractions of the hardware entry's peak FLOP/s and bandwidth, capped
at 1 (calibrate.py). On a CPU those ceilings are measured, and the host changes between sessions, so
the right entry is the one measured on the host that made the run:

    run_hardware(config)        the ceilings the engine recorded in the run's config.json ("ceilings",
                                phaselab/engine/ceilings.py) when it measured them; else the catalog's
                                `cpu` entry, a documented default measured on an earlier host
    host_mismatch(config, hw)   warnings when the run's CPU (config.json's "machine": cpu_model, isa,
                                torch threads, dtype) is not the one hw's ceilings were measured on
    measure_host(run_dir, out)  measure this host's ceilings now, with the run's model, dtype and threads,
                                in a subprocess (the simulator itself never imports torch)

Torch-free, like the rest of phaselab/sim.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from phaselab.errors import ConfigError
from phaselab.sim.catalog import HardwareSpec, get_hardware
from phaselab.sim.catalog_files import hardware_from_dict

MEASURE_HINT = ("measure the run's host with `python -m phaselab.engine.ceilings --run RUN_DIR --out host.json` "
                "there (or run the engine with measure_ceilings=True) and calibrate with --hardware host.json")


def run_hardware(config: dict[str, Any], fallback: str = "cpu") -> HardwareSpec:
    """The hardware entry a real run's iterations are priced against (module docstring)."""
    ceilings = config.get("ceilings")
    if ceilings:
        return hardware_from_dict(ceilings, "recorded in the run's config.json (ceilings)")
    return get_hardware(fallback)


def host_mismatch(config: dict[str, Any], hw: HardwareSpec) -> list[str]:
    """Why hw's ceilings may not be the run's CPU's: one line per difference (empty: same CPU, ISA,
    threads and dtype as recorded)."""
    machine = config.get("machine") or {}
    host = hw.host
    run_cpu = machine.get("cpu_model")
    if host is None:
        return [f"the hardware entry {hw.name!r} names no measured CPU (no 'host'); its ceilings may not be those of "
                f"the CPU that made this run ({run_cpu or 'not recorded'}); {MEASURE_HINT}"]
    where = f"{host.get('cpu_model', '?')} ({', '.join(host.get('isa') or []) or 'ISA not recorded'}), " \
            f"{host.get('measured_at', 'date not recorded')}"
    if not run_cpu:
        return [f"the run's config.json does not name its CPU (recorded since the ceilings were); cannot check that "
                f"the ceilings of {hw.name!r} (measured on {where}) are its CPU's; {MEASURE_HINT}"]
    notes = []
    run_isa = machine.get("isa")
    if run_cpu != host.get("cpu_model") or (run_isa is not None and set(run_isa) != set(host.get("isa") or [])):
        notes.append(f"the run was made on {run_cpu} ({', '.join(run_isa or []) or 'ISA not recorded'}) but the "
                     f"ceilings of {hw.name!r} were measured on {where}: the efficiencies are capped at 1 of another "
                     f"CPU's ceilings; {MEASURE_HINT}")
    threads, host_threads = machine.get("torch_num_threads"), host.get("threads")
    if threads and host_threads and threads != host_threads:
        notes.append(f"the run used {threads} torch threads, the ceilings of {hw.name!r} were measured with "
                     f"{host_threads}; {MEASURE_HINT}")
    dtype, host_dtype = config.get("dtype"), host.get("dtype")
    if dtype and host_dtype and dtype != host_dtype:
        notes.append(f"the run computed in {dtype}, the GEMM ceiling of {hw.name!r} is {host_dtype}'s; {MEASURE_HINT}")
    return notes


def measure_host(run_dir: str, out: str, timeout_s: float = 300.0) -> HardwareSpec:
    """Measure this host's ceilings now (`python -m phaselab.engine.ceilings --run RUN_DIR`, a subprocess
    that imports torch), write them to `out` and return them."""
    cmd = [sys.executable, "-m", "phaselab.engine.ceilings", "--run", str(run_dir), "--out", out]
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    proc = subprocess.run(cmd, env=env, timeout=timeout_s, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"measuring this host's ceilings failed ({' '.join(cmd)} exited {proc.returncode}); run it "
                          "by hand to see why, or pass --hardware FILE.json")
    return get_hardware(out)


def hardware_to_dict(hw: HardwareSpec) -> dict[str, Any]:
    """A hardware file's object (catalog_files.py's schema) for hw."""
    d = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    return {k: v for k, v in d.items() if v not in (None, "", {})}


def write_hardware(hw: HardwareSpec, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(hardware_to_dict(hw), f, indent=2)
        f.write("\n")
