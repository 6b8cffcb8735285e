"""Weights and KV cache on huge pages (phaselab/model/hugepages.py): the same values, aligned, one
mapping for the weights in reading order, and what the kernel actually gave, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from phaselab import envs
from phaselab.model import hugepages
from phaselab.model.linear import PackedEmbedding, PackedLinear

needs_thp = pytest.mark.skipif(not hugepages.enabled(),
                               reason=f"transparent huge pages unavailable here (THP {hugepages.mode()})")


def test_pack_copies_values_aligned_and_end_to_end():
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(3, 5, generator=g), torch.arange(7, dtype=torch.int16),
           torch.randint(0, 255, (1000, 36), generator=g, dtype=torch.uint8), torch.randn(4, generator=g).bfloat16()]
    out = hugepages.pack(src)
    for a, b in zip(src, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0 and b.data_ptr() != a.data_ptr()
    starts = [t.data_ptr() for t in out]
    assert starts == sorted(starts) and starts[-1] - starts[0] < 40_000  # one mapping, in the order given
    out[0].zero_()  # views of writable memory, not of the originals
    assert src[0].abs().sum() > 0


def test_zeros_is_zero_and_writable():
    t = hugepages.zeros((3, 2, 5), torch.bfloat16)
    assert t.shape == (3, 2, 5) and t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()
    t[1, 1, 2] = 2.5
    assert float(t.sum()) == 2.5


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_thp
def test_memory_is_resident_when_allocated():
    """The KV cache's pages are faulted in when it is allocated, as torch.zeros does, not by the
    forwards that first write them (an engine's first prefill paid for them: hugepages.populate).
    The truth is the kernel's count of this process's resident memory, before any write of ours.
    (Not asked of torch's own allocation: in a long test run it reuses memory already resident.)"""
    before = _resident_bytes()
    t = hugepages.zeros((16, 1 << 20), torch.float32)  # 64 MiB
    grown = _resident_bytes() - before
    assert grown >= 56 << 20, f"only {grown >> 20} MiB of a 64 MiB cache resident after allocation"
    assert not t.any()


def test_turned_off_gives_torch_memory(monkeypatch):
    monkeypatch.setenv(envs.HUGEPAGES.name, "0")
    assert not hugepages.enabled()
    before = hugepages.huge_bytes()
    t = hugepages.empty_bytes(8 << 20)
    t.fill_(1)
    if hugepages.mode() != "always":  # with THP "always" even torch's own memory may get huge pages
        assert hugepages.huge_bytes() <= before + (2 << 20)  # torch's allocation: no madvise
    assert int(t.sum()) == 8 << 20


@needs_thp
def test_touched_memory_is_on_huge_pages():
    """What the OS did, not what was asked: AnonHugePages grows by most of a 64 MiB mapping once
    it is written (khugepaged or fault-time allocation may fail under memory pressure, hence not
    all of it)."""
    before = hugepages.huge_bytes()
    t = hugepages.empty_bytes(64 << 20)
    t.fill_(3)
    assert hugepages.huge_bytes() - before >= 32 << 20, (before, hugepages.huge_bytes())
    del t


@needs_thp
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_weights_are_one_mapping_in_reading_order(llm_fp32, dtype):
    from phaselab import LLM

    llm = llm_fp32 if dtype == "float32" else LLM(dtype=dtype, kv_cache_memory="64MiB", max_model_len=512)
    model = llm.engine.executor.model
    assert "on huge pages" in llm.engine.linear_summary["huge_pages"]
    modules = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
    spans = sorted({(m.packed.data.data_ptr(), m.packed.data.numel() * m.packed.data.element_size()) for m in modules})
    dense = [m.direct.data_ptr() for m in modules if getattr(m, "direct", None) is not None
             and m.direct.data_ptr() != m.packed.data.data_ptr()]
    assert all(d > spans[-1][0] for d in dense), "a GEMM's dense copy sits between the blocks decode streams"
    layers = [(x.packed.data.data_ptr()) for layer in model.model.layers for x in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert layers == sorted(layers), "layer weights not in the order a step reads them"
    assert model.head.packed.data.data_ptr() > layers[-1], "the head is read last"
    # end to end: no gap wider than the 64-byte alignment between consecutive weights
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert 0 <= b - (a + n) < 64
    assert llm.engine.executor.kv_caches.data_ptr() % hugepages.HUGE == 0
