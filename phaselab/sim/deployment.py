"""What is simulated: a model on a kind of device, as colocated replicas or disaggregated pools.

    colocated:  num_replicas x [engine of tp GPUs: prefill + decode, one scheduler]
    disagg:     num_prefill x [prefill engine, tp_p GPUs] ──KV over transfer_link──▶
                num_decode x [decode engine, tp_d GPUs]

Frozen, grouped by concern, no I/O. Each worker gets its own `core` Scheduler built from its
RoleConfig with SchedulerConfig.resolve, as the engine builds one from EngineArgs (the budget's
default is decided there only), and a KV cache sized from device memory the way a
GPU engine sizes it: utilization x memory - weights - an activation reserve, per GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from phaselab.engine_args import MODES, ROUTING_POLICIES
from phaselab.core.config import CHUNKED_BUDGET_DEFAULT, CacheConfig, SchedulerConfig, knob, scheduler_options
from phaselab.errors import ConfigError
from phaselab.cost.formulas import StoredWeights
from phaselab.cost.catalog import LINKS, GiB, HardwareSpec, LinkSpec, get_link
from phaselab.cost.pricing import CostParams, default_params
from phaselab.modelinfo.model_config import ModelConfig

TRANSFER_MODES = ("after-prefill", "layer-by-layer")
FIRST_TOKEN_FROM = ("prefill", "decode")
# the tensor-parallel degrees a search tries unless told (those that divide the model's heads and fit)
TPS_TRIED = (1, 2, 4, 8)
TPS_TRIED_TEXT = ",".join(map(str, TPS_TRIED))


@dataclass(frozen=True)
class RoleConfig:
    """One pool's engines: parallelism and scheduler options (EngineArgs' names)."""

    tp: int = field(default=1, metadata={"help": "tensor-parallel GPUs per engine"})
    policy: str = knob("policy")
    max_num_batched_tokens: int | None = knob("max_num_batched_tokens", unset=True)
    max_num_seqs: int = knob("max_num_seqs")
    long_prefill_token_threshold: int = knob("long_prefill_token_threshold")
    max_num_partial_prefills: int = knob("max_num_partial_prefills")
    num_blocks: int | None = field(default=None, metadata={"help": "KV blocks per engine (None: from memory)"})
    slo_tbt_ms: float = knob("slo_tbt_ms")
    slo_ttft_ms: float = knob("slo_ttft_ms")
    slo_margin: float = knob("slo_margin")
    slo_min_chunk: int = knob("slo_min_chunk")


@dataclass(frozen=True)
class Deployment:
    model: ModelConfig
    hardware: HardwareSpec
    mode: str = field(default="colocated", metadata={"choices": MODES, "help": "colocated replicas or disaggregated pools"})
    num_replicas: int = field(default=1, metadata={"flag": "--replicas", "help": "colocated engines"})
    num_prefill: int = field(default=1, metadata={"flag": "--prefill-workers", "help": "disagg: prefill engines"})
    num_decode: int = field(default=1, metadata={"flag": "--decode-workers", "help": "disagg: decode engines"})
    colocated: RoleConfig = RoleConfig()
    prefill: RoleConfig = RoleConfig()
    decode: RoleConfig = RoleConfig()
    dtype_bytes: int = 2
    block_size: int = knob("block_size")
    enable_prefix_caching: bool = knob("enable_prefix_caching")
    max_model_len: int | None = knob("max_model_len", unset=True)
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of each GPU's memory used"})
    activation_reserve_bytes: int = 2 * GiB  # per GPU: activations, CUDA graphs, workspace
    tp_link: str | None = field(default=None, metadata={
        "help": f"tensor-parallel link: {', '.join(LINKS)}, or a link JSON file (None: the hardware's)"})
    # a LinkSpec: one measured on a real run (replay_inputs of a disaggregated run dir)
    transfer_link: str | LinkSpec | None = field(default=None, metadata={
        "help": "disagg KV transfer link, a name or a link JSON file (None: the TP link)"})
    transfer_mode: str = field(default="after-prefill", metadata={"choices": TRANSFER_MODES, "help": "disagg KV transfer"})
    # who sends the first token: the prefill side as soon as it is sampled (phaselab's router), or
    # the decode side once the KV has arrived (a proxy that waits for the decode instance)
    first_token_from: str = field(default="prefill", metadata={
        "choices": FIRST_TOKEN_FROM, "help": "disagg: the prefill side streams the first token (phaselab's router), "
                                             "or the decode side once the KV arrived"})
    routing_policy: str = field(default="least-outstanding", metadata={
        "choices": ROUTING_POLICIES, "help": "disagg: worker choice per request"})
    params: CostParams | None = None  # default: the hardware's defaults
    # the weights as a real engine keeps them (quantized blocks: fewer bytes per pass than parameters x
    # dtype_bytes); None: parameters x dtype_bytes. A replay or prediction of a CPU run takes it from
    # the run's config.json (cost/formulas.py StoredWeights.from_linear)
    stored_weights: StoredWeights | None = None
    delivery_s: float = 0.0  # token sampled -> sent

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ConfigError(f"unknown transfer mode {self.transfer_mode!r}; "
                              f"choose one of {', '.join(TRANSFER_MODES)}")
        if self.first_token_from not in FIRST_TOKEN_FROM:
            raise ConfigError(f"first_token_from must be one of {', '.join(FIRST_TOKEN_FROM)}")
        if min(self.num_replicas, self.num_prefill, self.num_decode) < 1:
            raise ConfigError("every pool needs at least one engine")
        if self.dtype_bytes not in (1, 2, 4):
            raise ConfigError(f"dtype_bytes={self.dtype_bytes}: use 1, 2 or 4")

    # -- derived -------------------------------------------------------------------------------------
    def roles(self) -> list[tuple[str, int, RoleConfig]]:
        """(role, number of engines, config) of every pool."""
        if self.mode == "colocated":
            return [("colocated", self.num_replicas, self.colocated)]
        return [("prefill", self.num_prefill, self.prefill), ("decode", self.num_decode, self.decode)]

    @property
    def num_gpus(self) -> int:
        return sum(n * rc.tp for _, n, rc in self.roles())

    @property
    def cost_params(self) -> CostParams:
        return self.params or default_params(self.hardware)

    def tp_link_spec(self) -> LinkSpec:
        return get_link(self.tp_link or self.hardware.tp_link)

    def transfer_link_spec(self) -> LinkSpec:
        """The KV transfer's link at its fitted point-to-point efficiency and latency where a shipped
        device fit measured it (NVLink 3/4 from Vidur's send_recv tables), else its datasheet figures."""
        from phaselab.cost.profile_fit import effective_link

        if isinstance(self.transfer_link, LinkSpec):  # measured: used as it is
            return self.transfer_link
        return effective_link(get_link(self.transfer_link or self.tp_link or self.hardware.tp_link))

    def num_blocks(self, rc: RoleConfig) -> int:
        """KV blocks of one engine: what its GPUs' memory holds after the weights."""
        if rc.num_blocks is not None:
            return rc.num_blocks
        hw, m = self.hardware, self.model
        per_gpu = hw.memory_bytes * self.gpu_memory_utilization - m.weight_bytes(self.dtype_bytes) / rc.tp \
            - self.activation_reserve_bytes
        block_bytes_gpu = self.block_size * m.kv_bytes_per_token_per_gpu(self.dtype_bytes, rc.tp)
        n = int(per_gpu // block_bytes_gpu)
        if n < 1:
            raise ConfigError(
                f"{m.name} ({m.weight_bytes(self.dtype_bytes) / 1e9:.0f} GB of weights) does not fit on tp={rc.tp} "
                f"x {hw.name} ({hw.memory_bytes / 1e9:.0f} GB at {self.gpu_memory_utilization:.0%}); raise tp")
        return n

    def resolved_max_model_len(self) -> int:
        caps = [self.num_blocks(rc) * self.block_size for _, _, rc in self.roles()]
        limit = min([self.model.max_position_embeddings, *caps])
        if self.max_model_len is not None:
            if self.max_model_len > limit:
                raise ConfigError(f"max_model_len={self.max_model_len} exceeds what every engine holds "
                                  f"({limit} tokens)")
            return self.max_model_len
        return limit

    def scheduler_config(self, rc: RoleConfig) -> SchedulerConfig:
        max_model_len = self.resolved_max_model_len()
        return SchedulerConfig.resolve(max_model_len=max_model_len, **scheduler_options(rc))

    def cache_config(self, rc: RoleConfig) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_blocks(rc), self.enable_prefix_caching)

    def describe(self) -> str:
        hw = self.hardware.name
        if self.mode == "colocated":
            rc = self.colocated
            return f"{self.num_replicas} x colocated ({_policy_text(rc)}, TP{rc.tp}) on {hw}: {self.num_gpus} GPUs"
        return (f"disagg {self.num_prefill}P (TP{self.prefill.tp}, {_policy_text(self.prefill)}) : {self.num_decode}D "
                f"(TP{self.decode.tp}) on {hw}, KV over {self.transfer_link_spec().name} ({self.transfer_mode}): "
                f"{self.num_gpus} GPUs")

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("model", "hardware", "params")}
        d["model"] = self.model.name
        d["hardware"] = self.hardware.name
        d["num_gpus"] = self.num_gpus
        d["tp_link"] = self.tp_link_spec().name
        d["transfer_link"] = self.transfer_link_spec().name if self.mode == "disagg" else None
        d["max_model_len"] = self.resolved_max_model_len()
        d["num_blocks"] = {role: self.num_blocks(rc) for role, _, rc in self.roles()}
        d["describe"] = self.describe()
        return d


def _policy_text(rc: RoleConfig) -> str:
    """The scheduling of one pool in words: policy, budget (fixed or adaptive), seats when not the default."""
    if rc.slo_tbt_ms > 0:
        text = f"adaptive budget <= {rc.max_num_batched_tokens or CHUNKED_BUDGET_DEFAULT} for TBT {rc.slo_tbt_ms:g} ms"
    elif rc.policy == "chunked" and rc.max_num_batched_tokens:
        text = f"chunked {rc.max_num_batched_tokens}"
    else:
        text = rc.policy
    if rc.max_num_seqs != RoleConfig.max_num_seqs:
        text += f", max_num_seqs {rc.max_num_seqs}"
    return text
