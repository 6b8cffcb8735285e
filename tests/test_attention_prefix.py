"""Prefill chunks after a cached prefix (issue 18 item 4): two flash passes merged by log-sum-exp
equal the previous single masked pass, and a float64 softmax written out here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phaselab.model.attention import AttentionMetadata, PrefillSeq, paged_attention


def _reference(q, k_ctx, v_ctx, start, scale):
    """float64 causal attention of queries at positions start.. over keys 0..start+i (GQA by repeat)."""
    n, H, hd = q.shape
    ctx, kvh, _ = k_ctx.shape
    g = H // kvh
    k = k_ctx.double().repeat_interleave(g, dim=1).transpose(0, 1)  # (H, ctx, hd)
    v = v_ctx.double().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.einsum("nhd,hcd->hnc", q.double(), k) * scale
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnc,hcd->nhd", s.softmax(-1), v)


def _old_masked_path(q, k_ctx, v_ctx, start, scale):
    """The path before issue 18: one SDPA over prefix + chunk with an offset causal mask."""
    n, H, _ = q.shape
    ctx, kvh, _ = k_ctx.shape
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_ctx.transpose(0, 1)[None],
                                       v_ctx.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=H != kvh)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,kvh", [(9, 3), (4, 4)])
@pytest.mark.parametrize("start,n", [(16, 64), (5, 1), (37, 130), (48, 3)])
def test_chunk_after_cached_prefix(dtype, tol, H, kvh, start, n):
    g = torch.Generator().manual_seed(start * 1000 + n)
    hd, bs = 64, 16
    ctx = start + n
    nblocks = -(-ctx // bs)
    cache = torch.zeros(2, nblocks + 3, bs, kvh, hd, dtype=dtype)
    table = torch.randperm(nblocks + 3, generator=g)[:nblocks]  # scattered blocks
    k_ctx = torch.randn(ctx, kvh, hd, generator=g).to(dtype)
    v_ctx = torch.randn(ctx, kvh, hd, generator=g).to(dtype)
    slots = table[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
    cache[0].view(-1, kvh, hd)[slots[:start]] = k_ctx[:start]  # the prefix is already cached
    cache[1].view(-1, kvh, hd)[slots[:start]] = v_ctx[:start]
    q = torch.randn(n, H, hd, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=slots[start:], prefills=[PrefillSeq(0, n, start, table)], block_size=bs)
    scale = hd**-0.5
    got = paged_attention(q, k_ctx[start:], v_ctx[start:], cache, meta, scale)
    want = _reference(q, k_ctx, v_ctx, start, scale)
    assert (got.double() - want).abs().max().item() <= tol
    old = _old_masked_path(q, k_ctx, v_ctx, start, scale)
    assert (got.double() - old.double()).abs().max().item() <= tol
    # and the chunk's K/V landed in the cache (the decode steps read them there)
    assert torch.equal(cache[0].view(-1, kvh, hd)[slots], k_ctx)
