"""Fit the cost model's efficiencies and overheads to a real run's iteration log.

    iterations.jsonl: per iteration the plan's MODELED counts (FLOPs, weight / KV bytes, tokens,
                      requests, prefill chunks) and its MEASURED time
    model (cost.py):  t = o_iter + o_req n + o_chunk n_chunks
                        + max(F_lin / P x (a + c / T), W / B x m)          a = 1/e_max, c = rows_half/e_max
                        + max(F_att,p / P x a_att, KV_p / B x m_kv)        chunks' attention: a_att = 1/e_att
                        + max(F_att,d / P x a_att_d, KV_d / B x m_kv)      decodes': a_att_d = 1/e_att_d
                      m = 1/e_mem, m_kv = 1/e_kv; L x o_layer is constant within one model: folded into o_iter

With each max() resolved to one branch the model is linear in (o_iter, o_req, o_chunk, a, c, m,
a_att, a_att_d, m_kv) >= 0, so the fit alternates: assign each iteration's branches with the current
parameters, solve the non-negative least squares of the error weighted by 1/sqrt(measured time)
(between the relative error, which lets short decode steps count as much as long prefills but
biases the total low, and the absolute error, which long prefills dominate), reassign, until the
assignment is stable. It starts from the given parameters and from every all-one-branch
assignment and from a grid of splits of the iterations by the ratio of each max()'s two branches (a
run whose decodes are bound by their K/V reads is never found from a start where attention is
compute-bound everywhere), and keeps the best fit seen. An efficiency no iteration was bound by
is pinned at its starting value and the fit repeated, so that the fitted overheads account for
what that term adds where the simulator will apply it. P and B are the hardware entry's peak
FLOP/s and bandwidth (for a CPU run: the ceilings measured on the run's host, phaselab/engine/ceilings.py,
recorded in the run; host.py); the fitted efficiencies are relative to them, at most 1.

The measured time of an iteration is its cycle, as the simulator's clock advances it: start to
the next iteration's start while the engine stayed busy (the engine loop's own work between two
iterations included), start to end before an idle period.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from phaselab.cost.catalog import HardwareSpec
from phaselab.cost.formulas import CostFormulas, keys_attended
from phaselab.cost.pricing import CostParams, default_params
from phaselab.cost.shapes import RecordedIteration
from phaselab.modelinfo.model_config import ModelConfig

COLUMNS = ("o_iter", "o_req", "o_chunk", "a_lin", "c_lin", "m_mem", "a_att", "a_att_d", "m_kv", "o_wide")
EFFICIENCY_COLUMNS = ("a_lin", "m_mem", "a_att", "a_att_d", "m_kv")  # 1 / an efficiency
PARAM_OF = {"a_lin": "compute_efficiency", "m_mem": "memory_efficiency", "a_att": "attention_efficiency",
            "a_att_d": "decode_attention_efficiency", "m_kv": "kv_memory_efficiency"}


@dataclass
class Fit:
    params: CostParams
    coefficients: dict[str, float]
    num_iterations: int
    rel_errors: list[float] = field(repr=False, default_factory=list)  # (predicted - measured) / measured
    measured_total_s: float = 0.0
    predicted_total_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. the ceilings were measured on another CPU (host.py)
    spread: list[str] = field(default_factory=list)  # what the run's shapes cannot separate (spread_notes)
    # per note of `spread`, the coefficients it cannot tell apart where pinning either one at 0 is a
    # valid reading of the run (the decode batch: o_iter vs o_req); () where there is none
    unseparated: list[tuple[str, ...]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        errs = np.abs(np.asarray(self.rel_errors)) if self.rel_errors else np.zeros(1)
        signed = np.asarray(self.rel_errors) if self.rel_errors else np.zeros(1)
        return {
            "num_iterations": self.num_iterations,
            "relative_error_abs_mean": float(errs.mean()),
            "relative_error_abs_p50": float(np.percentile(errs, 50)),
            "relative_error_abs_p90": float(np.percentile(errs, 90)),
            "relative_error_abs_p99": float(np.percentile(errs, 99)),
            "relative_error_rms": float(np.sqrt((signed ** 2).mean())),
            "relative_error_mean_signed": float(signed.mean()),
            "measured_total_s": self.measured_total_s,
            "predicted_total_s": self.predicted_total_s,
            "total_time_error": (self.predicted_total_s - self.measured_total_s) / self.measured_total_s
            if self.measured_total_s else math.nan,
        }

    def to_json(self, hardware: HardwareSpec) -> dict[str, Any]:
        return {"hardware": hardware.name, **self.params.to_json(), "fit": {**self.summary(),
                                                                           "coefficients": self.coefficients,
                                                                           "notes": self.notes}}


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def iteration_cycles(iterations: Sequence[RecordedIteration]) -> list[int]:
    """Measured ns per iteration as the simulator's clock advances (module docstring), in the order
    of `iterations` sorted by start; each worker's cycle runs to its own next iteration (a
    disaggregated run interleaves its workers' iterations)."""
    iters = sorted(iterations, key=lambda r: r.start_ns)
    following: dict[int, RecordedIteration] = {}
    last: dict[str, int] = {}
    for k, rec in enumerate(iters):
        if rec.worker in last:
            following[last[rec.worker]] = rec
        last[rec.worker] = k
    cycles = []
    for k, rec in enumerate(iters):
        nxt = following.get(k)
        if rec.num_running + rec.num_waiting > 0 and nxt is not None:
            cycles.append(nxt.start_ns - rec.start_ns)
        else:
            cycles.append(rec.end_ns - rec.start_ns)
    return cycles


