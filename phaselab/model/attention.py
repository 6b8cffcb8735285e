"""Paged attention over a flat batch of tokens.

The cache of one layer is `(2, num_blocks, block_size, kv_heads, head_dim)`; a request's tokens
live in the blocks of its block table, token p in block `table[p // block_size]`, slot
`p % block_size`. Every iteration first writes the new K/V through `slot_mapping`, then:

- multi-token chunks (prefill, or recompute after preemption) attend one request at a time.
  With a bf16 cache and the native library (`kernels/prefill_attn.c`) one call reads the whole
  context through the block table, cached prefix or not, with bf16 dot products. Otherwise torch:
  straight to their own fresh K/V when nothing is cached before them, else causally to their
  own K/V plus, in a second pass merged by log-sum-exp, to the cached prefix read through the
  block table (`attend_after_prefix`: no masked pass over the whole context);
- single-token queries (decode) attend together in one batched call. With the native kernel
  (`kernels/paged_decode.c`, the default wherever a C compiler exists) each request's K/V rows are
  read in place through its block table, once per layer, for all query heads of their group.
  The torch fallback gathers the contexts through padded block tables into a reused buffer and
  masks them to each request's length; it views the H query heads as (kv_heads, group) so K/V
  are never repeated.

Metadata is passed explicitly (no global context); it is built once per step by the runner and
shared by all layers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phaselab.core.config import knob
from phaselab.model import kernels


@dataclass
class PrefillSeq:
    token_start: int  # rows of this chunk in the flat batch: [token_start, token_end)
    token_end: int
    start_position: int  # tokens of this request already in the cache before the chunk
    block_table: torch.Tensor  # (num_blocks_of_request,) int64


@dataclass
class StepTimer:
    """A decode-only step's time by kind where the Python layer loop runs it (ns; the native one-call
    path times its kernels in C, kernels.take_step_split): filled by the layers when the runner
    passes one in `AttentionMetadata.timer` (engine/runner.py), read into the iteration record."""

    attention: int = 0  # RoPE + K/V write + paged attention (the fused decode call)
    linear: int = 0  # q/k/v, o, gate/up, down and the LM head
    elementwise: int = 0  # norms and SiLU x up

    def add(self, kind: str, start_ns: int) -> int:
        """Add the time since start_ns to `kind`; returns now (the next part's start)."""
        now = time.perf_counter_ns()
        setattr(self, kind, getattr(self, kind) + now - start_ns)
        return now

    def split(self) -> dict[str, int] | None:
        if not (self.attention or self.linear or self.elementwise):
            return None
        return {"attention": self.attention, "linear": self.linear, "elementwise": self.elementwise}


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot of every new token
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # (Bd,) rows of single-token queries in the flat batch
    decode_block_tables: torch.Tensor | None = None  # (Bd, max_blocks) int64, padded with block 0
    decode_seq_lens: torch.Tensor | None = None  # (Bd,) int64: tokens each decode attends to
    native_decode: bool = False  # run decodes through the native kernel (no mask, no workspace)
    # a decode-only batch in bf16 with the native kernel: RoPE, K/V write and attention in one call
    # (kernels.decode_rope_attend, bit-identical to the separate ops)
    fused_decode: bool = False
    # bf16 cache with the native library: prefill chunks run kernels.prefill_attend in this mode
    # (kernels.prefill_mode(); None: torch's flash attention, as below)
    prefill_mode: int | None = None
    # with prefill_mode set, every attention read comes from the cache: the layer may rotate q and
    # write K/V in one native call (kernels.rope_write_kv) and pass k = v = None here
    native_rope: bool = False
    # torch fallback only:
    decode_mask: torch.Tensor | None = None  # (Bd, 1, 1, max_blocks * block_size) bool, True = attend
    # preallocated (2, >= Bd * max_blocks, block_size, kvh, hd) buffer the decode contexts are
    # gathered into, reused by every layer: a fresh multi-MB tensor per layer costs page faults
    decode_workspace: torch.Tensor | None = None
    block_size: int = knob("block_size")
    timer: StepTimer | None = None  # a decode-only step's timer (the runner's step timers), else None


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, _, _, kvh, hd = kv_cache.shape
    kv_cache[0].view(-1, kvh, hd).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, hd).index_copy_(0, slot_mapping, v)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """(num_blocks, bs, kvh, hd) cache of K or V -> (kvh, length, hd) for one request."""
    _, bs, kvh, hd = cache.shape
    return cache[block_table].view(-1, kvh, hd)[:length].transpose(0, 1)


