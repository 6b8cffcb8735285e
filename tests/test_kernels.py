"""The native paged decode kernel: equal to plain attention on every layout, and to the torch path
inside the engine; clear errors on bad input; a clean fallback when it cannot be built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phaselab import envs
from phaselab import SamplingParams
from phaselab.model import kernels, llama


def reference_decode(q, k_cache, v_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """Plain attention per request in float64: gather the context, repeat K/V per group, softmax."""
    B, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        k = k_cache[tables[b]].reshape(-1, KVH, D)[:n].double()  # (n, KVH, D)
        v = v_cache[tables[b]].reshape(-1, KVH, D)[:n].double()
        k = k.repeat_interleave(H // KVH, dim=1)  # (n, H, D): head h uses KV head h // group
        v = v.repeat_interleave(H // KVH, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def random_layout(B, H, KVH, D, BS, lens, dtype, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    need = [(n + BS - 1) // BS for n in lens]
    num_blocks = sum(need) + 5
    cache = torch.randn(2, num_blocks, BS, KVH, D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order blocks
    max_blocks = max(need)
    tables, i = [], 0
    for k in need:
        tables.append(perm[i:i + k] + [0] * (max_blocks - k))  # padded with block 0, as the runner does
        i += k
    q = torch.randn(B, H, D, generator=g)
    return q, cache, torch.tensor(tables, dtype=torch.long), torch.tensor(lens, dtype=torch.long)


def test_kernel_builds_here():
    # CI machines have a C compiler: a fallback there would hide a broken kernel
    assert kernels.available(), kernels.unavailable_reason()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@pytest.mark.parametrize("H,KVH,D,BS", [(9, 3, 64, 16), (8, 8, 64, 16), (32, 8, 128, 32), (4, 1, 80, 8)])
def test_kernel_equals_plain_attention(dtype, tol, H, KVH, D, BS):
    lens = [1, BS - 1, BS, BS + 1, 3 * BS + 7, 300]
    q, cache, tables, seq_lens = random_layout(len(lens), H, KVH, D, BS, lens, dtype)
    got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, D**-0.5)
    # bf16 cache: the reference reads the same bf16 values, so both compute on identical inputs
    want = reference_decode(q, cache[0], cache[1], tables, seq_lens, D**-0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


DECODE_FEATS = kernels.decode_features()
DECODE_PATHS = [
    pytest.param("c", id="c"),
    pytest.param("dpbf16", id="dpbf16", marks=pytest.mark.skipif(
        not DECODE_FEATS.get("avx512_bf16_dot"), reason="this CPU (or build) lacks AVX512-BF16: no vdpbf16ps path")),
]


@pytest.fixture
def decode_path(request):  # type: ignore[no-untyped-def]
    """Force one part kernel (PHASELAB_DECODE_ATTN's values) for the test, then restore auto."""
    kernels.set_decode_attn(request.param)
    yield request.param
    kernels.set_decode_attn(kernels.decode_attn_mode())


@pytest.mark.parametrize("decode_path", DECODE_PATHS, indirect=True)
@pytest.mark.parametrize("H,KVH,D,BS", [(9, 3, 64, 16), (32, 8, 128, 32), (4, 1, 64, 8)])
def test_each_decode_path_equals_float64_across_parts(decode_path, H, KVH, D, BS):
    """bf16 cache and a q that is exactly bf16 (as the bf16 model's RoPE leaves it), so the
    vdpbf16ps path qualifies; contexts on both sides of the 128-token parts the work is split
    into, up to 8 parts, merged in float32. Bound: 2e-5 absolute and relative against float64 on
    the same bf16 inputs (the float32 path's bound above)."""
    lens = [1, 127, 128, 129, 300, 1000]
    q, cache, tables, seq_lens = random_layout(len(lens), H, KVH, D, BS, lens, torch.bfloat16, seed=7)
    q = q.bfloat16().float()
    got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, D**-0.5)
    want = reference_decode(q, cache[0], cache[1], tables, seq_lens, D**-0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("decode_path", DECODE_PATHS, indirect=True)
def test_decode_attention_is_the_same_bits_alone_batched_and_on_one_thread(decode_path):
    """Parts are fixed token ranges merged in part order: a request's output does not depend on
    the other requests in the call, their order, or how many threads shared the parts."""
    lens = [700, 5, 300, 129]
    q, cache, tables, seq_lens = random_layout(len(lens), 9, 3, 64, 16, lens, torch.bfloat16, seed=11)
    q = q.bfloat16().float()
    batched = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125)
    for b in range(len(lens)):
        alone = kernels.paged_decode(q[b:b + 1].contiguous(), cache[0], cache[1], tables[b:b + 1].contiguous(),
                                     seq_lens[b:b + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], batched[b]), f"request {b} (context {lens[b]}) differs alone"
    order = [3, 1, 0, 2]
    shuffled = kernels.paged_decode(q[order].contiguous(), cache[0], cache[1], tables[order].contiguous(),
                                    seq_lens[order].contiguous(), 0.125)
    assert torch.equal(shuffled, batched[order])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, batched)


