"""Fit a device's bounded cost terms to operator-level profile tables (`phaselab simulate fit`).

    GEMMs        t = o_gemm + max(F / (peak x e_max x T / (T + T_half)), B / (bandwidth x e_mem))
    elementwise  t = o_kernel + B / (bandwidth x e_elem)
    all-reduce   t = latency + 2 (n-1)/n x bytes / (link bandwidth x e_ar)
    send/recv    t = latency + bytes / (link bandwidth x e_link)            (the KV transfer's link)

fitted by bounded least squares on log(predicted / measured) (every sample counts by its relative
error), with every efficiency in (0, 1] and every fixed cost >= 0; several starts, the best kept.
peak, bandwidth and link bandwidth are the catalog's datasheet figures, so each efficiency is a
fraction of the datasheet. The result is a `CostParams` whose every field says where it came
from: "fitted on <tables> (N samples, |rel. error| p50 / p90)" or "assumed: ..." (attention, which
has no profile in the Vidur data: phaselab/cost/efficiency.py).

The shipped A100 and H100 defaults (phaselab/cost/data/fits/) are this fit on the Vidur tables in
phaselab/cost/data/vidur/ (`phaselab simulate fit --vidur a100 --out phaselab/cost/data/fits/a100.json`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.optimize import least_squares  # type: ignore[import-untyped]

from phaselab.errors import ConfigError
from phaselab.cost.catalog import HardwareSpec, LinkSpec
from phaselab.cost.pricing import CostParams
from phaselab.cost.efficiency import ATTENTION_K_HALF, ATTENTION_Q_HALF, KV_CONTEXT_HALF
from phaselab.cost.profiles import ELEMENTWISE_OPS, CollectiveSample, OpSample, read_collective_table, read_compute_table

# FlashAttention-2's forward efficiency by device (no attention profile in the Vidur copy): efficiency.py
ATTENTION_EFFICIENCY = {
    "a100": (0.73, "assumed: FlashAttention-2 forward reaches 50-73% of peak on A100 (Dao 2023, abstract); "
                   "shape curve in phaselab/cost/efficiency.py; not fitted (no attention profile)"),
    "h100": (0.35, "assumed: FlashAttention-2 reaches ~35% of peak on H100 (Shah et al. 2024, FlashAttention-3, "
                   "abstract); shape curve in phaselab/cost/efficiency.py; not fitted (no attention profile)"),
}
ENGINE_OVERHEADS = (  # per iteration and per request: the engine's CPU work, not in any operator profile
    1e-3, 5e-6, "assumed: a GPU engine's scheduling, input preparation and sampling per iteration (CUDA "
                "graphs); the Vidur copy has no CPU-overhead profile; not fitted")


@dataclass
class TermFit:
    """One operator class's fitted parameters and how well they reproduce the table."""

    name: str
    values: dict[str, float]
    num_samples: int
    rel_errors: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    by_tp: dict[int, np.ndarray] = field(repr=False, default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def error_summary(self) -> dict[str, Any]:
        e = np.abs(self.rel_errors)

        def q(a: np.ndarray) -> dict[str, float]:
            return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
                    "max": float(a.max()), "mean_signed": float(np.mean(a))} if a.size else {}

        return {"num_samples": self.num_samples,
                "abs_rel_error": q(e) | {"mean_signed": float(np.mean(self.rel_errors))},
                "abs_rel_error_by_tp": {str(k): q(np.abs(v)) for k, v in sorted(self.by_tp.items())}}

    def describe(self) -> str:
        e = np.abs(self.rel_errors)
        files = sorted({Path(s).parent.name + "/" + Path(s).name for s in self.sources})
        return (f"fitted on {', '.join(files)} ({self.num_samples} {self.name} samples; |relative error| "
                f"p50 {np.percentile(e, 50):.1%}, p90 {np.percentile(e, 90):.1%})")


def _solve(residual: Callable[[np.ndarray], np.ndarray], x0s: list[list[float]], lower: list[float], upper: list[float]) -> np.ndarray:
    best: np.ndarray | None = None
    best_cost = np.inf
    for x0 in x0s:
        x0 = np.clip(np.asarray(x0, float), np.asarray(lower) + 1e-12, np.asarray(upper) - 1e-12)
        r = least_squares(residual, x0, bounds=(lower, upper), x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12,
                          max_nfev=4000)
        if r.cost < best_cost:
            best, best_cost = r.x, r.cost
    assert best is not None
    return np.asarray(best, dtype=float)