_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_after_prefix(
    q: torch.Tensor,  # (1, H, n, hd): a chunk's queries at positions start..start+n-1
    k_new: torch.Tensor,  # (1, kvh, n, hd): the chunk's keys/values
    v_new: torch.Tensor,
    k_pre: torch.Tensor,  # (1, kvh, start, hd): the cached prefix's
    v_pre: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk that follows `start` cached tokens, at the cost of a cold chunk.

    One masked SDPA over prefix + chunk runs the whole (n, start + n) score matrix (torch's CPU
    kernel skips no masked block). Instead: flash attention with is_causal over the chunk itself
    (its upper triangle skipped), a second over the prefix (every query sees all of it), merged
    exactly by their log-sum-exps: out = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2).
    """
    if _flash is None:  # an older torch without the op: one masked call (same result, slower)
        ctx = k_pre.shape[2] + k_new.shape[2]
        mask = torch.arange(ctx)[None, :] <= torch.arange(k_pre.shape[2], ctx)[:, None]
        return F.scaled_dot_product_attention(q, torch.cat([k_pre, k_new], 2), torch.cat([v_pre, v_new], 2),
                                              attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k_new.shape[1])
    o1, l1 = _flash(q, k_new, v_new, 0.0, True, scale=scale)
    if k_pre.shape[2] == 0:
        return o1
    o2, l2 = _flash(q, k_pre, v_pre, 0.0, False, scale=scale)
    # the weights sum to 1, so out = o1 + w (o2 - o1) with w = e^l2 / (e^l1 + e^l2): one pass over
    # the (H, n, hd) outputs (torch.lerp) where the two products and their sum were three
    w2 = torch.sigmoid(l2 - l1).unsqueeze(-1)
    return torch.lerp(o1.float(), o2.float(), w2).to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # (T, H, hd)
    k: torch.Tensor | None,  # (T, kvh, hd)
    v: torch.Tensor | None,  # (T, kvh, hd)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, kvh, hd)
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """k and v None: the step's K/V are already in the cache (meta.native_rope; needs prefill_mode)."""
    if k is None or v is None:
        assert meta.prefill_mode is not None, "k/v already written: only the cache-reading prefill kernel can run"
    else:
        write_kv(kv_cache, k, v, meta.slot_mapping)
    T, H, hd = q.shape
    kvh = kv_cache.shape[3]
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_end)
        n = seq.token_end - seq.token_start
        if meta.prefill_mode is not None:  # the whole context, prefix or not, read from the cache
            kernels.prefill_attend(q[rows], kv_cache, seq.block_table, seq.start_position, scale, meta.prefill_mode,
                                   out=out[rows])
            continue
        assert k is not None and v is not None  # the torch path reads the chunk's own K/V
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, hd)
        if seq.start_position == 0:
            ks = k[rows].transpose(0, 1).unsqueeze(0)  # (1, kvh, n, hd)
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=H != kvh)
        else:
            start = seq.start_position
            kp = gather_context(kv_cache[0], seq.block_table, start).unsqueeze(0)  # (1, kvh, start, hd)
            vp = gather_context(kv_cache[1], seq.block_table, start).unsqueeze(0)
            kn = k[rows].transpose(0, 1).unsqueeze(0)  # the chunk's own K/V, as just written
            vn = v[rows].transpose(0, 1).unsqueeze(0)
            o = attend_after_prefix(qs, kn, vn, kp, vp, scale)
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode_rows is not None:
        assert meta.decode_block_tables is not None
        Bd = meta.decode_rows.shape[0]
        only_decodes = not meta.prefills  # then the decode rows are all rows, in order
        if meta.native_decode:
            assert meta.decode_seq_lens is not None
            qd = (q if only_decodes else q[meta.decode_rows]).to(torch.float32).contiguous()
            od = kernels.paged_decode(qd, kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                      meta.decode_seq_lens, scale).to(q.dtype)
            if only_decodes:
                return od
            out[meta.decode_rows] = od
            return out
        assert meta.decode_mask is not None
        group = H // kvh
        qd = q[meta.decode_rows].view(Bd, kvh, group, hd)  # the group plays the query-length role
        flat = meta.decode_block_tables.view(-1)
        n = flat.shape[0]
        if meta.decode_workspace is not None:
            ws_k, ws_v = meta.decode_workspace[0, :n], meta.decode_workspace[1, :n]
            torch.index_select(kv_cache[0], 0, flat, out=ws_k)
            torch.index_select(kv_cache[1], 0, flat, out=ws_v)
        else:
            ws_k, ws_v = kv_cache[0].index_select(0, flat), kv_cache[1].index_select(0, flat)
        kd = ws_k.view(Bd, -1, kvh, hd).transpose(1, 2)  # (Bd, kvh, L, hd)
        vd = ws_v.view(Bd, -1, kvh, hd).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[meta.decode_rows] = od.reshape(Bd, H, hd)
    return out