def test_decode_path_errors_say_what_to_use(monkeypatch):
    monkeypatch.setenv(envs.DECODE_ATTN.name, "bogus")
    with pytest.raises(ValueError, match="PHASELAB_DECODE_ATTN='bogus': use one of auto, dpbf16, c"):
        kernels.decode_attn_mode()
    # a build without AVX512-BF16 (the avx2 and portable ISA builds, AMD Zen 3) refuses dpbf16
    monkeypatch.setattr(kernels._load(), "paged_decode_features", lambda: 0)
    with pytest.raises(ValueError, match="lacks AVX512-BF16; use auto or c"):
        kernels.set_decode_attn("dpbf16")
    assert kernels.decode_attn_description() == "float32 loops"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: widened in registers, not a buffer
def test_kernel_reads_only_its_own_blocks(dtype):
    """Poisoning every block outside a request's table (and past its length) changes nothing."""
    lens = [20, 33]
    q, cache, tables, seq_lens = random_layout(2, 9, 3, 64, 16, lens, dtype, seed=3)
    cache = cache.contiguous()
    before = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125)
    poisoned = torch.full_like(cache, float("nan"))
    for b, n in enumerate(lens):
        for p in range(n):
            blk, off = tables[b, p // 16], p % 16
            poisoned[:, blk, off] = cache[:, blk, off]
    after = kernels.paged_decode(q, poisoned[0], poisoned[1], tables, seq_lens, 0.125)
    assert torch.equal(before, after)


def test_kernel_rejects_bad_input():
    q, cache, tables, lens = random_layout(2, 9, 3, 64, 16, [5, 7], torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.paged_decode(q.transpose(0, 1).contiguous().transpose(0, 1), cache[0], cache[1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode(q, cache[0], cache[1], tables.int(), lens, 1.0)
    with pytest.raises(ValueError):
        kernels.paged_decode(q.half(), cache[0], cache[1], tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="unsupported shape"):  # a length past the table
        kernels.paged_decode(q, cache[0], cache[1], tables, torch.tensor([5, 10_000]), 1.0)
    with pytest.raises(RuntimeError, match="unsupported shape"):  # heads not a multiple of KV heads
        kernels.paged_decode(torch.randn(2, 8, 64), cache[0], cache[1], tables, lens, 1.0)


def test_no_compiler_falls_back_with_a_reason(monkeypatch):
    from phaselab.model.kernels import build, library

    monkeypatch.setattr(library, "_lib", None)
    monkeypatch.setattr(library, "_tried", False)
    monkeypatch.setattr(library, "_reason", None)
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert not kernels.available()
    assert "no C compiler" in (kernels.unavailable_reason() or "")
    assert not kernels.supports(torch.float32)
    with pytest.raises(RuntimeError, match="unavailable"):
        q, cache, tables, lens = random_layout(1, 9, 3, 64, 16, [4], torch.float32)
        kernels.paged_decode(q, cache[0], cache[1], tables, lens, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_decode_step_same_with_kernel_and_torch_path(dtype):
    """One batched decode step of the real model, teacher-forced on the same cached prompts (mixed
    lengths, scattered blocks, one request still prefilling beside them): the native kernel and the
    torch fallback give the same logits (fp32: to rounding). In bf16 each layer's decode attention is
    checked against a float64 attention of the same q and cache (the kernel's output is that value
    rounded once to bf16, and no further from it than torch's), and the logits' top-1 against the
    fp32 model's. Comparing the two bf16 paths' mean logit error is not a test: one-ulp differences
    in 30 layers move it 0.04-0.27 per row either way (a random one-ulp perturbation of a fifth of
    the attention outputs spans that range), so which path lands nearer fp32 is chance."""
    from phaselab import LLM
    from phaselab.core.outputs import ScheduledRequest
    from tests._model_helpers import long_text

    llm = LLM(dtype=dtype, kv_cache_memory="128MiB", max_model_len=2048)
    runner = llm.engine.executor
    assert runner.native_decode
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    bs = runner.block_size
    ids = llm.get_tokenizer().encode(long_text(20))
    lengths = [1, 15, 16, 17, 130, 600]
    prompts = [ids[11 * i: 11 * i + n] for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=1)
    tables = []
    for p in prompts:  # fill the cache with each prompt (teacher forcing), leaving a free slot
        blocks = pool.allocate(len(p) // bs + 1)
        runner.score(p, blocks)
        tables.append(blocks)
    chunk_blocks = pool.allocate(3)
    plan = [ScheduledRequest(f"d{i}", [ids[900 + i]], len(p), t, [], True, False, params)
            for i, (p, t) in enumerate(zip(prompts, tables))]
    plan.insert(2, ScheduledRequest("chunk", ids[950:990], 0, chunk_blocks, chunk_blocks, True, True, params))

    def logits(native: bool) -> torch.Tensor:
        runner.native_decode = native
        input_ids, positions, meta, rows, _ = runner._prepare(plan)
        with torch.inference_mode():
            return runner.model(input_ids, positions, runner.kv_caches, meta, rows)

    layer_errors: list[tuple[float, float, float]] = []  # (kernel, torch, bf16 of the float64 value)
    real_attention = llama.paged_attention

    def attention_against_float64(q, k, v, kv_cache, meta, scale):
        out = real_attention(q, k, v, kv_cache, meta, scale)
        if not meta.native_decode or dtype == "float32":
            return out
        torch_meta = dataclasses.replace(meta, native_decode=False, decode_workspace=None, decode_mask=(
            torch.arange(meta.decode_block_tables.shape[1] * bs)[None, :] < meta.decode_seq_lens[:, None]
        )[:, None, None, :])
        by_torch = real_attention(q, k, v, kv_cache, torch_meta, scale)
        rows_d, kvh = meta.decode_rows, kv_cache.shape[3]
        exact = torch.empty(len(rows_d), q.shape[1], q.shape[2], dtype=torch.float64)
        for i, (table, n) in enumerate(zip(meta.decode_block_tables, meta.decode_seq_lens.tolist())):
            keys = kv_cache[0][table].reshape(-1, kvh, q.shape[2])[:n].double()
            values = kv_cache[1][table].reshape(-1, kvh, q.shape[2])[:n].double()
            for h in range(q.shape[1]):
                g = h // (q.shape[1] // kvh)
                p = torch.softmax(keys[:, g] @ q[rows_d[i], h].double() * scale, 0)
                exact[i, h] = p @ values[:, g]

        def err(x: torch.Tensor) -> float:
            return float((x[rows_d].double() - exact).abs().mean())
        layer_errors.append((err(out), err(by_torch), float((exact.to(torch.bfloat16).double() - exact).abs().mean())))
        return out

    llama.paged_attention = attention_against_float64
    try:
        native, fallback = logits(True), logits(False)
    finally:
        llama.paged_attention = real_attention
        runner.native_decode = True
        for t in [*tables, chunk_blocks]:
            pool.free(t)
    assert native.shape == (len(plan), llm.engine.model_config.vocab_size)
    if dtype == "float32":
        torch.testing.assert_close(native, fallback, atol=2e-4, rtol=1e-4)
    else:  # both bf16 paths against fp32 logits of the same positions: the kernel is no worse
        fp32 = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=2048).engine
        ref = torch.stack([fp32.score(s.token_ids if s.is_prefill else p + s.token_ids)[-1]
                           for s, p in zip(plan, [*prompts[:2], [], *prompts[2:]])])
        assert len(layer_errors) == llm.engine.model_config.num_hidden_layers
        for layer, (kernel, by_torch, rounding) in enumerate(layer_errors):
            assert kernel <= 1.01 * rounding + 1e-7, f"layer {layer}: kernel {kernel:.3g} vs bf16 rounding {rounding:.3g}"
            assert kernel <= by_torch + 1e-7, f"layer {layer}: kernel {kernel:.3g} vs torch {by_torch:.3g}"
        for row, (got, want) in enumerate(zip(native.argmax(-1).tolist(), ref.argmax(-1).tolist())):
            gap = float(ref[row, want] - ref[row, got])
            assert got == want or gap < 0.25, f"row {row}: bf16 kernel picks {got}, fp32 {want} by {gap:.3f}"
    assert pool.num_used_blocks == 0


def test_loading_the_kernels_keeps_subnormal_arithmetic():
    """A shared object built with -ffast-math sets flush-to-zero / denormals-are-zero for the whole
    process when it loads (gcc links crtfastmath.o into it): torch, numpy and Python floats would then
    lose subnormals. Loading phaselab's kernels must leave the process's arithmetic as it was."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from phaselab.model import kernels\n"
        "from phaselab.model.kernels import qlinear\n"
        "assert kernels.available(), kernels.unavailable_reason()\n"
        "assert qlinear.available(), qlinear.unavailable_reason()\n"
        "tiny = float(sys.argv[1])\n"
        "print(tiny / 2 > 0.0, tiny * 0.5 > 0.0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, repr(2.2250738585072014e-308)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], f"subnormals flushed after loading the kernels: {out.stdout}"