def _features(iterations: Sequence[RecordedIteration], model: ModelConfig, hw: HardwareSpec, dtype_bytes: int,
              wide_rows: int = 0) -> dict[str, np.ndarray]:
    """Per iteration: the raw quantities each column of the linear model multiplies (the attention
    of prefill chunks and of decodes apart, from the recorded chunks: they run different kernels)."""
    formulas = CostFormulas(model, dtype_bytes)
    kv_per_token, flops_per_key = formulas.kv_bytes_per_token, formulas.attention_flops_per_key
    keys = ("n", "nc", "T", "lin_c", "lin_m", "att_c", "att_m", "att_c_d", "att_m_d")
    f: dict[str, list[float]] = {k: [] for k in keys}
    for rec in iterations:
        m = rec.modeled
        f["n"].append(len(rec.chunks))
        f["T"].append(rec.num_prefill_tokens + rec.num_decode_tokens)
        f["lin_c"].append(m.matmul_flops / hw.peak_flops)
        f["lin_m"].append(m.weight_bytes / hw.mem_bandwidth)
        nc = keys_p = keys_d = kv_p = kv_d = 0
        for c in rec.chunks:
            n, ctx = c.num_tokens, c.context_len
            if n == 1:  # a decode reads its context (its own new K/V included) and writes one token
                keys_d += ctx
                kv_d += ctx + 1
            else:  # a chunk attends causally to the prefix and itself, reads the prefix, writes n tokens
                nc += 1
                s = ctx - n
                keys_p += keys_attended(n, s)
                kv_p += s + n
        f["nc"].append(nc)
        f["att_c"].append(flops_per_key * keys_p / hw.peak_flops)
        f["att_m"].append(kv_per_token * kv_p / hw.mem_bandwidth)
        f["att_c_d"].append(flops_per_key * keys_d / hw.peak_flops)
        f["att_m_d"].append(kv_per_token * kv_d / hw.mem_bandwidth)
    out = {k: np.asarray(v, dtype=float) for k, v in f.items()}
    out["wide"] = (out["T"] > wide_rows).astype(float) if wide_rows else np.zeros_like(out["T"])
    return out


Branches = tuple[np.ndarray, np.ndarray, np.ndarray]  # per iteration: linear, chunk attention, decode attention
#                                                       compute-bound (True) or memory-bound


