"""Modeled cost of one iteration: bytes it must move and FLOPs it must compute.

The one home of these formulas: the engine's and router's records (`modeled_cost`) and the
simulator's pricing (`phaselab.cost.pricing`, through `CostFormulas`) both count with them.

MODELED, not measured: pure arithmetic over the model config and the plan, the "count first"
floor of docs/design.md's "How performance is measured" (measured time / floor: how far from the hardware).
Formulas (T = tokens computed this iteration, L = layers, h = hidden, b = dtype bytes;
docs/metrics.md has the same with a worked example):

    weight_bytes   = b x (P - E + T x h)   untied embeddings (E = vocab x h: the lookup reads T rows)
                   = b x P                 tied (the LM head reads the whole table anyway)
                     (a learned position table, OPT, is gathered the same way: T rows, not the table)
                   = S + b x T x h x g     an engine that keeps its weights as stored (quantized blocks,
                                           StoredWeights): S = the bytes of every weight a pass reads as
                                           stored, g = the gathered tables; above `dense_above_rows`
                                           rows (a dense copy kept resident for the GEMM) the b x P line
    kv_write_bytes = T x kv_bytes_per_token
    kv_read_bytes  = kv_bytes_per_token x sum over entries of
                        start + 1   one-token entry (decode): its whole context, incl. the K/V it wrote
                        start       multi-token chunk: the prefix before it (its own K/V stay on chip)
    kv_repeat_read_bytes = kv_bytes_per_token x block_size x the re-reads, among those, of a block an
                     earlier entry of the plan reads too (a shared prefix: memory moves it once per
                     iteration, so a bandwidth floor counts kv_read_bytes - kv_repeat_read_bytes)
    matmul_flops   = 2 x T x L x linear_macs_per_layer + 2 x sampled_rows x h x vocab
    attention_flops = L x 4 x num_heads x head_dim x sum over entries of keys attended,
                        keys(n tokens at start s) = n x s + n(n+1)/2  (causal; n = 1: s + 1)

P = ModelConfig.num_parameters() (norm weights and biases included); every weight is counted
once per iteration, the LM head included even in an iteration that samples no row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phaselab.cost.shapes import Plan, PlanEntry
from phaselab.modelinfo.model_config import ModelConfig


@dataclass
class ModeledCost:
    """What one iteration must move and compute, from the model config and the plan alone.

    MODELED, not measured: weights read once per iteration, each decode reads its whole context's
    K/V, each prefill chunk reads the K/V of the prefix before it, every computed token writes its
    K/V; FLOPs are 2 x MACs of the linear layers (LM head for sampled rows only) plus attention
    (QK^T and PV over the keys each query attends). See docs/metrics.md for the formulas.
    """

    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    matmul_flops: int = 0
    attention_flops: int = 0
    # of kv_read_bytes: re-reads of a block an earlier entry of the same iteration read (a prefix
    # several requests share through the prefix cache); a cache serves them, memory moves them once
    kv_repeat_read_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops


def keys_attended(num_tokens: int, start_position: int) -> int:
    """Keys summed over the entry's queries under a causal mask: query j (0-based) at position
    start + j sees start + j + 1 keys."""
    n, s = num_tokens, start_position
    return n * s + n * (n + 1) // 2


@dataclass(frozen=True)
class PlanCounts:
    """The plan reduced to what its cost depends on (cheap to build per iteration)."""

    num_entries: int
    num_chunks: int  # entries computing more than one token (prefill chunks)
    num_tokens: int
    num_sampled: int
    kv_tokens_read: int  # cached tokens whose K/V are read
    keys_attended: int  # sum over queries of the keys each attends (causal)
    num_decodes: int = 0  # single-token entries
    decode_keys: int = 0  # of keys_attended and kv_tokens_read: the decodes' (each its context)
    chunks: tuple[tuple[int, int], ...] = ()  # (num_tokens, start_position) of each prefill chunk (its shape)
    kv_tokens_repeated: int = 0  # of kv_tokens_read: in blocks an earlier entry of the plan reads too


def plan_counts(plan: Plan) -> PlanCounts:
    num_tokens = num_sampled = kv_read = keys = chunks = decodes = decode_keys = 0
    shapes = []
    for e in plan.scheduled:
        n, s = len(e.token_ids), e.start_position
        num_tokens += n
        if e.sample:
            num_sampled += 1
        if n == 1:
            kv_read += s + 1  # a decode attends through the cache, its own new K/V included
            keys += s + 1
            decodes += 1
            decode_keys += s + 1
        else:
            chunks += 1
            kv_read += s  # a chunk reads the prefix before it; its own K/V stay on chip
            keys += keys_attended(n, s)
            shapes.append((n, s))
    return PlanCounts(len(plan.scheduled), chunks, num_tokens, num_sampled, kv_read, keys, decodes, decode_keys,
                      tuple(shapes), repeated_kv_tokens(plan))


def repeated_kv_tokens(plan: Plan) -> int:
    """Tokens of K/V the plan's entries read from a block an earlier entry reads too. A block is
    shared only through the prefix cache (or a fork), and a shared block is full and leads every
    table that holds it (its hash chains from the first block), so entries whose first blocks
    differ share nothing: only groups with a common first block are counted, block by block."""
    size = plan.block_size
    if size <= 0 or len(plan.scheduled) < 2:
        return 0
    groups: dict[int, list[PlanEntry]] = {}
    for e in plan.scheduled:
        if e.block_ids:
            groups.setdefault(e.block_ids[0], []).append(e)
    repeated = 0
    for group in groups.values():
        if len(group) < 2:
            continue
        seen: set[int] = set()
        for e in group:
            read = e.start_position + (1 if len(e.token_ids) == 1 else 0)  # as kv_tokens_read counts
            blocks = e.block_ids[:read // size]  # full blocks only: a partial one is its own
            before = len(seen)
            seen.update(blocks)
            repeated += (len(blocks) - (len(seen) - before)) * size
    return repeated


def elementwise_elements_per_token(config: ModelConfig, tp: int = 1) -> dict[str, int]:
    """Elements one token reads and writes in each elementwise kernel of one layer, on one GPU of a
    tensor-parallel group of tp (not part of ModeledCost: the simulator prices them as their own term,
    and its profile reader counts Vidur's per-kernel timings with them). Norms and the residual add
    work on the full hidden state (replicated under TP); RoPE on this GPU's q and k heads (KV heads
    replicated when fewer than tp), the MLP's activation on its shard. "add" is one of the layer's two."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    q = c.num_attention_heads * c.head_dim // tp
    kv = max(1, c.num_key_value_heads // tp) * c.head_dim
    return {"input_layernorm": 2 * h, "post_attention_layernorm": 2 * h,  # read x, write y
            "attn_rope": 2 * (q + kv),  # read and write q, k
            "mlp_act": (3 if c.mlp_matrices == 3 else 2) * i // tp,  # gated: read gate and up, write one
            "add": 3 * h}  # read two, write one


def elementwise_bytes_per_token_layer(config: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes one token moves through one layer's elementwise kernels on one GPU: two norms, RoPE, the
    activation and two residual adds (elementwise_elements_per_token), each read and written once."""
    e = elementwise_elements_per_token(config, tp)
    return (sum(e.values()) + e["add"]) * dtype_bytes


@dataclass(frozen=True)
class StoredWeights:
    """The weights as an engine keeps them, when not as parameters x dtype bytes: `read_bytes` is what
    one pass reads of them (every weight once, gathered tables excluded), `dense_above_rows` the row
    count above which the pass reads a dense copy in the engine dtype instead (None: the stored
    weights at every row count, e.g. widened per call into a cache-sized tile)."""

    read_bytes: int
    dense_above_rows: int | None = None

    @classmethod
    def from_linear(cls, linear: dict[str, Any] | None) -> StoredWeights | None:
        """From the engine's linear summary (config.json's `linear`); None for the torch path (dense
        weights in the engine dtype: the parameter count prices them) or a run that did not record it."""
        if not isinstance(linear, dict) or linear.get("path") in (None, "torch") or "weight_bytes" not in linear:
            return None
        resident = linear.get("batched") == "resident" and linear.get("resident_bytes")
        return cls(int(linear["weight_bytes"]) - int(linear.get("gathered_bytes") or 0),
                   int(linear["max_native_rows"]) if resident else None)


class CostFormulas:
    """The module docstring's formulas for one model and dtype, their per-model factors computed once
    (the simulator prices millions of iterations). `stored`: the engine's weights as stored, when it
    keeps them so (else parameters x dtype bytes)."""

    def __init__(self, config: ModelConfig, dtype_bytes: int, stored: StoredWeights | None = None) -> None:
        c = config
        self.config, self.dtype_bytes, self.stored = c, dtype_bytes, stored
        self.kv_bytes_per_token = c.kv_bytes_per_token(dtype_bytes)
        untied = 0 if c.tie_word_embeddings else 1
        # an untied embedding table (and a learned position table) is only gathered: T rows each
        self.gathered_params = (untied * c.vocab_size + c.learned_position_rows) * c.hidden_size
        self.gathered_rows = untied + (1 if c.learned_position_rows else 0)
        self.num_parameters = c.num_parameters()
        self.linear_flops_per_token = 2 * c.num_hidden_layers * c.linear_macs_per_token_per_layer()
        self.head_flops_per_row = 2 * c.hidden_size * c.vocab_size
        self.attention_flops_per_key = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim

    def weight_bytes(self, num_tokens: int) -> int:
        gathered = self.gathered_rows * num_tokens * self.config.hidden_size * self.dtype_bytes
        s = self.stored
        if s is not None and (s.dense_above_rows is None or num_tokens <= s.dense_above_rows):
            return s.read_bytes + gathered
        return (self.num_parameters - self.gathered_params) * self.dtype_bytes + gathered

    def of_counts(self, c: PlanCounts) -> ModeledCost:
        if c.num_entries == 0:
            return ModeledCost()  # nothing runs: no forward pass reads the weights
        return ModeledCost(
            weight_bytes=self.weight_bytes(c.num_tokens),
            kv_read_bytes=self.kv_bytes_per_token * c.kv_tokens_read,
            kv_write_bytes=self.kv_bytes_per_token * c.num_tokens,
            matmul_flops=self.linear_flops_per_token * c.num_tokens + self.head_flops_per_row * c.num_sampled,
            attention_flops=self.attention_flops_per_key * c.keys_attended,
            kv_repeat_read_bytes=self.kv_bytes_per_token * c.kv_tokens_repeated,
        )

    def of_plan(self, plan: Plan) -> ModeledCost:
        return self.of_counts(plan_counts(plan))


def modeled_cost(config: ModelConfig, plan: Plan, dtype_bytes: int,
                 stored: StoredWeights | None = None) -> ModeledCost:
    """The modeled bytes and FLOPs of executing `plan` once (see the module docstring)."""
    return CostFormulas(config, dtype_bytes, stored).of_plan(plan)