def gemm_time(x: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, tokens: np.ndarray, peak: float,
              bw: float) -> np.ndarray:
    e_max, rows_half, e_mem, o = x
    compute = flops * (tokens + rows_half) / tokens / (peak * e_max)
    return np.asarray(o + np.maximum(compute, nbytes / (bw * e_mem)), dtype=float)


def fit_gemms(samples: list[OpSample], hw: HardwareSpec) -> TermFit:
    f = np.array([s.flops for s in samples])
    b = np.array([s.num_bytes for s in samples])
    t = np.array([s.num_tokens for s in samples], float)
    y = np.array([s.time_s for s in samples])
    peak, bw = hw.peak_flops, hw.mem_bandwidth
    x = _solve(lambda x: np.log(gemm_time(x, f, b, t, peak, bw) / y),
               [[0.7, 32, 0.8, 5e-6], [0.9, 128, 0.6, 1e-6], [0.5, 8, 0.9, 2e-5]],
               [1e-3, 0.0, 1e-3, 0.0], [1.0, 1e4, 1.0, 1e-3])
    rel = gemm_time(x, f, b, t, peak, bw) / y - 1
    tps = np.array([s.tp for s in samples])
    return TermFit("GEMM", {"compute_efficiency": x[0], "rows_half": x[1], "memory_efficiency": x[2],
                            "gemm_fixed_s": x[3]}, len(samples), rel, {int(k): rel[tps == k] for k in set(tps)},
                   sorted({s.source for s in samples}))


def fit_elementwise(samples: list[OpSample], hw: HardwareSpec) -> TermFit:
    """One bandwidth fraction for all elementwise kernels, one fixed time per kernel (a norm's launch
    and reduction tail is not an add's)."""
    ops = sorted({s.op for s in samples})
    col = np.array([ops.index(s.op) for s in samples])
    b = np.array([s.num_bytes for s in samples])
    y = np.array([s.time_s for s in samples])
    bw = hw.mem_bandwidth

    def pred(x: np.ndarray) -> np.ndarray:
        return np.asarray(x[1:][col] + b / (bw * x[0]), dtype=float)

    k = len(ops)
    x = _solve(lambda x: np.log(pred(x) / y), [[0.5] + [5e-6] * k, [0.9] + [1e-6] * k, [0.2] + [2e-5] * k],
               [1e-3] + [0.0] * k, [1.0] + [1e-3] * k)
    rel = pred(x) / y - 1
    tps = np.array([s.tp for s in samples])
    per_layer = sum(ELEMENTWISE_OPS.get(op, 1) * x[1 + j] for j, op in enumerate(ops))
    return TermFit("elementwise", {"elementwise_efficiency": x[0], "fixed_s_per_layer": per_layer,
                                   **{f"fixed_s.{op}": x[1 + j] for j, op in enumerate(ops)}}, len(samples), rel,
                   {int(k): rel[tps == k] for k in set(tps)}, sorted({s.source for s in samples}))


def fit_link(samples: list[CollectiveSample], link: LinkSpec, op: str) -> TermFit:
    n = np.array([s.num_workers for s in samples], float)
    size = np.array([s.num_bytes for s in samples], float)
    y = np.array([s.time_s for s in samples])
    factor = 2 * (n - 1) / n if op == "all_reduce" else np.ones_like(n)

    def pred(x: np.ndarray) -> np.ndarray:
        return np.asarray(x[1] + factor * size / (link.bandwidth * x[0]), dtype=float)

    x = _solve(lambda x: np.log(pred(x) / y), [[0.7, 2e-5], [0.3, 5e-6], [0.95, 5e-5]], [1e-3, 0.0], [1.0, 1e-2])
    rel = pred(x) / y - 1
    return TermFit(op, {"efficiency": x[0], "latency_s": x[1]}, len(samples), rel,
                   {int(k): rel[n == k] for k in set(n)}, sorted({s.source for s in samples}))


@dataclass
class DeviceFit:
    hardware: HardwareSpec
    link: LinkSpec | None
    params: CostParams
    terms: dict[str, TermFit]
    link_efficiency: float | None = None
    link_latency_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        link = None
        if self.link is not None and self.link_efficiency is not None:
            t = self.terms["send_recv"]
            link = {"name": self.link.name, "efficiency": self.link_efficiency, "latency_s": self.link_latency_s,
                    "sources": {"efficiency": t.describe(), "latency_s": t.describe()}}
        return {"hardware": self.hardware.name, **self.params.to_json(), "link": link,
                "fit": {name: {"values": t.values, **t.error_summary()} for name, t in self.terms.items()}}


