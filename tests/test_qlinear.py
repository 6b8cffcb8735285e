"""The native linear paths (issue 18) against a float64 reference matmul.

Truth comes from outside the code under test: weights are quantized and dequantized by gguf-py
(llama.cpp's reference Python), the reference product is float64 `x @ W^T`. The kernel sums in
float32 in its own order, so the bound is float32 rounding of a K-term dot product,
    |y - ref| <= 8 * K * 2^-24 * (|x| @ |W|^T) + tiny,
plus, when the output is bf16, half a bf16 step of the result (2^-9 |ref|, rounding to nearest).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phaselab import envs
from phaselab.model.kernels import qlinear
from phaselab.model.linear import PackedEmbedding, PackedLinear, Workspace
from phaselab.model.quant import PackedTensor, dequantize_blocks, quantize_q8_0

pytestmark = pytest.mark.skipif(not qlinear.available(), reason=f"native kernel unavailable: {qlinear.unavailable_reason()}")

ROWS = list(range(1, 18)) + [31, 32, 33, 64]
QUANT = ("Q4_0", "Q4_1", "Q8_0")


def _gguf_packed(fmt: str, n: int, k: int, seed: int) -> tuple[PackedTensor, torch.Tensor]:
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qt = getattr(GGMLQuantizationType, fmt)
    data = quants.quantize(w, qt)
    ref = torch.from_numpy(np.asarray(quants.dequantize(data, qt), dtype=np.float64).reshape(n, k))
    return PackedTensor(fmt, torch.from_numpy(np.ascontiguousarray(data).reshape(n, -1).copy()), (n, k)), ref


def _dense_packed(fmt: str, n: int, k: int, seed: int) -> tuple[PackedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16 if fmt == "BF16" else torch.float32)
    return PackedTensor(fmt, w.contiguous(), (n, k)), w.double()


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
    ref = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    if bias is not None:
        ref = ref + bias.double()
        scale = scale + bias.double().abs()
    bound = 8 * w.shape[1] * 2.0**-24 * scale + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def _scratch(fmt: str, m: int, k: int, act: torch.dtype) -> torch.Tensor:
    return torch.empty(max(1, qlinear.scratch_floats(fmt, m, k, act)))


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(autouse=True)
def exact_paths():
    """The tests below hold the kernel to the float32 bound of exact weights, which the AMX path
    (bf16-rounded weights, tested on its own at the end) does not meet: off unless a test turns it
    on (qlinear.set_amx_min is process-wide; restored after)."""
    before = {f: qlinear.amx_min(f) for f in qlinear.FORMAT_IDS}
    for f in before:
        qlinear.set_amx_min(f, qlinear.AMX_OFF)
    yield
    for f, rows in before.items():
        qlinear.set_amx_min(f, rows if rows > 0 else 0)


@pytest.fixture(params=["four-rows-from-1", "one-row-always"])
def rows4(request):
    """Both weight-row passes of the kernel at every row count, whatever a probe chose for this CPU
    (qlinear.set_rows4_min is process-wide): four weight rows at a time from 1 activation row on,
    and one weight row at a time always (the remainder rows N % 4 run one at a time either way)."""
    fmts = tuple(qlinear.FORMAT_IDS)
    before = {f: qlinear.rows4_min(f) for f in fmts}
    for f in fmts:
        qlinear.set_rows4_min(f, 1 if request.param == "four-rows-from-1" else qlinear.ROWS4_OFF)
    assert all(qlinear.rows4_min(f) == (1 if request.param == "four-rows-from-1" else qlinear.ROWS4_OFF) for f in fmts)
    yield request.param
    for f, rows in before.items():
        qlinear.set_rows4_min(f, rows)


@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_quantized_kernel_matches_float64_reference(fmt, act, rows4):
    packed, ref = _gguf_packed(fmt, 37, 96, seed=1)  # 37 rows, K = 3 blocks: no multiple of 16 rows
    # the torch dequantization used at load agrees with gguf-py's exactly
    assert torch.equal(dequantize_blocks(fmt, packed.data, packed.shape).double(), ref)
    bias = torch.randn(37)
    for m in ROWS:
        x = _x(m, 96, act, seed=m)
        y = torch.empty(m, 37, dtype=act)
        qlinear.linear(fmt, packed.data, 37, 96, x, y, _scratch(fmt, m, 96, act), bias)
        _check(y, x, ref, bias, f"{fmt} x {act} at {m} rows, {rows4}")


@pytest.mark.parametrize("fmt", QUANT + ("F32", "BF16"))
def test_kernel_over_long_rows_and_many_activation_rows(fmt, rows4):
    """K beyond one slice of the four-row pass's panel (AVX2 builds widen 1024 elements of four
    weight rows at a time and add the slices' sums) and more activation rows than one pass holds
    (64), with a remainder of N % 4 rows."""
    n, k = 10, 2080  # 65 blocks: two whole slices and a partial one
    packed, ref = (_gguf_packed if fmt in QUANT else _dense_packed)(fmt, n, k, seed=4)
    for m in (1, 3, 4, 7, 64, 70):
        x = _x(m, k, torch.float32, seed=m)
        y = torch.empty(m, n)
        qlinear.linear(fmt, packed.data, n, k, x, y, _scratch(fmt, m, k, x.dtype), None)
        _check(y, x, ref, None, f"{fmt} ({n}x{k}) at {m} rows, {rows4}")


# the vdpbf16ps variant (use_dp) exists only for bf16 weights with bf16 activations
@pytest.mark.parametrize(("fmt", "act", "use_dp"), [
    ("F32", torch.float32, False), ("F32", torch.bfloat16, False),
    ("BF16", torch.float32, False), ("BF16", torch.bfloat16, False), ("BF16", torch.bfloat16, True)])
def test_dense_kernel_matches_float64_reference(fmt, act, use_dp, rows4):
    if use_dp and not qlinear.features()["avx512_bf16_dot"]:
        pytest.skip("this CPU (or compiler) lacks AVX512-BF16: the vdpbf16ps variant is not built")
    for n, k in ((19, 45), (5, 77), (33, 32)):  # K not a multiple of 16/32: masked tails
        packed, ref = _dense_packed(fmt, n, k, seed=n)
        for m in ROWS:
            x = _x(m, k, act, seed=m)
            y = torch.empty(m, n, dtype=torch.float32)
            qlinear.linear(fmt, packed.data, n, k, x, y, _scratch(fmt, m, k, act), None, use_dp=use_dp)
            _check(y, x, ref, None, f"{fmt} x {act} ({n}x{k}) at {m} rows, dp={use_dp}, {rows4}")


@pytest.mark.parametrize("fmt", QUANT + ("F32", "BF16"))
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_dequant_rows_and_embedding_lookup(fmt, act):
    packed, ref = (_gguf_packed if fmt in QUANT else _dense_packed)(fmt, 21, 64, seed=3)
    out = torch.empty(21, 64, dtype=act)
    qlinear.dequant(fmt, packed.data, 21, 64, out)
    assert torch.equal(out, ref.to(act)), f"{fmt}: widened rows differ from the reference rounded to {act}"
    ids = torch.tensor([[3, 0], [20, 3]])
    emb = PackedEmbedding(packed, act)(ids)
    assert torch.equal(emb, ref.to(act)[ids])


@pytest.mark.parametrize("fmt", QUANT + ("F32", "BF16"))
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_layer_native_and_tiled_gemm_paths(fmt, act):
    """The layer switches to widening + torch GEMM above max_native_rows; both sides match."""
    n, k = (45, 128) if fmt in QUANT else (45, 70)
    packed, ref = (_gguf_packed if fmt in QUANT else _dense_packed)(fmt, n, k, seed=5)
    bias = torch.randn(n)
    layer = PackedLinear(packed, bias, act, max_native_rows=16, workspace=Workspace(act))
    for m in ROWS:
        x = _x(m, k, act, seed=100 + m)
        y = layer(x)
        assert y.dtype == act and y.shape == (m, n)
        # the GEMM side runs in the activation dtype: bf16 GEMMs round the widened weight to bf16
        w = ref if act == torch.float32 or m <= 16 else ref.to(torch.bfloat16).double()
        b = bias if act == torch.float32 or m <= 16 else bias.to(torch.bfloat16)
        _check(y, x, w, b, f"layer {fmt} x {act} at {m} rows")


@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_layer_resident_gemm_path(fmt, act):
    """batched="resident": above max_native_rows the GEMM reads a dense copy widened once at
    construction; it gives what the per-call tile gives, and below the switch the kernel runs."""
    n, k = 45, 128
    packed, ref = _gguf_packed(fmt, n, k, seed=6)
    bias = torch.randn(n)
    resident = PackedLinear(packed, bias, act, max_native_rows=8, workspace=Workspace(act), batched="resident")
    tiled = PackedLinear(packed, bias, act, max_native_rows=8, workspace=Workspace(act))
    assert resident.resident_bytes == n * k * act.itemsize and tiled.resident_bytes == 0
    assert "resident" in repr(resident) and "tile" in repr(tiled)
    for m in (1, 8, 9, 33):
        x = _x(m, k, act, seed=200 + m)
        y = resident(x)
        w = ref if act == torch.float32 or m <= 8 else ref.to(torch.bfloat16).double()
        b = bias if act == torch.float32 or m <= 8 else bias.to(torch.bfloat16)
        _check(y, x, w, b, f"resident {fmt} x {act} at {m} rows")
        if m > 8:  # the same GEMM on the same widened weight
            assert torch.equal(y, tiled(x)), f"resident vs tile {fmt} x {act} at {m} rows"


def test_tiled_gemm_in_row_chunks(monkeypatch):
    """A weight larger than the tile (the LM head) is widened and multiplied a chunk at a time."""
    from phaselab.model import linear

    monkeypatch.setattr(linear, "TILE_ELEMENTS", 7 * 64)  # 7 rows per chunk of a 45-row weight
    packed, ref = _gguf_packed("Q8_0", 45, 64, seed=7)
    layer = PackedLinear(packed, None, torch.float32, max_native_rows=0, workspace=Workspace(torch.float32))
    x = _x(20, 64, torch.float32)
    _check(layer(x), x, ref, None, "chunked tile GEMM")


def test_requantized_q8_0_equals_gguf_quantizer():
    """K-quants are re-quantized to Q8_0 at load; our quantizer writes the bytes gguf-py writes."""
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(9).standard_normal((13, 96)).astype(np.float32)
    ours = quantize_q8_0(torch.from_numpy(w)).numpy()
    theirs = np.asarray(quants.quantize(w, GGMLQuantizationType.Q8_0)).reshape(13, -1)
    assert np.array_equal(ours, theirs)


# -- Q4_1X: Q4_1 re-laid at load for vdpbf16ps (bf16 activations, AVX512-BF16) ---------------------
needs_dp = pytest.mark.skipif(not qlinear.features()["avx512_bf16_dot"],
                              reason="this CPU (or compiler) lacks AVX512-BF16: the Q4_1X kernel is not built")
# K of 1, 3, 16, 17, 18 and 37 blocks: no full group, full groups only, groups and a tail
X_SHAPES = ((13, 32), (37, 96), (21, 512), (19, 544), (37, 576), (9, 1184))


@pytest.mark.parametrize(("n", "k"), X_SHAPES)
def test_q4_1x_layout_round_trips_and_widens_exactly(n, k):
    """The C repack, undone by an independent torch reading of the documented layout, gives back
    the file's bytes; the C and torch widenings of the re-laid rows equal gguf-py's dequantization."""
    from phaselab.model.quant import unpack_q4_1x

    packed, ref = _gguf_packed("Q4_1", n, k, seed=k)
    x = qlinear.repack("Q4_1X", packed.data, n, k)
    assert x.shape == packed.data.shape
    assert torch.equal(x, packed.data) == (k < 512)  # fewer than 16 blocks: all tail, as stored
    assert torch.equal(unpack_q4_1x(x, k), packed.data)
    assert torch.equal(dequantize_blocks("Q4_1X", x, (n, k)).double(), ref)
    for act in (torch.float32, torch.bfloat16):
        out = torch.empty(n, k, dtype=act)
        qlinear.dequant("Q4_1X", x, n, k, out)
        assert torch.equal(out, ref.to(act))
        ids = torch.tensor([[n - 1, 0], [2, 2]])
        assert torch.equal(PackedEmbedding(PackedTensor("Q4_1X", x, (n, k)), act)(ids), ref.to(act)[ids])


@needs_dp
@pytest.mark.parametrize(("n", "k"), X_SHAPES)
def test_q4_1x_kernel_matches_float64_reference(n, k):
    """bf16 activations at 1..64 rows (1..8 per pass, then again), float32 and bf16 outputs, with a
    bias: within the float32 bound of a K-term sum (the 128 + q offset included, see qlinear_avx512.c)."""
    packed, ref = _gguf_packed("Q4_1", n, k, seed=k + 1)
    x4 = qlinear.repack("Q4_1X", packed.data, n, k)
    bias = torch.randn(n)
    for m in ROWS:
        x = _x(m, k, torch.bfloat16, seed=m)
        for out_dtype in (torch.float32, torch.bfloat16):
            y = torch.empty(m, n, dtype=out_dtype)
            qlinear.linear("Q4_1X", x4, n, k, x, y, _scratch("Q4_1X", m, k, x.dtype), bias)
            _check(y, x, ref, bias, f"Q4_1X ({n}x{k}) at {m} rows -> {out_dtype}")


@needs_dp
@pytest.mark.parametrize(("n", "k"), X_SHAPES)
def test_q4_1x_prefetch_distance_changes_no_bit(n, k):
    """How far ahead the kernel prefetches (set at start-up per CPU, prefetch_probe.choose)
    moves only data, never arithmetic: every distance, past the weight's end too, gives the same bits
    at 1..64 rows."""
    packed, _ = _gguf_packed("Q4_1", n, k, seed=k + 2)
    x4 = qlinear.repack("Q4_1X", packed.data, n, k)
    before = qlinear.prefetch()
    try:
        for m in (1, 3, 64):
            x = _x(m, k, torch.bfloat16, seed=m)
            outs = []
            for dist in (64, 2048, 4096, 1 << 20):
                qlinear.set_prefetch(dist)
                assert qlinear.prefetch() == dist
                y = torch.empty(m, n, dtype=torch.bfloat16)
                outs.append(qlinear.linear("Q4_1X", x4, n, k, x, y, _scratch("Q4_1X", m, k, x.dtype)))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"({n}x{k}) at {m} rows"
        qlinear.set_prefetch(0)
        assert qlinear.prefetch() == 2048  # 0: the kernel's default
    finally:
        qlinear.set_prefetch(before)


@needs_dp
def test_q4_1x_refuses_float32_activations():
    """The layout exists for vdpbf16ps: float32 activations get an error, not a silent rounding."""
    packed, _ = _gguf_packed("Q4_1", 8, 64, seed=9)
    x4 = qlinear.repack("Q4_1X", packed.data, 8, 64)
    with pytest.raises(RuntimeError, match="unsupported"):
        qlinear.linear("Q4_1X", x4, 8, 64, _x(1, 64, torch.float32), torch.empty(1, 8), torch.empty(64))


@pytest.mark.parametrize(("n", "k"), X_SHAPES)
def test_q4_1x_widens_in_kernel_order_exactly(n, k):
    """The tile GEMM's widening writes Q4_1X rows with their columns in `kernel_order`: put back in
    the file's order they are the reference rounded to the output dtype, bit for bit."""
    packed, ref = _gguf_packed("Q4_1", n, k, seed=k + 2)
    x4 = qlinear.repack("Q4_1X", packed.data, n, k)
    order = qlinear.kernel_order("Q4_1X", k)
    assert sorted(order.tolist()) == list(range(k))  # a permutation of the columns
    for m in (1, 3, 40):  # the C permutation of activations is torch's indexing by that order
        x = _x(m, k, torch.bfloat16, seed=m)
        assert torch.equal(qlinear.to_kernel_order("Q4_1X", x), x.index_select(1, order))
    for act in (torch.float32, torch.bfloat16):
        out = qlinear.dequant_kernel_order("Q4_1X", x4, n, k, torch.empty(n, k, dtype=act))
        back = torch.empty_like(out)
        back[:, order] = out
        assert torch.equal(back, ref.to(act)), act


