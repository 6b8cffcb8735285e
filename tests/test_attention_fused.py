"""The fused decode path (`kernels.decode_rope_attend`): RoPE, the K/V write and paged attention of a
decode-only batch (bf16 or float32) in one native call must equal the separate torch ops bit for bit.

The truth is the unfused path the engine ran before (apply_rope in bf16 torch ops, write_kv's
index_copy_, the paged kernel, the cast to bf16), which tests/test_kernels.py and the model tests
hold to references of their own; the fused call must reproduce its every rounding, so outputs and
caches are compared with torch.equal, not a tolerance. Then the real model: greedy tokens and
top-5 logprobs with the fused path on and off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phaselab.model import kernels
from phaselab.model.attention import AttentionMetadata, paged_attention
from phaselab.model.llama import apply_rope

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernel unavailable: {kernels.unavailable_reason()}")


def _case(B: int, H: int, KVH: int, D: int, BS: int, lens: list[int], seed: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    blocks_per = max((n + BS - 1) // BS for n in lens)
    num_blocks = B * blocks_per + 3
    cache = (torch.randn(2, num_blocks, BS, KVH, D, generator=g) * 2).to(dtype)  # old tokens: random
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: B * blocks_per].reshape(B, blocks_per).contiguous()
    slots = torch.tensor([int(tables[b, (n - 1) // BS]) * BS + (n - 1) % BS for b, n in enumerate(lens)])
    qkv = (torch.randn(B, (H + 2 * KVH) * D, generator=g) * 3).to(dtype)
    theta = torch.rand(B, D // 2, generator=g) * 50  # any angles: the tables' values are what matter
    emb = torch.cat([theta, theta], -1)
    return qkv, emb.cos().to(dtype), emb.sin().to(dtype), cache, slots, tables, torch.tensor(lens)


def _unfused(qkv, cos, sin, cache, slots, tables, lens, H, KVH, D, scale):
    B = qkv.shape[0]
    qk = apply_rope(qkv[:, : (H + KVH) * D].view(B, H + KVH, D), cos, sin)
    q, k = qk[:, :H], qk[:, H:]
    v = qkv[:, (H + KVH) * D:].view(B, KVH, D)
    meta = AttentionMetadata(slot_mapping=slots, decode_rows=torch.arange(B), decode_block_tables=tables,
                             decode_seq_lens=lens, native_decode=True)
    return paged_attention(q, k, v, cache, meta, scale).reshape(B, H * D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("B", "H", "KVH", "D", "lens"), [
    (1, 9, 3, 64, [1]),  # the first decode token: attends to itself only
    (1, 9, 3, 64, [517]),  # SmolLM2-135M's heads
    (5, 9, 3, 64, [3, 16, 17, 200, 64]),  # block edges
    (4, 8, 8, 128, [33, 1, 90, 129]),  # no GQA, another head size
    (3, 12, 2, 80, [7, 40, 19]),  # a head size without its own copy in the kernel
])
def test_fused_equals_separate_ops(B, H, KVH, D, lens, dtype) -> None:
    """bf16 and float32 (the dtype an AVX2-only CPU serves): the float32 RoPE must not fuse its
    multiply-adds, as torch's separate mul and add kernels do not."""
    BS = 16
    qkv, cos, sin, cache, slots, tables, lens_t = _case(B, H, KVH, D, BS, lens, seed=B * 1000 + D, dtype=dtype)
    scale = D ** -0.5
    cache_ref = cache.clone()
    ref = _unfused(qkv, cos, sin, cache_ref, slots, tables, lens_t, H, KVH, D, scale)
    out = kernels.decode_rope_attend(qkv, cos, sin, cache, slots, tables, lens_t, H, scale)
    assert out.dtype == dtype and out.shape == (B, H * D)
    assert torch.equal(out, ref)
    assert torch.equal(cache, cache_ref), "the K/V written to the slots differ"


def test_refuses_bad_shapes() -> None:
    qkv, cos, sin, cache, slots, tables, lens = _case(1, 9, 3, 64, 16, [5], seed=1)
    with pytest.raises(RuntimeError, match="unsupported shape"):  # 9 query heads over 3 KV heads, told 8
        kernels.decode_rope_attend(qkv, cos, sin, cache, slots, tables, lens, 8, 0.125)
    with pytest.raises(RuntimeError, match="unsupported shape"):  # a length beyond the block table
        kernels.decode_rope_attend(qkv, cos, sin, cache, slots, tables, torch.tensor([10_000]), 9, 0.125)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_model_fused_on_and_off_agree(dtype) -> None:
    """The bundled model: greedy tokens and top-5 logprobs identical with the fused path on and
    off (the runner's switch, PHASELAB_FUSED_DECODE), batched decodes of varied lengths."""
    from phaselab import LLM
    from phaselab.core.sampling_params import SamplingParams

    # no prefix caching: the second run's prefills must be cold like the first's (a chunk after
    # cached tokens takes another attention path, equal only up to rounding)
    llm = LLM(dtype=dtype, kv_cache_memory="256MiB", max_model_len=1024, enable_prefix_caching=False)
    runner = llm.engine.executor
    assert runner.fused_decode, f"the fused path should be on for {dtype} with the native kernel"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (5, 40, 300, 17)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5)

    def run() -> list[tuple[list[int], str]]:
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in llm.generate(prompts, params)]

    try:
        fused = run()
        runner.fused_decode = False
        separate = run()
    finally:
        runner.fused_decode = True
        llm.shutdown()
    assert fused == separate


@pytest.mark.parametrize(("T", "H", "KVH", "D"), [(1, 9, 3, 64), (37, 9, 3, 64), (300, 8, 8, 128), (20, 12, 2, 80)])
def test_rope_write_kv_equals_separate_ops(T, H, KVH, D) -> None:
    """The prefill/mixed-step half of the fusion (kernels.rope_write_kv): rotated q and the cache
    writes of any number of rows, bit for bit against apply_rope + write_kv (rows past 16 go to the
    thread pool: the 300-row case)."""
    from phaselab.model.attention import write_kv

    BS = 16
    g = torch.Generator().manual_seed(T + D)
    num_blocks = -(-T // BS) + 3
    cache = (torch.randn(2, num_blocks, BS, KVH, D, generator=g) * 2).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * BS, generator=g)[:T].contiguous()  # any slots, in any order
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3).to(torch.bfloat16)
    theta = torch.rand(T, D // 2, generator=g) * 50
    emb = torch.cat([theta, theta], -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    cache_ref = cache.clone()
    qk = apply_rope(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
    write_kv(cache_ref, qk[:, H:], qkv[:, (H + KVH) * D:].view(T, KVH, D), slots)
    q = kernels.rope_write_kv(qkv, cos, sin, cache, slots, H)
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(cache, cache_ref)
