"""Engine configuration: frozen dataclasses grouped by concern, with help text and no I/O.

`EngineArgs` is what users pass (strings like "2GiB", "auto", None = defaults); the engine
resolves it against the loaded model into the concrete `CacheConfig` and `SchedulerConfig`
of `phaselab.core.config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from phaselab import envs
from phaselab.core.config import knob
from phaselab.core.routing import POLICIES as ROUTING
from phaselab.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16")
WEIGHTS = ("auto", "quantized", "dequantized")
MODES = ("colocated", "disagg")
KV_TRANSPORTS = ("ray-object-store", "ray-actor")
ROUTING_POLICIES = tuple(ROUTING)  # core.routing's policy names

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; an int passes through."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read a memory size from {value!r}; write e.g. '2GiB', '512MiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = field(default=None, metadata={"help": "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct Q4_1 GGUF)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer.json or HF directory overriding the model's tokenizer"})
    dtype: str = field(default="auto", metadata={"choices": DTYPES, "help": "auto | float32 | bfloat16 (auto: measured at start-up on decode's linear layers at 1 row and at 32 rows, ties to bf16; cached per CPU)"})
    weights: str = field(default="auto", metadata={"choices": WEIGHTS, "help": f"auto | quantized | dequantized: how linear weights are held. quantized: a GGUF's Q4_0/Q4_1/Q8_0 blocks as stored (K-quants re-quantized to Q8_0), read by the native kernel; dequantized: widened to the dtype at load, torch matmuls; auto: measured at start-up, and may keep a dense copy beside the blocks for batched rows when its GEMM measures faster (env {envs.LINEAR.name}=q|bf16|fp32|torch forces a path, {envs.BATCHED.name}=tile|resident the batched weight, {envs.NATIVE_ROWS.name}=N the row count up to which the kernel runs, {envs.PREFETCH_BYTES.name}=N how far ahead it prefetches Q4_1X rows)"})
    kv_cache_memory: str | int = field(default="2GiB", metadata={"help": "memory for the paged KV cache, allocated once at start"})
    block_size: int = knob("block_size")
    max_model_len: int | None = knob("max_model_len", unset=True)
    policy: str = knob("policy")
    max_num_batched_tokens: int | None = knob("max_num_batched_tokens", unset=True)
    max_num_seqs: int = knob("max_num_seqs")
    long_prefill_token_threshold: int = knob("long_prefill_token_threshold")
    max_num_partial_prefills: int = knob("max_num_partial_prefills")
    slo_tbt_ms: float = knob("slo_tbt_ms")
    slo_ttft_ms: float = knob("slo_ttft_ms")
    slo_margin: float = knob("slo_margin")
    slo_min_chunk: int = knob("slo_min_chunk")
    slo_cost_file: str | None = field(default=None, metadata={"help": "JSON of the adaptive budget's cost coefficients to start from (default: a short warm-up at start)"})
    enable_prefix_caching: bool = knob("enable_prefix_caching")
    seed: int = field(default=0, metadata={"help": "seed of unseeded requests' random draws"})
    num_threads: int | None = field(default=None, metadata={"help": "torch intra-op threads (default: all cores)"})
    measure_ceilings: bool = field(default=False, metadata={"help": f"record this host's GEMM rate and read bandwidth in the run directory (measured once per CPU, threads, dtype and model, a few seconds, and cached: ~/.cache/phaselab/ceilings, {envs.CEILINGS_DIR.name} moves it); `phaselab simulate calibrate` bounds its fit by them and `phaselab diagnose` prints its floors against them"})
    # -- deployment (docs/disaggregation.md) --
    mode: str = field(default="colocated", metadata={"choices": MODES, "help": "colocated (one engine) | disagg (prefill and decode worker pools on Ray)"})
    prefill_workers: int = field(default=1, metadata={"help": "disagg: prefill workers (Ray actors)"})
    decode_workers: int = field(default=1, metadata={"help": "disagg: decode workers (Ray actors)"})
    prefill_threads: int | None = field(default=None, metadata={"help": "disagg: torch threads per prefill worker (default: cores / workers, at least 1)"})
    decode_threads: int | None = field(default=None, metadata={"help": "disagg: torch threads per decode worker (default: cores / workers, at least 1)"})
    ray_address: str | None = field(default=None, metadata={"help": "disagg: join this Ray cluster (default: start Ray locally on demand)"})
    kv_transport: str = field(default="ray-object-store", metadata={"choices": KV_TRANSPORTS, "help": "disagg: how KV blocks travel: ray-object-store (copied into Ray's object store when the prefill parks) | ray-actor (the decode worker pulls them from the prefill actor)"})
    routing_policy: str = field(default="least-outstanding", metadata={"choices": ROUTING_POLICIES, "help": "disagg: worker choice per request: least-outstanding | round-robin"})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"unknown weights option {self.weights!r}; choose one of {', '.join(WEIGHTS)}")
        parse_bytes(self.kv_cache_memory)
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ConfigError("disagg needs at least one prefill worker and one decode worker")


# GOMP_SPINCOUNT of a process whose engine has the cores to itself: pause loops an OpenMP thread
# spins after a parallel region before it sleeps (cli.py's docstring; benchmarks/wait_policy.py)
SPIN_COUNT = "20000"