@needs_dp
@pytest.mark.parametrize("batched", ["resident", "tile"])
def test_layer_re_lays_q4_1_for_bf16(batched, monkeypatch):
    """A bf16 layer keeps its Q4_1 blocks as Q4_1X whether its GEMM reads a resident dense copy or
    widens a tile per call (in the layout's column order, its activations permuted to match), and
    PHASELAB_Q4_REPACK=0 keeps Q4_1; every way, the layer computes the reference at every row count,
    the tile in one piece and in row chunks."""
    from phaselab.model import linear

    n, k = 45, 576
    packed, ref = _gguf_packed("Q4_1", n, k, seed=11)
    bias = torch.randn(n)
    for env, want in (("1", "Q4_1X"), ("0", "Q4_1")):
        monkeypatch.setenv(envs.Q4_REPACK.name, env)
        layer = PackedLinear(packed, bias, torch.bfloat16, max_native_rows=8, workspace=Workspace(torch.bfloat16),
                             batched=batched)
        assert layer.packed.fmt == want and layer.packed.nbytes == packed.nbytes
        for tile_elements in (linear.TILE_ELEMENTS, 7 * k):
            monkeypatch.setattr(linear, "TILE_ELEMENTS", tile_elements)
            for m in (1, 5, 8, 9, 33):
                x = _x(m, k, torch.bfloat16, seed=300 + m)
                w = ref if m <= 8 else ref.to(torch.bfloat16).double()
                b = bias if m <= 8 else bias.to(torch.bfloat16)
                _check(layer(x), x, w, b, f"{batched} layer ({want}, tile {tile_elements}) at {m} rows")


