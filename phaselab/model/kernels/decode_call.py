"""A decode-only step's decoder layers, or its whole forward, in one native call (decode_layers.c).

The Python side of decode_layers.c: the ctypes structures the model fills once after load
(`DecodeLayer` per layer, `DecodeEnds` for the embedding, RoPE tables, final norm and LM head), the
two entry points and the per-kind timer benchmarks/step_profile.py reads. The package re-exports
them (`kernels.decode_forward`, ...), and callers go through the package: tests spy on them there.
This module imports only the library (library.py), never the package that re-exports it.
"""

from __future__ import annotations

import ctypes

import torch

from phaselab import envs
from phaselab.model.kernels.library import require as _require


class DecodeLayer(ctypes.Structure):
    """One decoder layer's weights for `decode_layers` (decode_layers.c's dl_layer): qkv, o, gate_up
    and down as qlinear reads them, and the two RMSNorm weights."""

    _fields_ = [("fmt", ctypes.c_int32 * 4), ("w", ctypes.c_void_p * 4), ("n", ctypes.c_int64 * 4),
                ("k", ctypes.c_int64 * 4), ("bias", ctypes.c_void_p * 4), ("norm_in", ctypes.c_void_p),
                ("norm_post", ctypes.c_void_p)]


def decode_layers(
    layers: ctypes.Array,  # DecodeLayer per decoder layer (the tensors they point to kept alive by the caller)
    emb: torch.Tensor,  # (B, hidden) the embedding: the residual stream, updated in place
    cos: torch.Tensor,  # (B, D) in emb's dtype
    sin: torch.Tensor,
    kv_caches: torch.Tensor,  # (layers, 2, num_blocks, BS, KVH, D) in emb's dtype, contiguous
    slot_mapping: torch.Tensor,  # (B,) int64
    block_tables: torch.Tensor,  # (B, max_blocks) int64
    seq_lens: torch.Tensor,  # (B,) int64
    num_heads: int,
    scale: float,
    eps: float,
) -> torch.Tensor:
    """Every decoder layer of a decode-only batch in one call (decode_layers.c): the last layer's MLP
    output (B, hidden); `emb` leaves as the residual stream. Bit-identical to the Python layer loop
    on its native path (tests/test_decode_layers.py); shapes are the caller's to get right."""
    lib = _require("decode_layers")
    out = torch.empty_like(emb)
    rc = lib.decode_layers(
        ctypes.addressof(layers), len(layers), emb.shape[0], int(emb.dtype == torch.bfloat16), None, emb.data_ptr(),
        out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        *_cache_args(kv_caches, slot_mapping, block_tables, seq_lens, num_heads, scale, eps))
    if rc != 0:
        raise RuntimeError(f"decode_layers failed (code {rc}: 1 = a shape or weight format the kernels refuse, "
                           f"2 = out of memory); {envs.DECODE_LAYERS.name}=0 runs the layers one call at a time")
    return out


def _cache_args(kv_caches: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, num_heads: int, scale: float, eps: float) -> tuple:
    """decode_layers.c's trailing arguments, shared by its two entry points: the cache (its first
    layer's K, the byte strides to the next layer's and to V), the slots, block tables and lengths,
    the head counts and sizes, the attention scale and the norm eps."""
    _, _, _, BS, KVH, D = kv_caches.shape
    el = kv_caches.element_size()
    return (kv_caches.data_ptr(), kv_caches.stride(0) * el, kv_caches.stride(1) * el, slot_mapping.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), num_heads, KVH, D, BS, scale, eps)


class DecodeEnds(ctypes.Structure):
    """The model's two ends around the layers for `decode_forward` (decode_layers.c's df_ends): the
    embedding rows as stored, the RoPE tables, the final norm's weight and the LM head."""

    _fields_ = [("emb_fmt", ctypes.c_int32), ("emb", ctypes.c_void_p), ("vocab_in", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("max_pos", ctypes.c_int64),
                ("norm", ctypes.c_void_p), ("head_fmt", ctypes.c_int32), ("head", ctypes.c_void_p),
                ("vocab", ctypes.c_int64)]


def decode_forward(
    layers: ctypes.Array,  # DecodeLayer per decoder layer
    ends: DecodeEnds,  # the tensors it points to kept alive by the caller
    input_ids: torch.Tensor,  # (B,) int64
    positions: torch.Tensor,  # (B,) int64
    kv_caches: torch.Tensor,  # (layers, 2, num_blocks, BS, KVH, D) in the activation dtype, contiguous
    slot_mapping: torch.Tensor,  # (B,) int64
    block_tables: torch.Tensor,  # (B, max_blocks) int64
    seq_lens: torch.Tensor,  # (B,) int64
    num_heads: int,
    scale: float,
    eps: float,
    bf16: bool,
) -> torch.Tensor:
    """A decode-only batch's whole forward in one call (decode_layers.c): the embedding lookup, the
    RoPE rows, every decoder layer, the final norm and the LM head; float32 logits (B, vocab).
    Bit-identical to the model's forward with `decode_layers` and its Python ends
    (tests/test_decode_layers.py); shapes are the caller's to get right."""
    lib = _require("decode_forward")
    B = input_ids.shape[0]
    logits = torch.empty((B, ends.vocab), dtype=torch.float32)
    rc = lib.decode_forward(
        ctypes.addressof(layers), len(layers), ctypes.addressof(ends), B, int(bf16), input_ids.data_ptr(),
        positions.data_ptr(), logits.data_ptr(),
        *_cache_args(kv_caches, slot_mapping, block_tables, seq_lens, num_heads, scale, eps))
    if rc != 0:
        raise RuntimeError(f"decode_forward failed (code {rc}: 1 = a shape, weight format, token id or position "
                           f"the kernels refuse, 2 = out of memory); {envs.DECODE_LAYERS.name}=0 runs the layers one "
                           "call at a time")
    return logits


# decode_layers.c's profile kinds, in its order (embed and head: decode_forward's ends)
DECODE_LAYERS_KINDS = ("qkv", "o", "gate_up", "down", "attention", "norm", "silu_mul", "embed", "head")


def decode_layers_profile(on: bool) -> dict[str, float]:
    """Start (zeroing) or stop timing decode_layers' kernel calls; returns the seconds per kind
    summed since the last start (wall time of each call, on the calling thread)."""
    lib = _require("decode_layers")
    ns = (ctypes.c_int64 * len(DECODE_LAYERS_KINDS))()
    lib.decode_layers_profile(int(on), ns)
    return {k: v / 1e9 for k, v in zip(DECODE_LAYERS_KINDS, ns)}


# the kinds of a decode step's split as the records name it (core/timing.py StepSplit)
STEP_SPLIT_KINDS = {"attention": ("attention",), "linear": ("qkv", "o", "gate_up", "down", "head"),
                    "elementwise": ("norm", "silu_mul", "embed")}


def take_step_split() -> dict[str, int] | None:
    """The native decode call's time since the last take, in ns per STEP_SPLIT_KINDS kind, and the
    timers zeroed and left running; None when no native decode call ran since (the timers read 0).
    The engine's runner takes it after every forward (engine/runner.py): one read per step."""
    lib = _require("decode_layers")
    ns = (ctypes.c_int64 * len(DECODE_LAYERS_KINDS))()
    lib.decode_layers_profile(1, ns)
    by_kind = dict(zip(DECODE_LAYERS_KINDS, ns))
    if not any(by_kind.values()):
        return None
    return {kind: int(sum(by_kind[k] for k in parts)) for kind, parts in STEP_SPLIT_KINDS.items()}

