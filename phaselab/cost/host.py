"""Which ceilings bound a CPU calibration or a diagnosis's floors, and whether they are the run's own CPU's.

A calibration's efficiencies are fractions of the hardware entry's peak FLOP/s and bandwidth, capped
at 1 (record_fit.py), and a diagnosis's floors divide bytes by the bandwidth. On a CPU those ceilings
are measured (phaselab/engine/ceilings.py), and the host changes between sessions, so the right entry
is the one measured on the host that made the run:

    run_hardware(config)        the ceilings the engine recorded in the run's config.json ("ceilings");
                                else this CPU's cached ceilings for the run's key (below); else the
                                catalog's `cpu` entry, a documented default measured on an earlier host
    host_mismatch(config, hw)   warnings when the run's CPU (config.json's "machine": cpu_model, isa,
                                torch threads, dtype) is not the one hw's ceilings were measured on
    sim/measure_host.py         measures this host's ceilings now, with the run's model, dtype and
                                threads, in a subprocess (the simulator itself never imports torch)

The cache of measured ceilings, one file per key:

    $PHASELAB_CEILINGS_DIR, else $PHASELAB_CACHE_DIR/ceilings, else ${XDG_CACHE_HOME:-~/.cache}/phaselab/ceilings
        ceilings-<cpu model>-<threads>t-<dtype>-<hash>.json

The key is the CPU model name and its ISA flags (/proc/cpuinfo), the torch threads, the dtype and the
model's per-layer linear shapes (the GEMM peak is measured at them); <hash> covers all of it, and the
file repeats the key ("host": "cache_key"), which is checked on every read: a file measured on another
CPU (a copied cache, a shared home directory) is never used for this one. The engine writes it
(engine/ceilings.py host_ceilings: measured once, a few seconds); this module only reads it.

Torch-free, like the rest of phaselab/cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from phaselab import envs
from phaselab.errors import ConfigError, PhaselabError
from phaselab.cost.catalog import HardwareSpec, get_hardware
from phaselab.cost.catalog_files import hardware_from_dict
from phaselab.modelinfo.model_config import ModelConfig

# the CPU flags that decide matmul speed: config.json's "machine" and the ceilings' "host" name them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8")

MEASURE_HINT = ("measure the run's host with `python -m phaselab.engine.ceilings --run RUN_DIR --out host.json` "
                "there (or run the engine with measure_ceilings=True) and calibrate with --hardware host.json")


def this_cpu() -> tuple[str, list[str]]:
    """This CPU's model name and the ISA_FLAGS it has (/proc/cpuinfo; platform's names elsewhere)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), [f for f in ISA_FLAGS if f in flags]


def ceilings_dir() -> Path:
    """Where measured ceilings are cached (module docstring)."""
    explicit = envs.CEILINGS_DIR.get()
    if explicit:
        return Path(explicit)
    root = envs.CACHE_DIR.get() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "phaselab")
    return Path(root) / "ceilings"


def model_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of one layer's linear layers as the engine builds them (q/k/v and
    gate/up fused): the GEMM shapes the ceilings are measured at."""
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv": (h, config.q_size + 2 * config.kv_size), "o": (config.q_size, h),
            "gate_up": (h, 2 * i), "down": (i, h)}


def ceilings_key(cpu_model: str, isa: list[str], threads: int, dtype: str,
                 shapes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """What a cached measurement is valid for (module docstring), as plain JSON data."""
    return {"cpu_model": cpu_model, "isa": sorted(isa), "threads": int(threads), "dtype": dtype,
            "shapes": {k: list(v) for k, v in sorted(shapes.items())}}


def ceilings_file(key: dict[str, Any]) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", key["cpu_model"].lower()).strip("-")[:48] or "cpu"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return ceilings_dir() / f"ceilings-{slug}-{key['threads']}t-{key['dtype']}-{digest}.json"


def read_cached(key: dict[str, Any]) -> tuple[dict[str, Any], Path] | None:
    """The cached ceilings of `key` and their file, when the file exists, is a hardware file and was
    measured for exactly this key (its host's cache_key, CPU model, ISA, threads and dtype); else None."""
    path = ceilings_file(key)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        hardware_from_dict(d, str(path))
    except (OSError, ValueError, ConfigError):
        return None
    host = d.get("host") or {}
    same = (host.get("cache_key") == key and host.get("cpu_model") == key["cpu_model"]
            and sorted(host.get("isa") or []) == key["isa"] and host.get("threads") == key["threads"]
            and host.get("dtype") == key["dtype"])
    return (d, path) if same else None


def run_key(config: dict[str, Any]) -> dict[str, Any] | None:
    """The cache key of one engine's run (config.json: "machine", "dtype", the model's config); None when
    the run does not name its CPU, ISA, threads, dtype or model."""
    machine = config.get("machine") or {}
    model = (config.get("model") or {}).get("config")
    cpu, isa, threads, dtype = (machine.get("cpu_model"), machine.get("isa"), machine.get("torch_num_threads"),
                                config.get("dtype"))
    if not (cpu and isa is not None and threads and dtype and isinstance(model, dict)):
        return None
    try:
        shapes = model_shapes(ModelConfig.from_dict(model))
    except (TypeError, ValueError, KeyError, PhaselabError):
        return None
    return ceilings_key(cpu, isa, threads, str(dtype), shapes)


def run_ceilings(config: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """One engine's ceilings as a hardware file's object and where they came from: recorded in its
    config.json (measured on its own host), else cached for its key (its CPU, threads, dtype, model);
    None when neither."""
    if config.get("ceilings"):
        return dict(config["ceilings"]), "recorded in the run's config.json (ceilings)"
    key = run_key(config)
    found = read_cached(key) if key else None
    return (found[0], f"cached for this CPU in {found[1]}") if found else None


def run_hardware(config: dict[str, Any], fallback: str = "cpu") -> HardwareSpec:
    """The hardware entry a real run's iterations are priced against (module docstring)."""
    found = run_ceilings(config)
    if found:
        return hardware_from_dict(*found)
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


def hardware_to_dict(hw: HardwareSpec) -> dict[str, Any]:
    """A hardware file's object (catalog_files.py's schema) for hw."""
    d = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    return {k: v for k, v in d.items() if v not in (None, "", {})}


def write_hardware(hw: HardwareSpec, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(hardware_to_dict(hw), f, indent=2)
        f.write("\n")