# -- Q4_1L / Q8_0L: blocks re-laid at load with a float32 vector lane per block (the AVX2 build's) --
# K of 1, 3, 8, 9, 18 (the bundled model's 576: two groups and a tail), 48 (1536: groups only) and
# 65 blocks (beyond one 1024-element slice of AVX2's four-row pass)
L_SHAPES = ((13, 32), (37, 96), (21, 256), (19, 288), (37, 576), (11, 1536), (10, 2080))
LANES = [("Q4_1L", "Q4_1"), ("Q8_0L", "Q8_0")]


@pytest.mark.parametrize(("lanes", "stored"), LANES)
@pytest.mark.parametrize(("n", "k"), L_SHAPES)
def test_lane_layout_round_trips_and_widens_exactly(lanes, stored, n, k):
    """The C repack, undone by an independent torch reading of the documented layout, gives back
    the file's bytes; the C and torch widenings of the re-laid rows equal gguf-py's dequantization,
    in the file's column order (the tile GEMM and the embedding read them as they read the file's)."""
    from phaselab.model.quant import UNPACK

    packed, ref = _gguf_packed(stored, n, k, seed=k + 5)
    x = qlinear.repack(lanes, packed.data, n, k)
    assert x.shape == packed.data.shape
    assert torch.equal(x, packed.data) == (k < 256)  # fewer than 8 blocks: all tail, as stored
    assert torch.equal(UNPACK[lanes](x, k), packed.data)
    assert torch.equal(dequantize_blocks(lanes, x, (n, k)).double(), ref)
    assert qlinear.kernel_order(lanes, k) is None
    for act in (torch.float32, torch.bfloat16):
        out = torch.empty(n, k, dtype=act)
        qlinear.dequant(lanes, x, n, k, out)
        assert torch.equal(out, ref.to(act)), act
        ids = torch.tensor([[n - 1, 0], [2, 2]])
        assert torch.equal(PackedEmbedding(PackedTensor(lanes, x, (n, k)), act)(ids), ref.to(act)[ids])


