"""Cost of one iteration, predicted from its plan: what the executor would have taken.

    plan ─▶ counts (per GPU of a tensor-parallel group of tp devices)
              GEMMs           F_lin = 2 T L macs / tp (+ LM head on sampled rows)   B_w  = weights / tp
              elementwise     B_el  = L T x (norms, adds: full; RoPE, activation: / tp) bytes
              attention       F_att = 4 L heads d keys / tp per chunk c and for the decodes; B_kv = K/V read + written
         ─▶ time = o_iter + L o_layer + n o_request + n_chunks o_chunk + T o_token
                 + max(F_lin / (peak x e_gemm(T)),  B_w / (bandwidth x e_mem))              GEMMs
                 + B_el / (bandwidth x e_elem)                                              elementwise
                 + max(sum_c F_att,c / (peak x e_att(q_c, k_c)), B_kv,p / (bandwidth x e_kv))   prefill chunks
                 + max(F_att,d / (peak x e_att(g, k_d)), B_kv,d / (bandwidth x e_kv x e_ctx(k_d)))  decodes
                 + 2 L x (latency_ar + 2 (tp-1)/tp x T h b / (link bandwidth x e_ar))   if tp > 1
         every e in (0, 1], each curve monotone in its shape (phaselab/cost/efficiency.py):
         e_gemm(T) = e_max T / (T + T_half); e_att(q, k) = e_att q/(q + q_half) k/(k + k_half);
         e_ctx(k) = k / (k + k_ctx_half); g = heads / kv_heads (a decode's GQA query rows)

The roofline `max(compute / (peak x efficiency(shape)), bytes / (bandwidth x efficiency(shape)))` is
applied per operator class and the classes are summed: within each layer the projections and the
attention run one after the other, and in a mixed (chunked) batch the projections can be
compute-bound while the decodes' attention is bandwidth-bound. The counts (FLOPs, weight and KV
bytes) are `phaselab.cost.formulas`'s formulas (docs/metrics.md), the same ones the engine's records use.

Every parameter carries its source (`CostParams.sources`): the GPU defaults are fits of Vidur's
operator profiles (phaselab/cost/profile_fit.py; attention assumed, said so), this CPU's a calibration on a
run (phaselab/cost/record_fit.py), anything else "default: ...".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from phaselab.cost.catalog import HardwareSpec, LinkSpec
from phaselab.cost.efficiency import (ATTENTION_K_HALF, ATTENTION_Q_HALF, KV_CONTEXT_HALF, attention_efficiency,
                                      check_efficiency, gemm_efficiency, kv_read_efficiency)
from phaselab.cost.formulas import (CostFormulas, ModeledCost, PlanCounts, StoredWeights,
                                    elementwise_bytes_per_token_layer, keys_attended, plan_counts)
from phaselab.cost.shapes import Plan
from phaselab.errors import ConfigError
from phaselab.modelinfo.model_config import ModelConfig

NS = 1_000_000_000


def _check_efficiency(name: str, value: float) -> None:
    try:
        check_efficiency(name, value)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class CostParams:
    """Efficiencies and overheads of one kind of device running one engine (see module docstring)."""

    compute_efficiency: float = field(default=0.7, metadata={
        "help": "e_max in (0, 1]: fraction of peak FLOP/s a large GEMM reaches"})
    rows_half: float = field(default=32.0, metadata={"help": "rows (tokens) of a GEMM at which it reaches e_max / 2"})
    attention_efficiency: float = field(default=0.5, metadata={
        "help": "e_att in (0, 1]: fraction of peak FLOP/s the attention of long prefill chunks reaches"})
    decode_attention_efficiency: float | None = field(default=None, metadata={
        "help": "fraction of peak FLOP/s the decodes' attention reaches: another kernel, one query per request "
                "(None: attention_efficiency's)"})
    memory_efficiency: float = field(default=0.8, metadata={
        "help": "fraction of peak bandwidth a streaming read (the weights) reaches"})
    kv_memory_efficiency: float | None = field(default=None, metadata={
        "help": "fraction of peak bandwidth attention's K/V reads reach through the block tables "
                "(None: memory_efficiency's)"})
    attention_q_half: float = field(default=ATTENTION_Q_HALF, metadata={
        "help": "query rows of an attention call at which it reaches half its efficiency (0: no curve)"})
    attention_k_half: float = field(default=ATTENTION_K_HALF, metadata={
        "help": "mean keys per query of an attention call at which it reaches half its efficiency (0: no curve)"})
    kv_context_half: float = field(default=KV_CONTEXT_HALF, metadata={
        "help": "context (tokens) of a decode at which its K/V read reaches half its bandwidth fraction (0: no curve)"})
    elementwise_efficiency: float | None = field(default=None, metadata={
        "help": "fraction of peak bandwidth the norms, RoPE, activation and residual adds reach "
                "(None: not a term of its own; a calibration folds them into the others)"})
    iteration_overhead_s: float = field(default=1e-3, metadata={
        "help": "fixed time per iteration (schedule, launch, sync)"})
    layer_overhead_s: float = field(default=5e-6, metadata={
        "help": "fixed time per layer per iteration (kernel launches)"})
    request_overhead_s: float = field(default=5e-6, metadata={
        "help": "time per scheduled request (metadata, sampling)"})
    chunk_overhead_s: float = field(default=0.0, metadata={
        "help": "time per prefill chunk on top of request_overhead_s (each chunk's own attention call in every "
                "layer, where decodes share one batched call)"})
    token_overhead_s: float = field(default=0.0, metadata={"help": "time per computed token not in the roofline"})
    wide_rows: int = field(default=0, metadata={
        "help": "rows (tokens) above which an iteration pays wide_overhead_s (0: none). This CPU's engine runs up "
                "to max_native_rows rows on its quantized-native kernel and more on weights widened into a tile "
                "for torch's GEMM, once per iteration (config.json's linear.max_native_rows)"})
    wide_overhead_s: float = field(default=0.0, metadata={
        "help": "time an iteration of more than wide_rows rows adds once (widening the weights), whatever its "
                "number of chunks"})
    allreduce_latency_s: float = field(default=1.1e-5, metadata={
        "help": "fixed time of one tensor-parallel all-reduce (NCCL and link latency)"})
    allreduce_efficiency: float = field(default=1.0, metadata={
        "help": "fraction of the TP link's bandwidth a ring all-reduce reaches (bus bandwidth / link bandwidth)"})
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "attention_efficiency", "memory_efficiency", "allreduce_efficiency"):
            _check_efficiency(name, getattr(self, name))
        for name in ("kv_memory_efficiency", "decode_attention_efficiency", "elementwise_efficiency"):
            value = getattr(self, name)
            if value is not None:
                _check_efficiency(name, value)
        for name in ("rows_half", "attention_q_half", "attention_k_half", "kv_context_half", "iteration_overhead_s",
                     "layer_overhead_s", "request_overhead_s", "chunk_overhead_s", "token_overhead_s",
                     "allreduce_latency_s", "wide_rows", "wide_overhead_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")

    @property
    def decode_attention(self) -> float:
        return self.decode_attention_efficiency if self.decode_attention_efficiency is not None else \
            self.attention_efficiency

    @property
    def kv_efficiency(self) -> float:
        return self.kv_memory_efficiency if self.kv_memory_efficiency is not None else self.memory_efficiency

    def source(self, name: str) -> str:
        if name in self.sources:
            return self.sources[name]
        if name == "decode_attention_efficiency" and self.decode_attention_efficiency is None:
            return "default: attention_efficiency's value (one attention kernel for chunks and decodes), not fitted"
        if name == "kv_memory_efficiency" and self.kv_memory_efficiency is None:
            return "default: memory_efficiency's value (K/V read as fast as weights stream), not fitted"
        if name in ("attention_q_half", "attention_k_half", "attention_efficiency", "decode_attention_efficiency") \
                and self.attention_q_half == ATTENTION_Q_HALF:
            return ("assumed: FlashAttention-2-style tiles (128 query rows, 128-key blocks), see "
                    "phaselab/cost/efficiency.py; no attention profile in the Vidur data, not fitted")
        if name == "kv_context_half" and self.kv_context_half == KV_CONTEXT_HALF:
            return "assumed: a paged decode kernel needs ~100s of keys in flight per sequence; not fitted"
        if name == "elementwise_efficiency" and self.elementwise_efficiency is None:
            return "default: no term of its own (folded into the others)"
        if name in ("wide_rows", "wide_overhead_s") and not self.wide_rows:
            return "default: 0, no switch of GEMM path by rows (a GPU engine's GEMMs have none), not fitted"
        if name == "chunk_overhead_s" and self.chunk_overhead_s == 0:
            return "default: 0, a chunk costs what any scheduled request does (request_overhead_s), not fitted"
        return "default: a typical value for GPU serving engines, not fitted"

    def to_json(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        return {**values, "sources": {k: self.source(k) for k in values}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CostParams:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"hardware", "fit", "link"}
        if unknown:
            raise ConfigError(f"unknown cost parameter(s) {sorted(unknown)}; known: {sorted(known - {'sources'})}")
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str) -> CostParams:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


# Defaults per kind of device. GPUs: one set of typical figures (launch overheads of an engine with
# CUDA graphs, FlashAttention efficiency); this CPU: placeholders until `calibrate` fits them.
DEFAULT_PARAMS: dict[str, CostParams] = {
    "cpu": CostParams(compute_efficiency=1.0, rows_half=8.0, attention_efficiency=0.3,
                      decode_attention_efficiency=0.3, memory_efficiency=1.0,
                      kv_memory_efficiency=1.0, iteration_overhead_s=5e-3, layer_overhead_s=2e-4,
                      request_overhead_s=2e-4, chunk_overhead_s=0.0, token_overhead_s=0.0, allreduce_latency_s=0.0,
                      # flat curves: a calibration on a run fits one efficiency per operator class (linear in
                      # its inverse); the shape terms are GPU kernel facts (tiles), not this CPU's
                      attention_q_half=0.0, attention_k_half=0.0, kv_context_half=0.0,
                      sources={**{k: "default: placeholder for this CPU; run `phaselab simulate calibrate RUN_DIR`"
                                  for k in ("compute_efficiency", "rows_half", "attention_efficiency",
                                            "decode_attention_efficiency", "memory_efficiency",
                                            "kv_memory_efficiency", "iteration_overhead_s",
                                            "layer_overhead_s", "request_overhead_s", "chunk_overhead_s",
                                            "token_overhead_s", "allreduce_latency_s")},
                               **{k: "default: 0, no shape curve on this CPU (torch SDPA / the C decode kernel have "
                                     "no GPU tiles); calibrate fits one efficiency per class"
                                  for k in ("attention_q_half", "attention_k_half", "kv_context_half")}}),
}


def default_params(hardware: HardwareSpec) -> CostParams:
    """This CPU's placeholders; a GPU's fit shipped with the package (phaselab/cost/data/fits/, made by
    `phaselab simulate fit` from the Vidur operator profiles); else typical unfitted values."""
    if hardware.cost_params is not None:  # a device from a file that brings its own
        d = {k: v for k, v in hardware.cost_params.items() if k not in ("fit", "link", "hardware")}
        sources = {**{k: f"hardware file of {hardware.name}" for k in d}, **d.pop("sources", {})}
        return CostParams.from_json({**d, "sources": sources})
    if hardware.name in DEFAULT_PARAMS:
        return DEFAULT_PARAMS[hardware.name]
    from phaselab.cost.profile_fit import shipped_fit  # the fits import this module

    return shipped_fit(hardware.name) or CostParams()


@dataclass
class IterationCost:
    """The prediction for one plan: its duration split by cause, and the modeled counts (whole
    instance, all GPUs together, as in the run directory's `modeled_*` fields)."""

    duration_ns: int
    overhead_s: float = 0.0
    linear_s: float = 0.0
    attention_s: float = 0.0
    allreduce_s: float = 0.0
    elementwise_s: float = 0.0  # norms, RoPE, activation, residual adds (replicated parts not split by TP)
    linear_bound: str = ""  # "compute" | "memory"
    attention_bound: str = ""
    modeled: ModeledCost = field(default_factory=ModeledCost)


def prefill_attention_shape(shapes: tuple[tuple[int, int], ...], q_half: float, k_half: float) -> float:
    """sum over chunks of keys_c / shape_factor(q_c, mean keys_c): the keys, each weighted by 1 / how far
    below its best its call runs (efficiency.attention_efficiency without e_att). Equals the keys when
    the curve is flat, so the attention time stays linear in 1 / e_att (what calibrate fits)."""
    total = 0.0
    for n, s in shapes:
        keys = keys_attended(n, s)
        total += keys / attention_efficiency(n, keys / n, 1.0, q_half, k_half)
    return total


class RooflineCostModel:
    """Predicts an iteration's duration on one instance of `tp` devices (module docstring)."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, params: CostParams | None = None,
                 tp: int = 1, dtype_bytes: int = 2, tp_link: LinkSpec | None = None,
                 stored: StoredWeights | None = None) -> None:
        if tp < 1:
            raise ConfigError(f"tensor parallelism tp={tp} must be >= 1")
        if tp > 1 and model.num_attention_heads % tp:
            raise ConfigError(f"{model.name}: {model.num_attention_heads} attention heads do not split over "
                              f"tp={tp} GPUs; pick a tp that divides them")
        self.model, self.hardware, self.tp, self.dtype_bytes = model, hardware, tp, dtype_bytes
        self.params = params or default_params(hardware)
        self.tp_link = tp_link
        m, p, b = model, self.params, dtype_bytes
        self.formulas = CostFormulas(m, b, stored)  # the whole instance's modeled counts
        self._kv_per_token_gpu = m.kv_bytes_per_token_per_gpu(b, tp)
        self._attn_flops_per_key = self.formulas.attention_flops_per_key
        self._peak = hardware.peak_flops
        self._bw = hardware.mem_bandwidth * p.memory_efficiency
        self._bw_kv = hardware.mem_bandwidth * p.kv_efficiency
        self._fixed = p.iteration_overhead_s + m.num_hidden_layers * p.layer_overhead_s
        # norms, RoPE, activation, residual adds: read and written once per token per layer, per GPU
        self._elementwise_bytes_per_token = m.num_hidden_layers * elementwise_bytes_per_token_layer(m, b, tp) \
            if p.elementwise_efficiency else 0
        self._bw_elementwise = hardware.mem_bandwidth * (p.elementwise_efficiency or 1.0)
        # a decode's queries of one KV head form one tile (GQA packing): its attention call's query rows
        self._decode_q_rows = m.num_attention_heads // m.num_key_value_heads
        if tp > 1:
            if tp_link is None:
                raise ConfigError("tp > 1 needs the link of the tensor-parallel group")
            # two all-reduces per layer (after attention's output projection and after the MLP), of the
            # T x hidden activations, ring-priced from the TP link (efficiency.ring_allreduce_time)
            ring = 2 * (tp - 1) / tp / (tp_link.bandwidth * p.allreduce_efficiency)
            self._ar_fixed = 2 * m.num_hidden_layers * p.allreduce_latency_s
            self._ar_per_token = 2 * m.num_hidden_layers * ring * m.hidden_size * dtype_bytes
        else:
            self._ar_fixed = self._ar_per_token = 0.0

    def modeled_cost(self, c: PlanCounts) -> ModeledCost:
        """The whole instance's modeled bytes and FLOPs (phaselab.cost.formulas's formulas)."""
        return self.formulas.of_counts(c)

    def predict(self, plan: Plan) -> IterationCost:
        return self.predict_counts(plan_counts(plan))

    def predict_counts(self, c: PlanCounts) -> IterationCost:
        if c.num_entries == 0:
            return IterationCost(0)
        p, tp = self.params, self.tp
        modeled = self.modeled_cost(c)
        t = c.num_tokens
        # dense GEMMs: efficiency by the rows (tokens) of the batch
        eff = gemm_efficiency(t, p.compute_efficiency, p.rows_half)
        lin_compute = modeled.matmul_flops / tp / (self._peak * eff)
        lin_memory = modeled.weight_bytes / tp / self._bw
        # prefill chunks and decodes run different attention kernels, one after the other; the chunks of
        # one iteration share one (varlen) call, each chunk's keys priced at its own shape's efficiency
        # and reading its whole prefix's K/V again
        dk, nd = c.decode_keys, c.num_decodes
        weighted_keys = prefill_attention_shape(c.chunks, p.attention_q_half, p.attention_k_half) \
            if c.chunks else float(c.keys_attended - dk)
        att_c_p = self._attn_flops_per_key * weighted_keys / tp / (self._peak * p.attention_efficiency)
        att_m_p = self._kv_per_token_gpu * (c.kv_tokens_read - dk + t - nd) / self._bw_kv
        if nd:
            mean_ctx = dk / nd
            e_att_d = attention_efficiency(self._decode_q_rows, mean_ctx, p.decode_attention, p.attention_q_half,
                                           p.attention_k_half)
            e_kv_d = kv_read_efficiency(mean_ctx, 1.0, p.kv_context_half)
            att_c_d = self._attn_flops_per_key * dk / tp / (self._peak * e_att_d)
            att_m_d = self._kv_per_token_gpu * (dk + nd) / (self._bw_kv * e_kv_d)
        else:
            att_c_d = att_m_d = 0.0
        att_p, att_d = max(att_c_p, att_m_p), max(att_c_d, att_m_d)
        elementwise = self._elementwise_bytes_per_token * t / self._bw_elementwise
        overhead = self._fixed + c.num_entries * p.request_overhead_s + c.num_chunks * p.chunk_overhead_s \
            + t * p.token_overhead_s + (p.wide_overhead_s if p.wide_rows and t > p.wide_rows else 0.0)
        allreduce = self._ar_fixed + self._ar_per_token * t if tp > 1 else 0.0
        linear, attention = max(lin_compute, lin_memory), att_p + att_d
        att_bound = (att_c_p >= att_m_p) if att_p >= att_d else (att_c_d >= att_m_d)  # of the larger part
        total = overhead + linear + elementwise + attention + allreduce
        return IterationCost(
            duration_ns=max(1, round(total * NS)), overhead_s=overhead, linear_s=linear, attention_s=attention,
            allreduce_s=allreduce, elementwise_s=elementwise,
            linear_bound="compute" if lin_compute >= lin_memory else "memory",
            attention_bound="compute" if att_bound else "memory", modeled=modeled)

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.name, "hardware": self.hardware.name, "tp": self.tp,
                "dtype_bytes": self.dtype_bytes, "tp_link": self.tp_link.name if self.tp_link else None,
                "params": self.params.to_json()}

