"""Scheduler and cache configuration: frozen, grouped by concern, no I/O.

Each scheduler and cache option is declared here once, with its default, choices and help text.
The engine's options (engine_args.EngineArgs) and the simulator's (sim/deployment.py's RoleConfig and
Deployment) declare their copy with `knob(name)`, which returns this declaration, so an option has
one default and one help text wherever it is set (tests/test_knobs.py holds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from phaselab.errors import ConfigError

POLICIES = ("chunked", "prefill-first")
CHUNKED_BUDGET_DEFAULT = 2048  # max_num_batched_tokens of policy chunked when none is given
BUDGET_DEFAULT_TEXT = f"default {CHUNKED_BUDGET_DEFAULT} for chunked, max_model_len for prefill-first"
# the fixed chunk budgets a search (simulate search, plan) or a comparison (compare) tries unless told:
# the default and a quarter of it, where stalls shorten and the prompt's K/V is re-read per chunk
BUDGETS_TRIED = (CHUNKED_BUDGET_DEFAULT // 4, CHUNKED_BUDGET_DEFAULT)
BUDGETS_TRIED_TEXT = ",".join(map(str, BUDGETS_TRIED))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int = field(default=0, metadata={"help": "KV blocks in the pool (set from --kv-cache-memory)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the cached KV blocks of identical prompt beginnings (full blocks, chained hashes)"})

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size={self.block_size} must be >= 1")
        if self.num_blocks < 0:
            raise ConfigError(f"num_blocks={self.num_blocks} must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = field(default="chunked", metadata={
        "choices": POLICIES, "help": "chunked (decode-first, prefill chunks fill the budget) | prefill-first"})
    max_num_batched_tokens: int = field(default=CHUNKED_BUDGET_DEFAULT, metadata={
        "help": "token budget of one iteration (prefill + decode tokens)", "unset": BUDGET_DEFAULT_TEXT})
    # 256 as vLLM's default; the engine and the simulated GPUs had declared 128 and 256 apart
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once (per engine)"})
    max_model_len: int = field(default=8192, metadata={
        "help": "most tokens (prompt + output) per request", "unset": "default: the model's context, capped by the KV cache"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "cap on one request's prefill chunk per iteration (0 = none)"})
    max_num_partial_prefills: int = field(default=1, metadata={
        "help": "most requests left mid-prefill at the end of an iteration (chunked)"})
    slo_tbt_ms: float = field(default=0.0, metadata={
        "help": "time-between-tokens target (ms; 0 = off): with policy 'chunked' each iteration's prefill "
                "budget is the largest whose predicted time, given its decodes, stays under it (docs/slo.md)"})
    slo_ttft_ms: float = field(default=0.0, metadata={
        "help": "time-to-first-token target (ms; 0 = off): orders the prefills, shortest prompt first until a "
                "request has waited half of it, then first come first served (docs/slo.md), and is reported as "
                "attainment (diagnose)"})
    slo_margin: float = field(default=0.1, metadata={
        "help": "fraction of the TBT target kept free beyond the measured prediction error: the budget aims at "
                "T x (1 - margin) with the fit scaled by a recent quantile of measured / predicted (docs/slo.md)"})
    slo_min_chunk: int = field(default=32, metadata={
        "help": "smallest prefill chunk the adaptive budget chooses while prefill is waiting, even when the "
                "target cannot be met (that iteration is then marked infeasible)"})

    @classmethod
    def resolve(cls, *, policy: str = "chunked", max_model_len: int = 8192, max_num_batched_tokens: int | None = None,
                **options: Any) -> SchedulerConfig:
        """The config with the budget's default decided (the one place it is): a given budget as is;
        none (or 0) -> CHUNKED_BUDGET_DEFAULT for chunked, max_model_len for prefill-first (which
        prefills each prompt whole); slo_min_chunk capped at that budget. `options` are the other fields."""
        budget = max_num_batched_tokens or (CHUNKED_BUDGET_DEFAULT if policy == "chunked" else max_model_len)
        if "slo_min_chunk" in options:  # the adaptive budget's floor never above its ceiling
            options["slo_min_chunk"] = min(options["slo_min_chunk"], budget)
        return cls(policy=policy, max_num_batched_tokens=budget, max_model_len=max_model_len, **options)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0 (0 disables it)")
        if self.max_num_partial_prefills < 1:
            raise ConfigError("max_num_partial_prefills must be >= 1")
        if self.slo_tbt_ms < 0 or self.slo_ttft_ms < 0:
            raise ConfigError("slo_tbt_ms and slo_ttft_ms must be >= 0 (0 turns the target off)")
        if self.slo_tbt_ms > 0 and self.policy != "chunked":
            raise ConfigError(
                f"slo_tbt_ms={self.slo_tbt_ms} adapts the chunk budget, which needs policy 'chunked' "
                f"(got {self.policy!r}); use --policy chunked or drop --slo-tbt-ms")
        if not 0 <= self.slo_margin < 1:
            raise ConfigError(f"slo_margin={self.slo_margin} must be in [0, 1): the fraction of the TBT target "
                              "kept free for prediction error (e.g. 0.1)")
        if self.slo_min_chunk < 1 or (self.adaptive and self.slo_min_chunk > self.max_num_batched_tokens):
            raise ConfigError(
                f"slo_min_chunk={self.slo_min_chunk} must be in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}]; lower --slo-min-chunk or raise --max-num-batched-tokens")
        if self.policy == "prefill-first" and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"policy 'prefill-first' prefills each prompt whole, so max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                "raise the budget, lower max_model_len, or use policy 'chunked'"
            )

    @property
    def adaptive(self) -> bool:
        """The prefill budget follows the TBT target (core/adaptive_budget.py) instead of staying fixed."""
        return self.slo_tbt_ms > 0


# the options a front passes on to SchedulerConfig.resolve: every field but max_model_len, which is
# resolved apart (from the model's context and the cache's capacity)
SCHEDULER_OPTIONS = tuple(f.name for f in dataclasses.fields(SchedulerConfig) if f.name != "max_model_len")


def knob(name: str, *, unset: bool = False) -> Any:
    """The dataclass field of option `name` as SchedulerConfig or CacheConfig declares it: its default,
    choices and help. `unset`: default None, the value decided later (the help says how: the budget by
    SchedulerConfig.resolve, max_model_len from the model and the cache)."""
    declared = {f.name: f for cls in (SchedulerConfig, CacheConfig) for f in dataclasses.fields(cls)}
    if name not in declared:
        raise KeyError(f"{name!r} is not a SchedulerConfig or CacheConfig option")
    meta = dict(declared[name].metadata)
    if not unset:
        return field(default=declared[name].default, metadata=meta)
    if "unset" not in meta:
        raise ValueError(f"{name} has no documented meaning when unset; give it a default")
    meta["help"] = f"{meta['help']} ({meta.pop('unset')})"
    meta["shown_default"] = False  # the help says what None means
    return field(default=None, metadata=meta)


def scheduler_options(obj: Any) -> dict[str, Any]:
    """{option: value} of SCHEDULER_OPTIONS read off anything declaring them with knob (EngineArgs,
    RoleConfig): what SchedulerConfig.resolve takes besides max_model_len."""
    return {name: getattr(obj, name) for name in SCHEDULER_OPTIONS}