def fit_device(hw: HardwareSpec, link: LinkSpec | None, compute: list[Path], all_reduce: list[Path],
               send_recv: list[Path]) -> DeviceFit:
    """Every term of a device that its tables measure; the rest assumed and said so (module docstring)."""
    gemm_samples: list[OpSample] = []
    elem_samples: list[OpSample] = []
    for path in compute:
        g, e = read_compute_table(path)
        gemm_samples += g
        elem_samples += e
    if not gemm_samples:
        raise ConfigError("fit needs at least one compute table (--compute mlp.csv or --vidur DEVICE)")
    terms = {"gemm": fit_gemms(gemm_samples, hw)}
    if elem_samples:
        terms["elementwise"] = fit_elementwise(elem_samples, hw)
    if link is not None:
        ar = [s for p in all_reduce for s in read_collective_table(p)]
        if ar:
            terms["all_reduce"] = fit_link(ar, link, "all_reduce")
        sr = [s for p in send_recv for s in read_collective_table(p)]
        if sr:
            terms["send_recv"] = fit_link(sr, link, "send_recv")
    gemm = terms["gemm"]
    src_g = gemm.describe()
    att, att_src = ATTENTION_EFFICIENCY.get(hw.name, (0.5, "assumed: FlashAttention-style, no device figure; "
                                                            "not fitted"))
    o_iter, o_req, o_src = ENGINE_OVERHEADS
    values: dict[str, Any] = {
        "compute_efficiency": gemm.values["compute_efficiency"], "rows_half": gemm.values["rows_half"],
        "memory_efficiency": gemm.values["memory_efficiency"], "kv_memory_efficiency": gemm.values["memory_efficiency"],
        "attention_efficiency": att, "decode_attention_efficiency": att,
        "attention_q_half": ATTENTION_Q_HALF, "attention_k_half": ATTENTION_K_HALF,
        "kv_context_half": KV_CONTEXT_HALF, "iteration_overhead_s": o_iter, "request_overhead_s": o_req,
        "chunk_overhead_s": 0.0, "token_overhead_s": 0.0}
    sources = {k: src_g for k in ("compute_efficiency", "rows_half", "memory_efficiency")}
    sources["kv_memory_efficiency"] = f"assumed: the weight stream's fitted fraction ({src_g})"
    sources.update({k: att_src for k in ("attention_efficiency", "decode_attention_efficiency",
                                         "attention_q_half", "attention_k_half")})
    sources["kv_context_half"] = "assumed: a paged decode kernel needs ~100s of keys in flight; not fitted"
    sources["iteration_overhead_s"] = sources["request_overhead_s"] = o_src
    sources["chunk_overhead_s"] = "default: 0, the chunks of an iteration share one varlen attention call per layer"
    sources["token_overhead_s"] = "default: 0, every per-token cost is a roofline term"
    # per layer: 4 GEMM launches, the 6 elementwise kernels (2 norms, RoPE, activation, 2 adds), and the two
    # attention calls (prefill, decode) priced as one more GEMM launch each
    elem = terms["elementwise"].values["fixed_s_per_layer"] if "elementwise" in terms else 6 * gemm.values["gemm_fixed_s"]
    values["layer_overhead_s"] = 6 * gemm.values["gemm_fixed_s"] + elem
    sources["layer_overhead_s"] = ("fitted: 6 x the GEMMs' fixed time (4 projections, 2 attention calls) + the "
                                   "elementwise kernels' fixed times, from the same tables")
    if "elementwise" in terms:
        values["elementwise_efficiency"] = terms["elementwise"].values["elementwise_efficiency"]
        sources["elementwise_efficiency"] = terms["elementwise"].describe()
    if "all_reduce" in terms:
        values["allreduce_efficiency"] = terms["all_reduce"].values["efficiency"]
        values["allreduce_latency_s"] = terms["all_reduce"].values["latency_s"]
        sources["allreduce_efficiency"] = sources["allreduce_latency_s"] = \
            terms["all_reduce"].describe() + f", relative to {link.name if link else 'the link'}'s datasheet bandwidth"
    params = CostParams(**values, sources=sources)
    fit = DeviceFit(hw, link, params, terms)
    if "send_recv" in terms:
        fit.link_efficiency = terms["send_recv"].values["efficiency"]
        fit.link_latency_s = terms["send_recv"].values["latency_s"]
    return fit


# -- the shipped fits ----------------------------------------------------------------------------------------
FITS_DIR = "data/fits"
FIT_ALIASES = {"h200": ("h100", "the H100's fit (same compute; efficiencies are fractions of each device's own "
                                "datasheet figures)")}


