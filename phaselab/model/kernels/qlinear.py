"""ctypes binding of the linear kernel (`qlinear_*.c`, qlinear.h the map): small-batch linear layers
over weights as stored (F32, BF16, Q8_0, Q4_0, Q4_1, and the layouts re-laid at load: Q4_1X, Q4_1L,
Q8_0L), and row dequantization for the GEMM path and embedding lookups.

In the one kernel library (`library.py` builds and loads it and declares the signatures);
`PHASELAB_KERNELS=0` turns it off too, and then every linear layer runs through torch on
dequantized weights.
"""

from __future__ import annotations

import ctypes
import functools

import torch

import phaselab.model.kernels.library as library
from phaselab import envs

FORMAT_IDS = {"F32": 0, "BF16": 1, "Q8_0": 2, "Q4_0": 3, "Q4_1": 4, "Q4_1X": 5, "Q4_1L": 6, "Q8_0L": 7}
assert len(FORMAT_IDS) == library.QLINEAR_FORMATS
AMX_OFF = library.AMX_OFF  # an amx_min no call reaches
LANES = {"Q4_1": "Q4_1L", "Q8_0": "Q8_0L"}  # the AVX2 build's layouts: a float32 vector lane per block


def _load() -> ctypes.CDLL | None:
    """The kernel library, or None (library.load)."""
    return library.load()


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    return library.reason()


def build_id() -> str:
    """Names this build (sources, compiler, flags, CPU, and the threads that run it: the pool or
    OpenMP's team, whose speeds differ): the key of cached probe results."""
    return library.build_key() + "-" + ("team" if library.pool_address() is None else "pool")


def features() -> dict[str, bool]:
    """What the compiled kernel uses on this CPU: AVX-512 intrinsics, vdpbf16ps, or (without
    AVX-512) AVX2 + FMA + F16C intrinsics; none of them: the portable C loops. amx: AMX tile
    products for batched bf16 rows (the CPU has them, the build uses them, Linux granted them)."""
    lib = _load()
    f = lib.qlinear_features() if lib is not None else 0
    return {"avx512": bool(f & 1), "avx512_bf16_dot": bool(f & 2), "avx2": bool(f & 4), "amx": bool(f & 8)}


def native_format(fmt: str, act_dtype: torch.dtype) -> str:
    """The layout the small-row kernel reads `fmt` fastest in, for activations of `act_dtype`:
    Q4_1 becomes Q4_1X (kernels/qlinear_avx512.c, dot_rows_q41x) for bf16 activations on a CPU with
    AVX512-BF16; in the AVX2 build Q4_1 and Q8_0 become Q4_1L and Q8_0L (dot_rows_lanes: a vector
    lane per block); unless PHASELAB_Q4_REPACK=0. Every other format stays as stored."""
    if fmt not in LANES or envs.Q4_REPACK.off():
        return fmt
    feats = features()
    if fmt == "Q4_1" and act_dtype == torch.bfloat16 and feats["avx512_bf16_dot"]:
        return "Q4_1X"
    if feats["avx2"]:
        return LANES[fmt]
    return fmt


def repack(fmt_to: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q4_1 rows re-laid as `fmt_to` (Q4_1X or Q4_1L), or Q8_0 rows as Q8_0L: a new tensor of the same shape."""
    out = torch.empty_like(data)
    if _lib_or_raise().qlinear_repack(FORMAT_IDS[fmt_to], data.data_ptr(), n, k, out.data_ptr()) != 0:
        raise RuntimeError(f"qlinear_repack failed for a ({n}, {k}) weight to {fmt_to}")
    return out


def scratch_floats(fmt: str, m: int, k: int, x_dtype: torch.dtype) -> int:
    """float32 elements of scratch `linear` needs for m activation rows of `x_dtype` (0: none):
    bf16 rows widened (or permuted, Q4_1X), and a lane layout's lane-ordered rows and block sums."""
    return int(_lib_or_raise().qlinear_scratch_floats(FORMAT_IDS[fmt], m, k, int(x_dtype == torch.bfloat16)))


def _lib_or_raise() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"qlinear kernel unavailable: {library.reason()}; run with --weights dequantized")
    return lib


ROWS4_OFF = 1 << 30  # a rows4_min no call reaches: one weight row at a time at every row count


def set_rows4_min(fmt: str, rows: int) -> None:
    """From how many activation rows the kernel processes four weight rows of `fmt` together (the
    start-up probe decides: linear_timing.rows4_decision; ROWS4_OFF: never; 0: the kernel's built-in default)."""
    _lib_or_raise().qlinear_set_rows4_min(FORMAT_IDS[fmt], int(min(rows, ROWS4_OFF)))


def rows4_min(fmt: str) -> int:
    return int(_lib_or_raise().qlinear_rows4_min(FORMAT_IDS[fmt]))


def set_prefetch(nbytes: int) -> None:
    """How far ahead in the weight stream the Q4_1X kernel prefetches a row (process-wide; the
    engine measures it at start-up: prefetch_probe.choose). 0: the kernel's default."""
    _lib_or_raise().qlinear_set_prefetch(int(nbytes))