@pytest.mark.parametrize(("lanes", "stored"), LANES)
@pytest.mark.parametrize(("n", "k"), L_SHAPES)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_lane_kernel_matches_float64_reference(lanes, stored, n, k, act, rows4):
    """float32 and bf16 activations at 1..64 rows (1..4 per pass, then again), float32 and bf16
    outputs, with a bias, both weight-row passes: within the float32 bound of a K-term sum (the
    kernel sums d (q . x) (+ m sum(x)) per block, see qlinear_avx2.c)."""
    packed, ref = _gguf_packed(stored, n, k, seed=k + 6)
    xl = qlinear.repack(lanes, packed.data, n, k)
    bias = torch.randn(n)
    for m in ROWS:
        x = _x(m, k, act, seed=m)
        scratch = torch.empty(qlinear.scratch_floats(lanes, m, k, act))
        assert scratch.numel() == (2 if act == torch.bfloat16 else 1) * m * k + m * (k // 32)
        for out_dtype in (torch.float32, torch.bfloat16):
            y = torch.empty(m, n, dtype=out_dtype)
            qlinear.linear(lanes, xl, n, k, x, y, scratch, bias)
            _check(y, x, ref, bias, f"{lanes} ({n}x{k}) x {act} at {m} rows -> {out_dtype}, {rows4}")


@pytest.mark.parametrize(("lanes", "stored"), LANES)
def test_lane_layout_without_scratch_is_refused(lanes, stored):
    """The lane order of the activations lives in the caller's scratch: none is an error that says
    so, not a write through a null pointer (checked in Python, and by the kernel for its C callers)."""
    packed, _ = _gguf_packed(stored, 8, 256, seed=12)
    xl = qlinear.repack(lanes, packed.data, 8, 256)
    with pytest.raises(ValueError, match="scratch"):
        qlinear.linear(lanes, xl, 8, 256, _x(1, 256, torch.float32), torch.empty(1, 8), None)
    lib = qlinear._lib_or_raise()
    x, y = _x(1, 256, torch.float32), torch.empty(1, 8)
    assert lib.qlinear(qlinear.FORMAT_IDS[lanes], xl.data_ptr(), 8, 256, x.data_ptr(), 0, 1, None, None,
                       y.data_ptr(), 0, 1) == 1


@pytest.mark.parametrize(("lanes", "stored"), LANES)
@pytest.mark.parametrize("batched", ["resident", "tile"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_layer_re_lays_blocks_in_the_avx2_build(lanes, stored, batched, act, monkeypatch):
    """In the AVX2 build a layer keeps its Q4_1 / Q8_0 blocks re-laid (the same bytes) whether its
    GEMM reads a resident copy or widens a tile per call, and PHASELAB_Q4_REPACK=0 keeps the file's;
    every way, the layer computes the reference at every row count, the tile in one piece and in
    chunks."""
    from phaselab.model import linear

    feats = qlinear.features()
    if not feats["avx2"] or (act == torch.bfloat16 and feats["avx512_bf16_dot"]):
        pytest.skip("the lane layouts are the AVX2 build's; this build is "
                    f"{'AVX-512' if feats['avx512'] else 'portable'} (tests/test_kernel_isa.py builds AVX2 here)")
    n, k = 45, 576
    packed, ref = _gguf_packed(stored, n, k, seed=13)
    bias = torch.randn(n)
    for env, want in (("1", lanes), ("0", stored)):
        monkeypatch.setenv(envs.Q4_REPACK.name, env)
        layer = PackedLinear(packed, bias, act, max_native_rows=8, workspace=Workspace(act), batched=batched)
        assert layer.packed.fmt == want and layer.packed.nbytes == packed.nbytes
        for tile_elements in (linear.TILE_ELEMENTS, 7 * k):
            monkeypatch.setattr(linear, "TILE_ELEMENTS", tile_elements)
            for m in (1, 5, 8, 9, 33):
                x = _x(m, k, act, seed=400 + m)
                w = ref if act == torch.float32 or m <= 8 else ref.to(torch.bfloat16).double()
                b = bias if act == torch.float32 or m <= 8 else bias.to(torch.bfloat16)
                _check(layer(x), x, w, b, f"{batched} {act} layer ({want}, tile {tile_elements}) at {m} rows")


needs_amx = pytest.mark.skipif(not qlinear.features()["amx"],
                               reason="this CPU (or the kernel build, or Linux) has no AMX tiles: the AMX path is not built or not granted")
AMX_SHAPES = ((37, 96), (16, 544), (40, 1184), (21, 2080))  # short strips, Q4_1X tail blocks, several 512-column passes


@needs_amx
@pytest.mark.parametrize("fmt", QUANT + ("Q4_1X", "BF16"))
@pytest.mark.parametrize(("n", "k"), AMX_SHAPES)
def test_amx_path_matches_float64_reference_of_bf16_weights(fmt, n, k):
    """From amx_min rows, bf16 activations run on AMX tiles against weights widened and rounded to
    bf16 (as the GEMM path of larger row counts rounds them): the float64 product with torch's bf16
    rounding of the reference weights, within the float32 bound of a K-term sum; 1..70 rows (past
    the 64 rows of one widening: a second pass). That the AMX path ran shows in the result: it is
    that bf16 reference, not the exact one the dot-product path meets."""
    stored = "Q4_1" if fmt == "Q4_1X" else fmt
    packed, ref = (_gguf_packed if stored in QUANT else _dense_packed)(stored, n, k, seed=k + n)
    w = qlinear.repack("Q4_1X", packed.data, n, k) if fmt == "Q4_1X" else packed.data
    ref_bf16 = ref.to(torch.bfloat16).double()
    bias = torch.randn(n)
    for m in ROWS + [65, 70]:
        x = _x(m, k, torch.bfloat16, seed=m + 7)
        scratch = _scratch(fmt, m, k, torch.bfloat16)
        for out_dtype in (torch.float32, torch.bfloat16):
            y = torch.empty(m, n, dtype=out_dtype)
            qlinear.set_amx_min(fmt, 1)
            qlinear.linear(fmt, w, n, k, x, y, scratch, bias)
            _check(y, x, ref_bf16, bias, f"AMX {fmt} ({n}x{k}) at {m} rows -> {out_dtype}")
            if stored in QUANT and out_dtype == torch.float32:  # not the exact weights' result
                qlinear.set_amx_min(fmt, qlinear.AMX_OFF)
                exact = torch.empty(m, n)
                qlinear.linear(fmt, w, n, k, x, exact, scratch, bias)
                assert not torch.equal(y, exact), f"AMX {fmt} at {m} rows: the dot-product path ran"


@needs_amx
def test_amx_runs_from_its_row_count():
    """Below amx_min the dot-product path runs (exact weights), from it the AMX one."""
    packed, ref = _gguf_packed("Q8_0", 48, 256, seed=3)
    qlinear.set_amx_min("Q8_0", 4)
    assert qlinear.amx_min("Q8_0") == 4
    for m, path_ref in ((3, ref), (4, ref.to(torch.bfloat16).double())):
        x = _x(m, 256, torch.bfloat16, seed=m)
        y = torch.empty(m, 48)
        qlinear.linear("Q8_0", packed.data, 48, 256, x, y, _scratch("Q8_0", m, 256, torch.bfloat16))
        _check(y, x, path_ref, None, f"Q8_0 at {m} rows (amx_min 4)")


def test_scratch_too_small_is_refused_before_the_kernel_runs():
    """The kernel cannot see the scratch's size: linear() checks it against scratch_floats and says
    what to pass instead of letting the kernel write past it."""
    packed, _ = _gguf_packed("Q8_0", 32, 256, seed=5)
    x = _x(8, 256, torch.bfloat16)
    need = qlinear.scratch_floats("Q8_0", 8, 256, torch.bfloat16)
    assert need > 0
    with pytest.raises(ValueError, match="scratch_floats"):
        qlinear.linear("Q8_0", packed.data, 32, 256, x, torch.empty(8, 32), torch.empty(need - 1))
    qlinear.linear("Q8_0", packed.data, 32, 256, x, torch.empty(8, 32), torch.empty(need))
