"""Catalog entries from files: a device or a link the built-in catalog lacks, as JSON.

Everywhere a hardware or link name is accepted (`--hardware`, `--tp-link`, `--transfer-link`,
`simulate fit --hardware`, a hardware file's own `tp_link`), a path to a `.json` file works too:

hardware (units: FLOP/s, bytes/s, bytes; every number may say where it came from in "sources"):

    {"name": "mi300x", "peak_flops": 1.307e15, "mem_bandwidth": 5.3e12, "memory_bytes": 192e9,
     "tp_link": "infinity-fabric.json",            # a catalog link name or a link file (relative to this file)
     "description": "AMD Instinct MI300X",
     "sources": {"peak_flops": "datasheet: ...", "mem_bandwidth": "datasheet: ..."},
     "cost_params": {"compute_efficiency": 0.6, ...},   # optional: CostParams fields (or a fit's JSON)
     "host": {"cpu_model": "AMD EPYC", "isa": [...], "measured_at": ..., ...}}  # optional: a measured CPU
                                                   # (phaselab/engine/ceilings.py writes these files)

link:

    {"name": "infinity-fabric", "bandwidth": 64e9, "latency_s": 3e-6, "per_gpu": true,
     "description": "...", "sources": {...}}

Required: hardware name, peak_flops, mem_bandwidth, memory_bytes; link name, bandwidth, latency_s.
A missing or mistyped field is an error that names it and this schema (docs/simulator.md).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from phaselab.errors import ConfigError

if TYPE_CHECKING:  # catalog imports this module inside its lookups
    from phaselab.cost.catalog import HardwareSpec, LinkSpec

HARDWARE_FIELDS = {"name": str, "peak_flops": float, "mem_bandwidth": float, "memory_bytes": float}
HARDWARE_OPTIONAL = {"tp_link", "description", "sources", "cost_params", "host"}
LINK_FIELDS = {"name": str, "bandwidth": float, "latency_s": float}
LINK_OPTIONAL = {"per_gpu", "description", "sources"}


def is_file_ref(name: str) -> bool:
    return name.lower().endswith(".json") or os.path.isfile(name)


def _read(path: str, kind: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"{kind} file {path!r} not found; pass a catalog name or the path of a {kind} JSON "
                          "(schema: docs/simulator.md, 'Adding a device from a file')")
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{kind} file {path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{kind} file {path}: expected a JSON object with fields {', '.join(LINK_FIELDS)}")
    return d


def _check(d: dict[str, Any], path: str, kind: str, required: dict[str, type], optional: set[str]) -> None:
    for name, typ in required.items():
        if name not in d:
            raise ConfigError(f"{kind} file {path} lacks the field {name!r}; required: {', '.join(required)} "
                              f"(optional: {', '.join(sorted(optional))}); see docs/simulator.md")
        if typ is float and not (isinstance(d[name], (int, float)) and d[name] > 0):
            raise ConfigError(f"{kind} file {path}: {name}={d[name]!r} must be a positive number")
    unknown = set(d) - set(required) - optional
    if unknown:
        raise ConfigError(f"{kind} file {path}: unknown field(s) {sorted(unknown)}; known: "
                          f"{', '.join([*required, *sorted(optional)])}")


def load_link(path: str) -> LinkSpec:
    from phaselab.cost.catalog import LinkSpec

    d = _read(path, "link")
    _check(d, path, "link", LINK_FIELDS, LINK_OPTIONAL)
    sources = {k: str(v) for k, v in (d.get("sources") or {}).items()}
    sources.setdefault("*", f"file {path}")
    return LinkSpec(str(d["name"]), float(d["bandwidth"]), float(d["latency_s"]), bool(d.get("per_gpu", True)),
                    str(d.get("description", "")), sources)


def load_hardware(path: str) -> HardwareSpec:
    return hardware_from_dict(_read(path, "hardware"), path, os.path.dirname(os.path.abspath(path)))


def hardware_from_dict(d: dict[str, Any], path: str, base_dir: str = ".") -> HardwareSpec:
    """A HardwareSpec from a hardware file's object (`path` names where it came from in errors and sources;
    a relative tp_link file is looked up in `base_dir`)."""
    from phaselab.cost.catalog import HardwareSpec, get_link

    if not isinstance(d, dict):
        raise ConfigError(f"hardware {path}: expected a JSON object with fields {', '.join(HARDWARE_FIELDS)}")
    _check(d, path, "hardware", HARDWARE_FIELDS, HARDWARE_OPTIONAL)
    tp_link = str(d.get("tp_link", "nvlink4"))
    if is_file_ref(tp_link) and not os.path.isabs(tp_link):
        tp_link = os.path.join(base_dir, tp_link)
    get_link(tp_link)  # fail here, naming the hardware file, rather than at the first TP engine
    params = d.get("cost_params")
    if params is not None:
        from phaselab.cost.pricing import CostParams

        if not isinstance(params, dict):
            raise ConfigError(f"hardware file {path}: cost_params must be an object of CostParams fields")
        CostParams.from_json({k: v for k, v in params.items() if k not in ("fit", "link", "hardware")})  # validate
    sources = {k: str(v) for k, v in (d.get("sources") or {}).items()}
    sources.setdefault("*", f"file {path}")
    host = d.get("host")
    if host is not None and not isinstance(host, dict):
        raise ConfigError(f"hardware file {path}: host must be an object (cpu_model, isa, measured_at, ...)")
    return HardwareSpec(str(d["name"]), float(d["peak_flops"]), float(d["mem_bandwidth"]), int(d["memory_bytes"]),
                        tp_link, str(d.get("description", "")), sources, cost_params=params, host=host)
