"""The native prefill attention kernel (`kernels.prefill_attend`, prefill_attn.c).

Truth from outside the kernel: causal attention written out here in float64 (einsum + softmax over
the context gathered through the block table), and torch's scaled_dot_product_attention, the path
the engine ran before. Each compiled path is forced (dpbf16, avx512, c) and skipped only when this
CPU's build lacks it. The kernel computes every query row from its own position and the same key
blocks in the same order whatever chunk it arrives in, so chunked = unchunked and a chunk after a
cached prefix = the cold prompt hold bit for bit, not up to a tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phaselab import envs
from phaselab.model import kernels
from phaselab.model.attention import AttentionMetadata, PrefillSeq, paged_attention

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernel unavailable: {kernels.unavailable_reason()}")

FEATS = kernels.prefill_features() if kernels.available() else {}
MODES = [  # `auto` (0) runs one of the others: AVX512-BF16, else AVX-512 (AMX only when asked for)
    pytest.param(0, id="auto", marks=pytest.mark.skipif(not FEATS.get("avx512"), reason="this CPU lacks AVX-512")),
    pytest.param(4, id="amx", marks=pytest.mark.skipif(not FEATS.get("amx"),
                                                       reason="this CPU (or build, or Linux) has no AMX tiles")),
    pytest.param(3, id="dpbf16", marks=pytest.mark.skipif(not FEATS.get("avx512_bf16_dot"),
                                                          reason="this CPU lacks AVX512-BF16")),
    pytest.param(1, id="avx512", marks=pytest.mark.skipif(not FEATS.get("avx512"), reason="this CPU lacks AVX-512")),
    pytest.param(2, id="c"),
]
# bf16 output: one rounding of values up to ~4 is 2^-7; P is rounded to bf16 before P.V (as torch does)
TOL = 2e-2


def _case(start: int, n: int, H: int, KVH: int, D: int, BS: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    L = start + n
    nblocks = -(-L // BS)
    cache = (torch.randn(2, nblocks + 3, BS, KVH, D, generator=g) * 1.5).to(torch.bfloat16)
    table = torch.randperm(nblocks + 3, generator=g)[:nblocks].contiguous()  # scattered blocks
    qkv = (torch.randn(n, (H + 2 * KVH) * D, generator=g) * 1.5).to(torch.bfloat16)
    q = qkv[:, : H * D].view(n, H, D)  # rows (H + 2*KVH)*D apart, as the fused projection leaves them
    pos = torch.arange(L)
    k_ctx = cache[0][table[pos // BS], pos % BS]  # (L, KVH, D), gathered independently of the kernel
    v_ctx = cache[1][table[pos // BS], pos % BS]
    return q, cache, table, k_ctx, v_ctx


def _reference(q, k_ctx, v_ctx, start, scale):
    n, H, _ = q.shape
    g = H // k_ctx.shape[1]
    k = k_ctx.double().repeat_interleave(g, dim=1)
    v = v_ctx.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnc,chd->nhd", s.softmax(-1), v)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("start", "n", "H", "KVH", "D"), [
    (0, 1, 9, 3, 64),  # one token: attends to itself
    (0, 7, 9, 3, 64),  # a partial tile
    (0, 300, 9, 3, 64),  # SmolLM2-135M's heads, key blocks of 64 plus a partial one
    (16, 100, 9, 3, 64),  # after a cached prefix
    (63, 66, 8, 8, 96),  # no GQA, a head size without its own copy, odd start
    (100, 37, 4, 2, 128),
    (0, 65, 2, 1, 32),
    (1000, 5, 9, 3, 64),  # a short chunk after a long context
])
def test_matches_float64_reference(mode, start, n, H, KVH, D) -> None:
    q, cache, table, k_ctx, v_ctx = _case(start, n, H, KVH, D, seed=start * 7 + n)
    scale = D**-0.5
    got = kernels.prefill_attend(q, cache, table, start, scale, mode)
    want = _reference(q, k_ctx, v_ctx, start, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (n, H, D)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL, f"max error {err:.4f} vs float64"
    if start == 0:  # and the path it replaces, torch's flash attention, within the same bound
        old = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_ctx.transpose(0, 1)[None],
                                             v_ctx.transpose(0, 1)[None], is_causal=True, scale=scale,
                                             enable_gqa=H != KVH)[0].transpose(0, 1)
        assert (got.double() - old.double()).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cuts", [[130], [1, 2, 64], [37, 101, 190, 191]])
def test_chunked_equals_unchunked_bit_for_bit(mode, cuts) -> None:
    n, H, KVH, D = 257, 9, 3, 64
    q, cache, table, _, _ = _case(0, n, H, KVH, D, seed=len(cuts))
    whole = kernels.prefill_attend(q, cache, table, 0, 0.125, mode)
    edges = [0, *cuts, n]
    parts = [kernels.prefill_attend(q[a:b], cache, table, a, 0.125, mode) for a, b in zip(edges, edges[1:])]
    assert torch.equal(torch.cat(parts), whole)


def test_paged_attention_uses_it_for_cold_and_prefixed_chunks() -> None:
    """Through paged_attention (the K/V write included): the kernel's mode against torch's paths
    (flash for a cold chunk, flash + prefix pass merged by log-sum-exp after a cached prefix)."""
    H, KVH, D, BS = 9, 3, 64, 16
    for start, n in ((0, 90), (48, 40)):
        g = torch.Generator().manual_seed(n)
        L = start + n
        nblocks = -(-L // BS)
        table = torch.randperm(nblocks + 2, generator=g)[:nblocks].contiguous()
        k_ctx = torch.randn(L, KVH, D, generator=g).to(torch.bfloat16)
        v_ctx = torch.randn(L, KVH, D, generator=g).to(torch.bfloat16)
        slots = table[torch.arange(L) // BS] * BS + torch.arange(L) % BS
        q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
        outs = []
        for mode in (None, 0):
            cache = torch.zeros(2, nblocks + 2, BS, KVH, D, dtype=torch.bfloat16)
            cache[0].view(-1, KVH, D)[slots[:start]] = k_ctx[:start]
            cache[1].view(-1, KVH, D)[slots[:start]] = v_ctx[:start]
            meta = AttentionMetadata(slot_mapping=slots[start:], prefills=[PrefillSeq(0, n, start, table)],
                                     block_size=BS, prefill_mode=mode)
            outs.append(paged_attention(q, k_ctx[start:], v_ctx[start:], cache, meta, D**-0.5))
            assert torch.equal(cache[0].view(-1, KVH, D)[slots], k_ctx)  # the chunk's K/V were written
        want = _reference(q, k_ctx, v_ctx, start, D**-0.5)
        for out in outs:
            assert (out.double() - want).abs().max().item() <= TOL


def test_prefixed_chunk_equals_cold_prompt_bit_for_bit() -> None:
    q, cache, table, _, _ = _case(0, 200, 9, 3, 64, seed=5)
    cold = kernels.prefill_attend(q, cache, table, 0, 0.125)
    warm = kernels.prefill_attend(q[150:], cache, table, 150, 0.125)  # the first 150 tokens cached
    assert torch.equal(warm, cold[150:])


def test_bad_input_gets_a_clear_error() -> None:
    q, cache, table, _, _ = _case(0, 40, 9, 3, 64)
    with pytest.raises(RuntimeError, match="unsupported shape"):  # the block table is too short
        kernels.prefill_attend(q, cache, table[:1], 0, 0.125)
    with pytest.raises(RuntimeError, match="unsupported shape or mode"):
        kernels.prefill_attend(q, cache, table, 0, 0.125, mode=7)
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.prefill_attend(q.float(), cache, table, 0, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.prefill_attend(q, cache, table, 0, 0.125, out=torch.empty(40, 64, 9, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="int64"):
        kernels.prefill_attend(q, cache, table.int(), 0, 0.125)


@pytest.mark.parametrize(("value", "expect"), [("torch", None), ("c", 2), ("auto", "auto")])
def test_environment_picks_the_path(monkeypatch, value, expect) -> None:
    monkeypatch.setenv(envs.PREFILL_ATTN.name, value)
    got = kernels.prefill_mode()
    if expect == "auto":
        assert got == (0 if FEATS["avx512"] else None)
    else:
        assert got == expect


def test_environment_refuses_unknown_and_missing_paths(monkeypatch) -> None:
    monkeypatch.setenv(envs.PREFILL_ATTN.name, "fast")
    with pytest.raises(ValueError, match="use one of auto, amx, dpbf16, avx512, c, torch"):
        kernels.prefill_mode()
    monkeypatch.setenv(envs.PREFILL_ATTN.name, "auto")  # a head size the kernel does not take: torch's path
    assert kernels.prefill_mode(head_dim=16) is None
    monkeypatch.setenv(envs.PREFILL_ATTN.name, "c")  # unless forced: then it says so
    with pytest.raises(ValueError, match="not 16"):
        kernels.prefill_mode(head_dim=16)
    missing = [name for name, key in (("amx", "amx"), ("dpbf16", "avx512_bf16_dot"), ("avx512", "avx512"))
               if not FEATS[key]]
    for name in missing:  # only on a CPU without the instructions: forcing them is an error, not a fallback
        monkeypatch.setenv(envs.PREFILL_ATTN.name, name)
        with pytest.raises(ValueError, match="lacks it"):
            kernels.prefill_mode()

# the bundled model with this kernel on and off: tests/test_elementwise.py::test_model_native_paths_*
