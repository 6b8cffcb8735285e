"""Cost of one iteration, predicted from its plan: what the executor would have taken.

    plan ─▶ counts (per GPU of a tensor-parallel group of tp devices)
              linear layers   F_lin = 2 T L macs / tp (+ LM head on sampled rows)   B_w  = weights / tp
              attention       F_att = 4 L heads d sum(keys) / tp                     B_kv = KV read + written / tp
         ─▶ time = o_iter + L o_layer + n o_request + n_chunks o_chunk + T o_token
                 + max(F_lin / (peak x e(T)),  B_w  / (bandwidth x e_mem))       linear layers
                 + max(F_att,p / (peak x e_att),   B_kv,p / (bandwidth x e_kv))  attention of prefill chunks
                 + max(F_att,d / (peak x e_att_d), B_kv,d / (bandwidth x e_kv))  attention of decodes
                                                          (e_att_d: e_att unless set; e_kv: e_mem unless set)
                 + 2 L x all-reduce(T h b)   if tp > 1, all-reduce(x) = latency + 2 (tp-1)/tp x / link bandwidth
         with e(T) = e_max x T / (T + rows_half): GEMM efficiency grows with the rows of the batch

The issue's roofline `max(compute / (peak x efficiency(rows)), bytes / (bandwidth x efficiency))`
is applied per operator class and the two are summed: within each layer the projections and the
attention run one after the other, and in a mixed (chunked) batch the projections can be
compute-bound while the decodes' attention is bandwidth-bound. The counts (FLOPs, weight and KV
bytes) are `phaselab.obs.cost`'s formulas (docs/metrics.md), the same ones the engine's records use.

Every parameter carries its source (`CostParams.sources`): "default: ..." until a calibration
fits it ("fitted on run DIR ..."), see phaselab/sim/calibrate.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from phaselab.core.outputs import SchedulerOutput
from phaselab.core.timing import ModeledCost
from phaselab.errors import ConfigError
from phaselab.obs.cost import CostFormulas, PlanCounts, plan_counts
from phaselab.sim.catalog import HardwareSpec, LinkSpec
from phaselab.spec.config import ModelConfig

NS = 1_000_000_000


@dataclass(frozen=True)
class CostParams:
    """Efficiencies and overheads of one kind of device running one engine (see module docstring)."""

    compute_efficiency: float = field(default=0.7, metadata={
        "help": "e_max: fraction of peak FLOP/s a large GEMM reaches"})
    rows_half: float = field(default=32.0, metadata={"help": "rows (tokens) of a GEMM at which it reaches e_max / 2"})
    attention_efficiency: float = field(default=0.5, metadata={
        "help": "fraction of peak FLOP/s the attention of prefill chunks reaches"})
    decode_attention_efficiency: float | None = field(default=None, metadata={
        "help": "fraction of peak FLOP/s the decodes' attention reaches: another kernel, one query per request "
                "(None: attention_efficiency's)"})
    memory_efficiency: float = field(default=0.8, metadata={
        "help": "fraction of peak bandwidth a streaming read (the weights) reaches"})
    kv_memory_efficiency: float | None = field(default=None, metadata={
        "help": "fraction of peak bandwidth attention's K/V reads reach through the block tables "
                "(None: memory_efficiency's)"})
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
    allreduce_latency_s: float = field(default=8e-6, metadata={"help": "fixed time of one tensor-parallel all-reduce"})
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "attention_efficiency", "memory_efficiency"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("kv_memory_efficiency", "decode_attention_efficiency"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value} must be > 0 (or null)")
        for name in ("rows_half", "iteration_overhead_s", "layer_overhead_s", "request_overhead_s",
                     "chunk_overhead_s", "token_overhead_s", "allreduce_latency_s"):
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
        if name == "chunk_overhead_s" and self.chunk_overhead_s == 0:
            return "default: 0, a chunk costs what any scheduled request does (request_overhead_s), not fitted"
        return "default: a typical value for GPU serving engines, not fitted"

    def to_json(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}
        return {**values, "sources": {k: self.source(k) for k in values}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CostParams:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"hardware", "fit"}
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
                      sources={k: "default: placeholder for this CPU; run `phaselab simulate calibrate RUN_DIR`"
                               for k in ("compute_efficiency", "rows_half", "attention_efficiency",
                                         "decode_attention_efficiency", "memory_efficiency", "kv_memory_efficiency",
                                         "iteration_overhead_s",
                                         "layer_overhead_s", "request_overhead_s", "chunk_overhead_s",
                                         "token_overhead_s", "allreduce_latency_s")}),
}


def default_params(hardware: HardwareSpec) -> CostParams:
    return DEFAULT_PARAMS.get(hardware.name, CostParams())


@dataclass
class IterationCost:
    """The prediction for one plan: its duration split by cause, and the modeled counts (whole
    instance, all GPUs together, as in the run directory's `modeled_*` fields)."""

    duration_ns: int
    overhead_s: float = 0.0
    linear_s: float = 0.0
    attention_s: float = 0.0
    allreduce_s: float = 0.0
    linear_bound: str = ""  # "compute" | "memory"
    attention_bound: str = ""
    modeled: ModeledCost = field(default_factory=ModeledCost)


class RooflineCostModel:
    """Predicts an iteration's duration on one instance of `tp` devices (module docstring)."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, params: CostParams | None = None,
                 tp: int = 1, dtype_bytes: int = 2, tp_link: LinkSpec | None = None) -> None:
        if tp < 1:
            raise ConfigError(f"tensor parallelism tp={tp} must be >= 1")
        if tp > 1 and model.num_attention_heads % tp:
            raise ConfigError(f"{model.name}: {model.num_attention_heads} attention heads do not split over tp={tp} GPUs")
        self.model, self.hardware, self.tp, self.dtype_bytes = model, hardware, tp, dtype_bytes
        self.params = params or default_params(hardware)
        self.tp_link = tp_link
        m, p, b = model, self.params, dtype_bytes
        self.formulas = CostFormulas(m, b)  # the whole instance's modeled counts
        self._kv_per_token_gpu = m.kv_bytes_per_token_per_gpu(b, tp)
        self._attn_flops_per_key = self.formulas.attention_flops_per_key
        self._peak = hardware.peak_flops
        self._bw = hardware.mem_bandwidth * p.memory_efficiency
        self._bw_kv = hardware.mem_bandwidth * p.kv_efficiency
        self._fixed = p.iteration_overhead_s + m.num_hidden_layers * p.layer_overhead_s
        if tp > 1:
            if tp_link is None:
                raise ConfigError("tp > 1 needs the link of the tensor-parallel group")
            ring = 2 * (tp - 1) / tp / (tp_link.bandwidth)
            self._ar_fixed = 2 * m.num_hidden_layers * (p.allreduce_latency_s + tp_link.latency_s)
            self._ar_per_token = 2 * m.num_hidden_layers * ring * m.hidden_size * dtype_bytes
        else:
            self._ar_fixed = self._ar_per_token = 0.0

    def modeled_cost(self, c: PlanCounts) -> ModeledCost:
        """The whole instance's modeled bytes and FLOPs (phaselab.obs.cost's formulas)."""
        return self.formulas.of_counts(c)

    def predict(self, plan: SchedulerOutput) -> IterationCost:
        return self.predict_counts(plan_counts(plan))

    def predict_counts(self, c: PlanCounts) -> IterationCost:
        if c.num_entries == 0:
            return IterationCost(0)
        p, tp = self.params, self.tp
        modeled = self.modeled_cost(c)
        t = c.num_tokens
        eff = p.compute_efficiency * t / (t + p.rows_half)
        lin_compute = modeled.matmul_flops / tp / (self._peak * eff)
        lin_memory = modeled.weight_bytes / tp / self._bw
        # prefill chunks and decodes run different attention kernels, one after the other
        dk, nd = c.decode_keys, c.num_decodes
        att_c_p = self._attn_flops_per_key * (c.keys_attended - dk) / tp / (self._peak * p.attention_efficiency)
        att_m_p = self._kv_per_token_gpu * (c.kv_tokens_read - dk + t - nd) / self._bw_kv
        att_c_d = self._attn_flops_per_key * dk / tp / (self._peak * p.decode_attention)
        att_m_d = self._kv_per_token_gpu * (dk + nd) / self._bw_kv
        att_p, att_d = max(att_c_p, att_m_p), max(att_c_d, att_m_d)
        overhead = self._fixed + c.num_entries * p.request_overhead_s + c.num_chunks * p.chunk_overhead_s \
            + t * p.token_overhead_s
        allreduce = self._ar_fixed + self._ar_per_token * t if tp > 1 else 0.0
        linear, attention = max(lin_compute, lin_memory), att_p + att_d
        att_bound = (att_c_p >= att_m_p) if att_p >= att_d else (att_c_d >= att_m_d)  # of the larger part
        total = overhead + linear + attention + allreduce
        return IterationCost(
            duration_ns=max(1, round(total * NS)), overhead_s=overhead, linear_s=linear, attention_s=attention,
            allreduce_s=allreduce, linear_bound="compute" if lin_compute >= lin_memory else "memory",
            attention_bound="compute" if att_bound else "memory", modeled=modeled)

    def describe(self) -> dict[str, Any]:
        return {"model": self.model.name, "hardware": self.hardware.name, "tp": self.tp,
                "dtype_bytes": self.dtype_bytes, "tp_link": self.tp_link.name if self.tp_link else None,
                "params": self.params.to_json()}