def _fit_path(name: str) -> Path:
    return Path(str(resources.files("phaselab.cost").joinpath(FITS_DIR, f"{name}.json")))


def load_fit_json(name: str) -> dict[str, Any] | None:
    path = _fit_path(name)
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    return d if isinstance(d, dict) else None


def shipped_fit(hardware_name: str) -> CostParams | None:
    """The packaged fit of a GPU (None: none shipped)."""
    name, note = FIT_ALIASES.get(hardware_name, (hardware_name, ""))
    d = load_fit_json(name)
    if d is None:
        return None
    params = CostParams.from_json({k: v for k, v in d.items() if k != "link"})
    if note:
        params = replace(params, sources={k: f"{v} [{note}]" for k, v in params.sources.items()})
    return params


def shipped_link_fit(link_name: str) -> dict[str, Any] | None:
    """The packaged send/recv fit of a link (efficiency, latency_s, sources), if a device fit has one."""
    for name in ("a100", "h100"):
        d = load_fit_json(name)
        if d and d.get("link") and d["link"]["name"] == link_name:
            link: dict[str, Any] = d["link"]
            return link
    return None


# -- `phaselab simulate fit` -----------------------------------------------------------------------------------
def add_fit_parser(sub: Any) -> None:
    p = sub.add_parser("fit", help="fit a device's efficiency curves to operator-level profile tables",
                       description="Fit a device's bounded cost terms (GEMM efficiency by tokens, weight-stream and "
                                   "elementwise bandwidth fractions, kernel fixed times, all-reduce and send/recv "
                                   "link efficiency and latency) to operator profile tables in Vidur's format; "
                                   "write a parameters JSON for --params (docs/simulator.md).")
    p.add_argument("--hardware", default=None, help="catalog name or hardware JSON file the tables were measured on "
                                                    "(default: the --vidur device)")
    p.add_argument("--vidur", default=None, metavar="DEVICE", help="the packaged Vidur tables of a100 or h100")
    p.add_argument("--compute", action="append", default=[], metavar="MLP_CSV", help="compute table (repeatable)")
    p.add_argument("--all-reduce", action="append", default=[], metavar="CSV", help="all_reduce table (repeatable)")
    p.add_argument("--send-recv", action="append", default=[], metavar="CSV", help="send_recv table (repeatable)")
    p.add_argument("--link", default=None, help="the link the collectives ran on (default: the hardware's TP link)")
    p.add_argument("--out", default=None, help="write the fitted parameters JSON here")


def run_fit(ns: Any) -> int:
    from phaselab.cost.catalog import get_hardware, get_link
    from phaselab.cost.profiles import vidur_files

    files: dict[str, list[Path]] = {"compute": [Path(p) for p in ns.compute],
                                    "all_reduce": [Path(p) for p in ns.all_reduce],
                                    "send_recv": [Path(p) for p in ns.send_recv]}
    if ns.vidur:
        for k, v in vidur_files(ns.vidur).items():
            files[k] += v
    name = ns.hardware or ns.vidur
    if not name:
        raise ConfigError("say which device the tables were measured on: --hardware NAME|FILE.json (or --vidur)")
    hw = get_hardware(name)
    link = get_link(ns.link or hw.tp_link)
    print(f"fitting {hw.name} on {sum(len(v) for v in files.values())} tables ...")
    fit = fit_device(hw, link, files["compute"], files["all_reduce"], files["send_recv"])
    for term in fit.terms.values():
        vals = ", ".join(f"{k} {v:.4g}" for k, v in term.values.items() if not k.startswith("fixed_s."))
        s = term.error_summary()["abs_rel_error"]
        print(f"  {term.name:<12} {vals}  |rel err| p50 {s['p50']:.1%} p90 {s['p90']:.1%} ({term.num_samples} samples)")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.out, "w", encoding="utf-8") as f:
            json.dump(fit.to_json(), f, indent=2)
            f.write("\n")
        print(f"written to {ns.out}; simulate with --hardware {hw.name} --params {ns.out}")
    return 0


def effective_link(link: LinkSpec) -> LinkSpec:
    """A link as a transfer sees it: bandwidth x the fitted send/recv efficiency, the fitted latency."""
    d = shipped_link_fit(link.name)
    if d is None or link.sources.get("fitted"):
        return link
    return replace(link, bandwidth=link.bandwidth * d["efficiency"], latency_s=d["latency_s"],
                   sources={**link.sources, "fitted": "yes",
                            "bandwidth": f"datasheet x {d['efficiency']:.3f}: {d['sources']['efficiency']}",
                            "latency_s": d["sources"]["latency_s"]})
