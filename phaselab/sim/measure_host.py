"""Measuring this host's ceilings for a run, in a subprocess (`python -m phaselab.engine.ceilings`):
what `phaselab diagnose` and `phaselab simulate calibrate` do before pricing a run made on this
CPU that has none yet. The cache they fill and read is cost/host.py's; the simulator itself never
imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from phaselab.cost.catalog import HardwareSpec, get_hardware
from phaselab.cost.host import ceilings_file, run_ceilings, run_key, this_cpu
from phaselab.errors import ConfigError
from phaselab.obs.rundir import RunDirError, engine_config


def read_config(run_dir: str) -> dict[str, Any]:
    """A run directory's config.json ({} when it has none or it is unreadable)."""
    try:
        d = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def cache_run_host(run_dir: str, config: dict[str, Any], timeout_s: float = 300.0,
                   log: Any = None) -> bool:
    """Measure and cache this host's ceilings for a run made on this CPU that has none yet (neither
    recorded in its config.json nor cached for its key): `python -m phaselab.engine.ceilings --run
    RUN_DIR --cached`, a subprocess (a few seconds, once per key). What `phaselab diagnose` and
    `phaselab simulate calibrate` do before pricing such a run. True when the run now has ceilings
    of its own; False (nothing run) for a run of another CPU, a simulated run, or one that does not
    name its CPU; a failed measurement is said on `log` and returns False."""
    if config.get("simulated") or config.get("source") == "client":
        return False
    try:
        cfgs = [engine_config(config, role) for role in ("prefill", "decode")] \
            if config.get("mode") == "disagg" else [config]
    except RunDirError:
        return False
    if all(run_ceilings(c) for c in cfgs):
        return True
    model, isa = this_cpu()
    todo = [c for c in cfgs if not run_ceilings(c) and run_key(c)
            and run_key(c)["cpu_model"] == model and run_key(c)["isa"] == sorted(isa)]  # type: ignore[index]
    if not todo:
        return False
    for c in {json.dumps(run_key(c), sort_keys=True): c for c in todo}.values():
        threads = (c.get("machine") or {}).get("torch_num_threads")
        cmd = [sys.executable, "-m", "phaselab.engine.ceilings", "--run", str(run_dir), "--cached",
               "--threads", str(threads), "--dtype", str(c.get("dtype"))]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            proc = None
            err = str(e)
        else:
            err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        if proc is None or proc.returncode != 0:
            if log:
                log(f"measuring this host's ceilings failed ({' '.join(cmd)}: {err})")
            return False
        if log:
            log(f"this host's ceilings, measured once for this CPU, {threads} threads, {c.get('dtype')}: cached in "
                f"{ceilings_file(run_key(c))}")  # type: ignore[arg-type]
    return all(run_ceilings(c) for c in cfgs)


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