def _parts(x: np.ndarray, f: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    o_iter, o_req, o_chunk, a, c, m, a_att, a_att_d, m_kv, o_wide = x
    return (f["lin_c"] * (a + c / np.maximum(f["T"], 1)), f["lin_m"] * m, f["att_c"] * a_att, f["att_m"] * m_kv,
            f["att_c_d"] * a_att_d, f["att_m_d"] * m_kv)


def _predict(x: np.ndarray, f: dict[str, np.ndarray]) -> tuple[np.ndarray, Branches]:
    lin_c, lin_m, att_c, att_m, dec_c, dec_m = _parts(x, f)
    pred = x[0] + x[1] * f["n"] + x[2] * f["nc"] + x[9] * f["wide"] + np.maximum(lin_c, lin_m) \
        + np.maximum(att_c, att_m) + np.maximum(dec_c, dec_m)
    return pred, (lin_c >= lin_m, att_c >= att_m, dec_c >= dec_m)


def _design(f: dict[str, np.ndarray], b: Branches) -> np.ndarray:
    lin, att, dec = b
    T = np.maximum(f["T"], 1)
    return np.column_stack([
        np.ones_like(T), f["n"], f["nc"],
        np.where(lin, f["lin_c"], 0.0), np.where(lin, f["lin_c"] / T, 0.0), np.where(lin, 0.0, f["lin_m"]),
        np.where(att, f["att_c"], 0.0), np.where(dec, f["att_c_d"], 0.0),
        np.where(att, 0.0, f["att_m"]) + np.where(dec, 0.0, f["att_m_d"]), f["wide"],
    ])


def _to_x(p: CostParams, num_layers: int) -> np.ndarray:
    return np.array([p.iteration_overhead_s + num_layers * p.layer_overhead_s, p.request_overhead_s,
                     p.chunk_overhead_s, 1 / p.compute_efficiency, p.rows_half / p.compute_efficiency,
                     1 / p.memory_efficiency, 1 / p.attention_efficiency, 1 / p.decode_attention,
                     1 / p.kv_efficiency, p.wide_overhead_s if p.wide_rows else 0.0])


def _unbind(x: np.ndarray, f: dict[str, np.ndarray], fallback: np.ndarray, pinned: dict[str, float]
            ) -> tuple[np.ndarray, set[str]]:
    """Coefficients the fit left at 0 (their branch bound no iteration) set to the largest value at
    which their branch still binds none (module docstring)."""
    x = x.copy()
    i = {name: COLUMNS.index(name) for name in COLUMNS}
    lin_c, lin_m, att_c, att_m, dec_c, dec_m = _parts(x, f)
    # (the other branch, the feature the coefficient multiplies) of each max() the coefficient is in
    pairs = {"a_lin": [(lin_m, f["lin_c"])], "m_mem": [(lin_c, f["lin_m"])],
             "a_att": [(att_m, f["att_c"])], "a_att_d": [(dec_m, f["att_c_d"])],
             "m_kv": [(att_c, f["att_m"]), (dec_c, f["att_m_d"])]}
    unbound = set()
    for name in EFFICIENCY_COLUMNS:
        if name in pinned or x[i[name]] > 0:
            continue
        unbound.add(name)
        limits = [other[feature > 0] / feature[feature > 0] for other, feature in pairs[name]]
        limit = np.concatenate(limits) if limits else np.zeros(0)
        x[i[name]] = float(limit.min()) if limit.size and (limit > 0).all() else fallback[i[name]]
    return x, unbound


def _alternate(f: dict[str, np.ndarray], y: np.ndarray, scale: np.ndarray, pinned: dict[str, float],
               starts: list[Branches], max_rounds: int) -> tuple[float, np.ndarray]:
    """Best (weighted SSE, coefficients) over alternations from each start (branch assignments)."""
    free = [i for i, name in enumerate(COLUMNS) if name not in pinned]
    fixed_x = np.array([pinned.get(name, 0.0) for name in COLUMNS])
    best: tuple[float, np.ndarray] | None = None
    seen: set[bytes] = set()  # assignments already solved, from any start
    for branches in starts:
        for _ in range(max_rounds):
            key = b"".join(b.tobytes() for b in branches)
            if key in seen:
                break
            seen.add(key)
            a = _design(f, branches) / scale[:, None]
            x = fixed_x.copy()
            x[free] = nnls(a[:, free], y / scale - a @ fixed_x)
            pred, branches = _predict(x, f)
            sse = float((((pred - y) / scale) ** 2).sum())  # the prediction's own branches, not the design's
            if best is None or sse < best[0]:
                best = (sse, x)
    assert best is not None
    return best


SPAN = 1.5  # a shape must vary by this ratio within a run for the fit to tell its per-unit from its fixed cost


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def spread_notes(f: dict[str, np.ndarray], wide_rows: int) -> list[tuple[str, tuple[str, ...]]]:
    """What the run's iterations cannot separate (their shapes did not vary): said, not guessed at.
    A prediction that moves a run outside its shapes (more rows per iteration, bigger decode batches)
    extrapolates there. Each note comes with the coefficients whose split it leaves open, where
    either one at 0 fits the run as well (analysis/predict.py predicts with both)."""
    notes: list[tuple[str, tuple[str, ...]]] = []
    prefill = f["nc"] > 0
    if prefill.sum() >= 2 and f["T"][prefill].max() < SPAN * f["T"][prefill].min():
        lo, hi = int(f["T"][prefill].min()), int(f["T"][prefill].max())
        fixed = f" (the weights' widening above {wide_rows} rows)" if wide_rows else ""
        notes.append((f"every iteration with a prefill chunk had {_span(lo, hi)} rows: the fit cannot separate a "
                      f"prefill's per-row cost from its fixed cost{fixed}, so a change that puts more or fewer rows in "
                      "an iteration is an extrapolation", ()))
    decode = (f["nc"] == 0) & (f["n"] > 0)
    if decode.sum() >= 2 and f["n"][decode].max() < SPAN * f["n"][decode].min():
        lo, hi = int(f["n"][decode].min()), int(f["n"][decode].max())
        notes.append((f"every decode-only iteration ran {_span(lo, hi)} sequences: the fit cannot separate a "
                      "sequence's cost from the step's, so a change of the decode batch is an extrapolation",
                      ("o_iter", "o_req")))
    return notes


def fit_params(iterations: Sequence[RecordedIteration], measured_ns: list[int], model: ModelConfig, hw: HardwareSpec,
               dtype_bytes: int, label: str, start: CostParams | None = None, max_rounds: int = 30,
               weighting: str = "sqrt", fixed: dict[str, float] | None = None, wide_rows: int = 0) -> Fit:
    """Fit CostParams to (iteration, measured time) pairs (module docstring).

    weighting: "sqrt" (default: each iteration's error / sqrt of its time), "relative" (/ its time:
    short decode steps count as much as long prefills, but the fit then underestimates the total:
    -21% on a run of this CPU) or "absolute" (seconds: long iterations dominate). `fixed` pins
    coefficients of COLUMNS (e.g. {"m_mem": 1.0}: the measured bandwidth is what streaming reaches).
    wide_rows: the engine's max_native_rows (0: none); iterations of more rows get one o_wide each, the
    weights widened for torch's GEMM once per iteration whatever its chunks. A run whose wide
    iterations all carry the same number of prefill chunks cannot tell o_chunk from o_wide: o_chunk is
    then pinned at 0 (the widening is the per-iteration cost this engine has; a chunk's own attention
    call is in the attention term), so two chunks batched in one iteration are not priced twice.
    """
    assert len(iterations) == len(measured_ns) and iterations, "nothing to fit"
    assert weighting in ("relative", "sqrt", "absolute"), weighting
    pinned = dict(fixed or {})
    f = _features(iterations, model, hw, dtype_bytes, wide_rows)
    chunk_pinned = False
    if wide_rows and "o_chunk" not in pinned:
        wide = f["wide"] > 0
        if wide.any() and len(set(f["nc"][wide].tolist())) <= 1 and not (f["nc"][~wide] > 0).any():
            pinned["o_chunk"], chunk_pinned = 0.0, True
    y = np.asarray(measured_ns, dtype=float) / 1e9
    scale = {"relative": y, "sqrt": np.sqrt(y * y.mean()), "absolute": np.full_like(y, y.mean())}[weighting]
    start = start or default_params(hw)
    x0 = _to_x(start, model.num_hidden_layers)
    for name, value in pinned.items():
        x0[COLUMNS.index(name)] = value
    _, b0 = _predict(x0, f)
    # branch assignments to start from: the starting parameters', and a grid of the ratio between
    # each max()'s two branches (each start splits the iterations at another ratio)
    ratios = [np.inf, *(10.0 ** np.arange(-2.0, 2.01, 0.5)), 0.0]
    with np.errstate(invalid="ignore"):  # inf x 0: that branch is empty there either way
        starts = [b0] + [(f["lin_c"] * r1 >= f["lin_m"], f["att_c"] * r2 >= f["att_m"],
                          f["att_c_d"] * r3 >= f["att_m_d"]) for r1 in ratios for r2 in ratios for r3 in ratios]
    _, x = _alternate(f, y, scale, pinned, starts, max_rounds)
    # an efficiency no iteration was bound by (coefficient 0) is set to the largest coefficient (the
    # lowest efficiency) at which its branch still binds no iteration of the run: the simulator then
    # predicts every iteration of the run exactly as the fit did, and the term is an upper bound.
    # Where both branches of a max() were left at 0 (the fit gave that term no time at all), there is
    # no such value: the term keeps its starting efficiencies, pinned, and the fit is repeated.
    unbound: set[str] = set()
    capped: dict[str, float] = {}  # efficiency column -> the coefficient the fit wanted below 1 (efficiency > 1)
    for _ in range(2 * len(EFFICIENCY_COLUMNS) + 1):
        x_unbound, unbound = _unbind(x, f, x0, pinned)
        kept = {name: float(x0[COLUMNS.index(name)]) for name in unbound
                if x_unbound[COLUMNS.index(name)] == x0[COLUMNS.index(name)]}
        # bounds: an efficiency is a fraction of the hardware entry's measured ceiling, at most 1. A fit
        # that wants more (coefficient 1 / e < 1) is refitted with it pinned at 1, the others absorbing
        # the rest, so the simulator predicts what the bounded fit did.
        over = {name: float(x_unbound[COLUMNS.index(name)]) for name in EFFICIENCY_COLUMNS
                if name not in pinned and x_unbound[COLUMNS.index(name)] < 1.0 - 1e-6}
        if not kept and not over:
            x = x_unbound
            for name in EFFICIENCY_COLUMNS:  # rounding: an efficiency of 1 + 1e-7 is 1
                x[COLUMNS.index(name)] = max(x[COLUMNS.index(name)], 1.0)
            break
        capped |= over
        pinned |= kept | {name: 1.0 for name in over}
        restart = np.where([c in pinned for c in COLUMNS], [pinned.get(c, 0.0) for c in COLUMNS], x)
        _, x = _alternate(f, y, scale, pinned, [_predict(restart, f)[1]] + starts, max_rounds)
    unbound -= set(capped)
    kept_at_start = {name for name in pinned if name not in (fixed or {}) and name not in capped
                     and name in EFFICIENCY_COLUMNS}
    o_iter, o_req, o_chunk, a, c, m, a_att, a_att_d, m_kv, o_wide = (float(v) for v in x)
    note = f"fitted on run {label} ({len(y)} iterations)"

    def eff(column: str, inv: float) -> tuple[float, str]:
        if column in capped:
            return 1.0, (f"fitted on run {label}: capped at 1 (the unbounded fit wanted {1 / capped[column]:.3g} of "
                         f"{hw.name}'s measured ceiling); the other terms refitted with it there")
        if column in kept_at_start:
            return 1 / inv, (f"fitted on run {label}: the fit gave this term no time; kept at the starting "
                             f"{1 / inv:g} ({start.source(PARAM_OF[column])})")
        if column in unbound:
            return 1 / inv, (f"fitted on run {label}: bound no iteration; set to the lowest efficiency at which it "
                             "still binds none (its time there is an upper bound)")
        if column in (fixed or {}):
            return 1 / inv, f"pinned at {1 / inv:g} for the fit of run {label}"
        return 1 / inv, note

    e_max, s_e = eff("a_lin", a)
    e_mem, s_m = eff("m_mem", m)
    e_att, s_a = eff("a_att", a_att)
    e_att_d, s_ad = eff("a_att_d", a_att_d)
    e_kv, s_kv = eff("m_kv", m_kv)
    rows_half, s_r = c * e_max, (note if "a_lin" not in unbound else f"fitted on run {label}: 0, GEMM compute "
                                 "bound no iteration")
    params = CostParams(
        compute_efficiency=e_max, rows_half=rows_half, attention_efficiency=e_att,
        decode_attention_efficiency=e_att_d, memory_efficiency=e_mem,
        kv_memory_efficiency=e_kv, iteration_overhead_s=o_iter, layer_overhead_s=0.0, request_overhead_s=o_req,
        chunk_overhead_s=o_chunk, token_overhead_s=0.0, wide_rows=wide_rows, wide_overhead_s=o_wide,
        allreduce_latency_s=start.allreduce_latency_s,
        allreduce_efficiency=start.allreduce_efficiency,
        # the fit's own shape: one efficiency per class, no curve in q, k or context, no elementwise term
        attention_q_half=0.0, attention_k_half=0.0, kv_context_half=0.0, elementwise_efficiency=None,
        sources={**{k: f"fitted on run {label}: 0, one efficiency per operator class (no shape curve)"
                    for k in ("attention_q_half", "attention_k_half", "kv_context_half")},
                 "elementwise_efficiency": "not a term of its own: folded into the others by the fit",
                 "compute_efficiency": s_e, "rows_half": s_r, "memory_efficiency": s_m, "attention_efficiency": s_a,
                 "decode_attention_efficiency": s_ad,
                 "kv_memory_efficiency": s_kv,
                 "iteration_overhead_s": note + "; per-layer overheads folded in",
                 "layer_overhead_s": f"folded into iteration_overhead_s (one model in run {label})",
                 "request_overhead_s": note,
                 "chunk_overhead_s": (f"fitted on run {label}: pinned at 0, every wide iteration had the same "
                                      "number of prefill chunks (not separable from wide_overhead_s)")
                 if chunk_pinned else note,
                 "wide_rows": f"the run's linear.max_native_rows (config.json), run {label}" if wide_rows else
                 "no switch of GEMM path recorded in the run (torch path or an older run)",
                 "wide_overhead_s": note if wide_rows else "not fitted: no wide_rows",
                 "token_overhead_s": "not fitted: per-token time is the roofline's (it would absorb GEMM compute)",
                 "allreduce_latency_s": start.source("allreduce_latency_s")})
    # the error of what the simulator will predict with these parameters
    pred, _ = _predict(_to_x(params, model.num_hidden_layers), f)
    spread = spread_notes(f, wide_rows)
    return Fit(params, dict(zip(COLUMNS, (float(v) for v in x))), len(y), ((pred - y) / y).tolist(),
               float(y.sum()), float(pred.sum()), spread=[n for n, _ in spread],
               unseparated=[cols for _, cols in spread])


def predict_iterations(params: CostParams, iterations: Sequence[RecordedIteration], model: ModelConfig, hw: HardwareSpec,
                       dtype_bytes: int) -> np.ndarray:
    """Seconds the cost model predicts for each recorded iteration, from its modeled counts."""
    f = _features(iterations, model, hw, dtype_bytes, params.wide_rows)
    pred, _ = _predict(_to_x(params, model.num_hidden_layers), f)
    return pred


def run_model(config: dict[str, Any]) -> tuple[ModelConfig, int]:
    """The model and dtype bytes a run directory's config.json describes."""
    model = ModelConfig.from_dict(config["model"]["config"])
    model = replace(model, name=model.name or model.architecture, sources={"*": "the run's ModelConfig (config.json)"})
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(config.get("dtype")), 2)
    return model, dtype_bytes


def run_wide_rows(config: dict[str, Any]) -> int:
    """Rows above which the run's engine widened its weights for torch's GEMM (config.json's `linear`);
    0 when it did not record one or ran every layer through torch."""
    lin = config.get("linear") or {}
    if not isinstance(lin, dict) or lin.get("path") in (None, "torch"):
        return 0
    return int(lin.get("max_native_rows") or 0)


def write_params(fit: Fit, hw: HardwareSpec, out: str) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fit.to_json(hw), f, indent=2)
        f.write("\n")
