"""Modeled cost of one iteration: bytes it must move and FLOPs it must compute.

MODELED, not measured: pure arithmetic over the model config and the plan, the "count first"
floor of DESIGN.md section 7 (measured time / floor says how far a step is from the hardware).
Formulas (T = tokens computed this iteration, L = layers, h = hidden, b = dtype bytes;
docs/metrics.md has the same with a worked example):

    weight_bytes   = b x (P - E + T x h)   untied embeddings (E = vocab x h: the lookup reads T rows)
                   = b x P                 tied (the LM head reads the whole table anyway)
    kv_write_bytes = T x kv_bytes_per_token
    kv_read_bytes  = kv_bytes_per_token x sum over entries of
                        start + 1   one-token entry (decode): its whole context, incl. the K/V it wrote
                        start       multi-token chunk: the prefix before it (its own K/V stay on chip)
    matmul_flops   = 2 x T x L x linear_macs_per_layer + 2 x sampled_rows x h x vocab
    attention_flops = L x 4 x num_heads x head_dim x sum over entries of keys attended,
                        keys(n tokens at start s) = n x s + n(n+1)/2  (causal; n = 1: s + 1)

P = ModelConfig.num_parameters() (norm weights and biases included); every weight is counted
once per iteration, the LM head included even in an iteration that samples no row.
"""

from __future__ import annotations

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
from phaselab.core.timing import ModeledCost
from phaselab.model.config import ModelConfig


def linear_macs_per_token_per_layer(config: ModelConfig) -> int:
    """Multiply-accumulates of one token through one layer's projections (q, k, v, o, gate, up, down)."""
    h = config.hidden_size
    qkv = h * (config.q_size + 2 * config.kv_size)
    o = config.q_size * h
    mlp = 3 * h * config.intermediate_size
    return qkv + o + mlp


def keys_attended(num_tokens: int, start_position: int) -> int:
    """Keys summed over the entry's queries under a causal mask: query j (0-based) at position
    start + j sees start + j + 1 keys."""
    n, s = num_tokens, start_position
    return n * s + n * (n + 1) // 2


def kv_tokens_read(entry: ScheduledRequest) -> int:
    """Cached tokens whose K/V this entry reads from memory."""
    if entry.num_tokens == 1:
        # a decode step (or a one-token chunk) attends through the cache, its own new K/V included
        return entry.start_position + 1
    # a multi-token chunk attends to its own tokens from the freshly computed K/V
    return entry.start_position


def weight_bytes(config: ModelConfig, num_tokens: int, dtype_bytes: int) -> int:
    params = config.num_parameters()
    if not config.tie_word_embeddings:
        # the untied embedding table is only gathered: T rows, not the table
        params += num_tokens * config.hidden_size - config.vocab_size * config.hidden_size
    return params * dtype_bytes


def modeled_cost(config: ModelConfig, plan: SchedulerOutput, dtype_bytes: int) -> ModeledCost:
    """The modeled bytes and FLOPs of executing `plan` once (see the module docstring)."""
    entries = plan.scheduled
    if not entries:
        return ModeledCost()  # nothing runs: no forward pass reads the weights
    num_tokens = sum(e.num_tokens for e in entries)
    num_sampled = sum(1 for e in entries if e.sample)
    kv_per_token = config.kv_bytes_per_token(dtype_bytes)
    layers = config.num_hidden_layers
    return ModeledCost(
        weight_bytes=weight_bytes(config, num_tokens, dtype_bytes),
        kv_read_bytes=kv_per_token * sum(kv_tokens_read(e) for e in entries),
        kv_write_bytes=kv_per_token * num_tokens,
        matmul_flops=2 * num_tokens * layers * linear_macs_per_token_per_layer(config)
        + 2 * num_sampled * config.hidden_size * config.vocab_size,
        attention_flops=layers * 4 * config.num_attention_heads * config.head_dim
        * sum(keys_attended(e.num_tokens, e.start_position) for e in entries),
    )
