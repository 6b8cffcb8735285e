"""Engine arguments + model config -> the configs the engine runs with. Pure: no torch, no I/O.

    EngineArgs ─┐
    ModelConfig ├─▶ resolve(...) ─▶ ResolvedConfig(cache, scheduler)  ─▶ LLMEngine builds the model
    dtype bytes ┘

Split from LLMEngine.__init__ so the sizing rules (KV blocks from the memory budget, the
context length capped by the cache and the model, the token budget) are testable without loading
a model, and so anything that plans an engine (the simulator, compare) can ask what one would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from phaselab.engine_args import EngineArgs, parse_bytes
from phaselab.core.config import CacheConfig, SchedulerConfig, scheduler_options
from phaselab.errors import ConfigError


class SizedModel(Protocol):
    """What sizing needs of a model config (phaselab.model.config.ModelConfig has it)."""

    @property
    def max_position_embeddings(self) -> int: ...

    def kv_bytes_per_token(self, dtype_bytes: int) -> int: ...


@dataclass(frozen=True)
class ResolvedConfig:
    cache: CacheConfig
    scheduler: SchedulerConfig
    block_bytes: int  # KV bytes of one block (all layers, K and V)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len


def resolve(args: EngineArgs, model_config: SizedModel, dtype_bytes: int) -> ResolvedConfig:
    """Size the KV cache and the scheduler; ConfigError (saying what to change) when they cannot fit."""
    block_bytes = model_config.kv_bytes_per_token(dtype_bytes) * args.block_size
    num_blocks = parse_bytes(args.kv_cache_memory) // block_bytes
    capacity = num_blocks * args.block_size
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_memory={args.kv_cache_memory} holds no KV block ({block_bytes} bytes each); raise it"
        )
    max_model_len = args.max_model_len or min(model_config.max_position_embeddings, capacity)
    if max_model_len > capacity:
        raise ConfigError(
            f"max_model_len={max_model_len} tokens does not fit the KV cache ({capacity} tokens in "
            f"{args.kv_cache_memory}); raise --kv-cache-memory to at least "
            f"{-(-max_model_len // args.block_size) * block_bytes / 2**20:.0f}MiB or lower --max-model-len"
        )
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's context "
            f"({model_config.max_position_embeddings} positions); lower --max-model-len"
        )
    scheduler = SchedulerConfig.resolve(max_model_len=max_model_len, **scheduler_options(args))
    return ResolvedConfig(CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching), scheduler,
                          block_bytes)