def prefetch() -> int:
    return int(_lib_or_raise().qlinear_prefetch())


def set_amx_min(fmt: str, rows: int) -> None:
    """From how many bf16 activation rows the kernel multiplies `fmt` weights with AMX tiles (where
    features()["amx"]; AMX_OFF: never; 0: the kernel's built-in default). PHASELAB_AMX=0 sets AMX_OFF
    for every format at load."""
    _lib_or_raise().qlinear_set_amx_min(FORMAT_IDS[fmt], int(min(rows, AMX_OFF)))


def amx_min(fmt: str) -> int:
    """The row count from which `fmt` runs on AMX; -1 when the build has no AMX path."""
    return int(_lib_or_raise().qlinear_amx_min(FORMAT_IDS[fmt]))


def linear(fmt: str, w: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor,
           scratch: torch.Tensor | None, bias: torch.Tensor | None = None, use_dp: bool = True) -> torch.Tensor:
    """out (M, N) = x (M, K) W^T + bias, W in `fmt` as stored in `w` (contiguous).

    x and out: contiguous float32 or bfloat16. scratch: float32 with >= scratch_floats(...) elements
    (None when that is 0; fewer is a ValueError, as the kernel would write past them). bias: float32 (N,) or None. No checks beyond the cheap ones:
    the layer modules in `phaselab/model/linear.py` own the shapes.
    """
    m = x.shape[0]
    x_bf16 = x.dtype == torch.bfloat16
    lib = _lib_or_raise()
    need = lib.qlinear_scratch_floats(FORMAT_IDS[fmt], m, k, int(x_bf16))
    if need and (scratch is None or scratch.numel() < need):  # the kernel would write past it
        raise ValueError(f"qlinear: {fmt} ({n}, {k}) at {m} {x.dtype} rows needs scratch of {need} float32 "
                         f"elements, got {0 if scratch is None else scratch.numel()}: size it with scratch_floats()")
    rc = lib.qlinear(
        FORMAT_IDS[fmt], w.data_ptr(), n, k, x.data_ptr(), int(x_bf16), m,
        scratch.data_ptr() if scratch is not None else None,
        bias.data_ptr() if bias is not None else None, out.data_ptr(), int(out.dtype == torch.bfloat16), int(use_dp),
    )
    if rc != 0:
        raise RuntimeError(f"qlinear failed for {fmt} weight ({n}, {k}) and {m} rows (unsupported shape)")
    return out


@functools.cache
def kernel_order(fmt: str, k: int) -> torch.Tensor | None:
    """The column order `dequant_kernel_order` widens `fmt` rows into, as source column indices
    (int64, k): activations indexed by it meet the widened tile's columns. None: the file's order."""
    if fmt != "Q4_1X":
        return None
    nb = k // 32
    ng = nb // 16
    col = torch.arange(k)
    if ng:  # position 512 g + 32 t + 2 b + e holds element 2 t + e of block 16 g + b
        g, t, b, e = torch.meshgrid(torch.arange(ng), torch.arange(16), torch.arange(16), torch.arange(2), indexing="ij")
        col[:512 * ng] = ((16 * g + b) * 32 + 2 * t + e).reshape(-1)
    return col


def to_kernel_order(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """bf16 activations (M, K), contiguous, with their columns in `kernel_order(fmt, K)` (a new
    tensor): what x.index_select(1, kernel_order(fmt, K)) gives, without torch's per-call cost."""
    m, k = x.shape
    out = torch.empty_like(x)
    if x.dtype != torch.bfloat16 or _lib_or_raise().kernel_order_x(FORMAT_IDS[fmt], x.data_ptr(), m, k,
                                                                  out.data_ptr()) != 0:
        raise RuntimeError(f"kernel_order_x failed for {fmt} activations {tuple(x.shape)} {x.dtype}")
    return out


def dequant_kernel_order(fmt: str, w: torch.Tensor, n: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """Rows of a Q4_1X W widened into `out` (float32 or bf16) with their columns in `kernel_order`."""
    if _lib_or_raise().dequant_kernel_order(FORMAT_IDS[fmt], w.data_ptr(), n, k, out.data_ptr(),
                                            int(out.dtype == torch.bfloat16)) != 0:
        raise RuntimeError(f"dequant_kernel_order failed for {fmt} weight ({n}, {k})")
    return out


def dequant(fmt: str, w: torch.Tensor, n: int, k: int, out: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of W widened into `out` (float32 or bf16): all N in order, or the rows `idx` (int64)."""
    rows = n if idx is None else idx.shape[0]
    rc = _lib_or_raise().dequant_rows(
        FORMAT_IDS[fmt], w.data_ptr(), n, k, idx.data_ptr() if idx is not None else None, rows,
        out.data_ptr(), int(out.dtype == torch.bfloat16),
    )
    if rc != 0:
        raise RuntimeError(f"dequant_rows failed for {fmt} weight ({n}, {k})")
    return out
