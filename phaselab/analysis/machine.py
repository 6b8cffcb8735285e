"""The machine's ceilings the diagnosis compares against: memory bandwidth and GEMM rate.

Read from the JSON `benchmarks/roofline.py` writes (`benchmarks/results/roofline.json`), looked up
in this order: an explicit path, `$PHASELAB_ROOFLINE`, `./benchmarks/results/roofline.json`, then
the same path next to the installed `phaselab` package (a source checkout). Without one, the
documented defaults below are used and every figure that depends on them says "assumed". A
simulated run (phaselab/sim) is judged against the hardware it simulated, from its config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Assumed when no roofline.json exists: a 2-core slice of a current x86 server (DDR4/DDR5 reads
# from two cores; bf16 GEMM through oneDNN). Run `python benchmarks/roofline.py` to measure.
DEFAULT_BANDWIDTH_BYTES_PER_S = 20e9
DEFAULT_GEMM_FLOPS_PER_S = 200e9
ROOFLINE_RELATIVE = Path("benchmarks") / "results" / "roofline.json"


@dataclass(frozen=True)
class Ceilings:
    bandwidth_bytes_per_s: float
    gemm_flops_per_s: float
    source: str  # the file read, "assumed default", or the simulated hardware
    kind: str = "measured"  # "measured" | "assumed" | "simulated"

    @property
    def measured(self) -> bool:
        return self.kind != "assumed"

    def label(self) -> str:
        if self.kind == "simulated":
            return f"simulated hardware: {self.source}"
        return f"measured ({self.source})" if self.measured else (
            f"assumed default ({DEFAULT_BANDWIDTH_BYTES_PER_S / 1e9:.0f} GB/s, "
            f"{DEFAULT_GEMM_FLOPS_PER_S / 1e9:.0f} GFLOP/s; run benchmarks/roofline.py for this machine's)")


def simulated_ceilings(config: dict[str, Any]) -> Ceilings | None:
    """A simulated run (config.json `"simulated": true`) is judged against the hardware it simulated:
    one decode worker's ceilings (the device's times its tensor-parallel degree)."""
    hw = config.get("hardware") if config.get("simulated") else None
    if not isinstance(hw, dict) or not hw.get("mem_bandwidth"):
        return None
    dep = config.get("deployment") or {}
    role = "decode" if dep.get("mode") == "disagg" else "colocated"
    tp = int((dep.get(role) or {}).get("tp") or 1)
    return Ceilings(float(hw["mem_bandwidth"]) * tp, float(hw.get("peak_flops") or DEFAULT_GEMM_FLOPS_PER_S) * tp,
                    f"{hw.get('name', 'device')} x TP{tp} (config.json)", "simulated")


def _candidates(explicit: str | None) -> list[Path]:
    out = []
    if explicit:
        out.append(Path(explicit))
    if os.environ.get("PHASELAB_ROOFLINE"):
        out.append(Path(os.environ["PHASELAB_ROOFLINE"]))
    out.append(Path.cwd() / ROOFLINE_RELATIVE)
    out.append(Path(__file__).resolve().parents[2] / ROOFLINE_RELATIVE)
    return out


def load_ceilings(path: str | None = None, dtype: str = "bfloat16") -> Ceilings:
    for p in _candidates(path):
        if p.is_file():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
                bw = float(data["bandwidth"]["read_bytes_per_s"])
                mix = (data.get(dtype) or data.get("bfloat16") or {}).get("gemm_flops_per_s", {}).get("layer_mix", {})
                gemm = float(max(mix.values())) if mix else DEFAULT_GEMM_FLOPS_PER_S
                return Ceilings(bw, gemm, str(p), "measured")
            except (KeyError, ValueError, TypeError, json.JSONDecodeError):
                continue
        elif path and p == Path(path):
            raise FileNotFoundError(f"roofline file {path} does not exist (write one with benchmarks/roofline.py)")
    return Ceilings(DEFAULT_BANDWIDTH_BYTES_PER_S, DEFAULT_GEMM_FLOPS_PER_S, "assumed default", "assumed")
