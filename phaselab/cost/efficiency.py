"""Bounded efficiency curves of the cost model: what fraction of a device's peak an operator reaches,
as a small monotone function of the shape that matters. Every curve is in (0, e_max] with
0 < e_max <= 1, so no term is ever predicted faster than the datasheet (or measured) ceiling.

    dense GEMM (T tokens)               e(T)    = e_max x T / (T + T_half)
    attention of a prefill chunk        e(q, k) = e_att x q / (q + q_half) x k / (k + k_half)
        (q query rows of the chunk, k keys it attends: its prefix + itself)
    attention of a decode               compute: the same curve with q = heads / kv_heads (the query
                                        heads of one KV head are one tile: GQA packing); its K/V read
                                        e_kv(k) = e_kv x k / (k + k_kv_half)
    collectives / KV transfer           time = latency + bytes / (link bandwidth x e_link)

    operator time = max(FLOPs / (peak x e_compute(shape)), bytes / (bandwidth x e_memory(shape)))

Why these shapes:
- GEMM: a GEMM of T rows fills T / tile of the tensor cores' row tiles and amortises the weight read
  over T rows; the rational curve is the standard one-parameter saturating fit (Vidur fits a
  random forest to the same profiles; one half-saturation point is enough to bound it and is fitted
  from them, see phaselab/cost/profile_fit.py).
- Attention (no profile in the Vidur copy, so it is derived, not fitted): FlashAttention-2 tiles the
  queries in blocks of 128 rows and streams K/V in blocks of 64-128 keys (Dao, "FlashAttention-2",
  2023, section 3.3); a chunk of q < 128 query rows leaves most of its tile idle and a short key range
  is dominated by the tile's prologue and epilogue. q_half = 64 and k_half = 128 (k: the mean keys a
  query attends) put a causal prefill of 512 tokens at 0.59 e_att, 2k at 0.86 and 16k at 0.98: with
  e_att = 0.73 on A100, 43%, 63% and 72% of peak, the range of the paper's forward-pass figures
  ("50-73% of the theoretical maximum FLOPs/s on A100", causal short sequences below it). On H100
  FlashAttention-2 reaches about 35% of peak (Shah et al., "FlashAttention-3", 2024, abstract); the
  systems validated here used FA2 or older kernels, so e_att = 0.35 there. These are documented
  assumptions, marked as such in the sources.
- Decode K/V read: a paged decode kernel streams each sequence's K/V; a short context cannot keep
  enough loads in flight (vLLM's paged attention: one thread block per head and sequence), so the
  bandwidth fraction rises with the context. k_kv_half = 128 tokens is assumed, not fitted.
"""

from __future__ import annotations

import math

# FlashAttention-style attention efficiency (module docstring): query rows and keys at half efficiency
ATTENTION_Q_HALF = 64.0
ATTENTION_K_HALF = 128.0
KV_CONTEXT_HALF = 128.0


def saturating(x: float, e_max: float, half: float) -> float:
    """e_max x x / (x + half): 0 at x = 0, e_max / 2 at x = half, -> e_max; in (0, e_max] for x > 0."""
    if half <= 0:
        return e_max
    return e_max * x / (x + half)


def gemm_efficiency(num_tokens: float, e_max: float, rows_half: float) -> float:
    return saturating(max(num_tokens, 1.0), e_max, rows_half)


def attention_efficiency(q_rows: float, keys: float, e_max: float, q_half: float = ATTENTION_Q_HALF,
                         k_half: float = ATTENTION_K_HALF) -> float:
    """Fraction of peak FLOP/s of one attention call of q_rows queries over `keys` keys each
    (for a causal chunk: the mean keys a query attends, prefix + half the chunk)."""
    return saturating(max(q_rows, 1.0), 1.0, q_half) * saturating(max(keys, 1.0), e_max, k_half)


def kv_read_efficiency(context: float, e_max: float, k_half: float = KV_CONTEXT_HALF) -> float:
    return saturating(max(context, 1.0), e_max, k_half)


def ring_allreduce_time(num_bytes: float, num_gpus: int, link_bandwidth: float, latency_s: float,
                        efficiency: float) -> float:
    """One ring all-reduce of num_bytes over num_gpus: each GPU sends and receives 2 (n-1)/n of the
    buffer (reduce-scatter + all-gather), at the link's bandwidth x efficiency, plus a fixed latency."""
    if num_gpus <= 1:
        return 0.0
    return latency_s + 2 * (num_gpus - 1) / num_gpus * num_bytes / (link_bandwidth * efficiency)


def check_efficiency(name: str, value: float) -> None:
    """Every efficiency is a fraction of a ceiling: in (0, 1]."""
    if not (0 < value <= 1) or math.isnan(value):
        raise ValueError(f"{name}={value} is not in (0, 1]: an efficiency is a fraction of the device's "
                         "peak; refit it (phaselab simulate fit / calibrate) or fix the parameter file")
