"""ctypes binding of `qlinear.c`: small-batch linear layers over weights as stored (F32, BF16, Q8_0,
Q4_0, Q4_1), and row dequantization for the GEMM path and embedding lookups.

Built and cached like `paged_decode.c` (see `kernels/__init__.py`); `PHASELAB_KERNELS=0` turns it
off too, and then every linear layer runs through torch on dequantized weights.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from phaselab.model import kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qlinear.c")
FORMAT_IDS = {"F32": 0, "BF16": 1, "Q8_0": 2, "Q4_0": 3, "Q4_1": 4}
_ABI = 2

_lib: ctypes.CDLL | None = None
_tried = False
_reason: str | None = None


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _reason
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PHASELAB_KERNELS", "1") == "0":
        _reason = "turned off by PHASELAB_KERNELS=0"
        return None
    cc = kernels._compiler()
    if cc is None:
        _reason = "no C compiler found (set CC, or install gcc: apt-get install gcc)"
        return None
    try:
        lib = ctypes.CDLL(str(kernels._build(cc, SOURCE)))
        if lib.qlinear_abi() != _ABI:
            raise RuntimeError("stale kernel library (ABI mismatch); delete " + str(kernels.cache_dir()))
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.qlinear.restype = ci
        lib.qlinear.argtypes = [ci, vp, i64, i64, vp, ci, i64, vp, vp, vp, ci, ci]
        lib.dequant_rows.restype = ci
        lib.dequant_rows.argtypes = [ci, vp, i64, i64, vp, i64, vp, ci]
        lib.qlinear_set_pool.argtypes = [vp]
        lib.qlinear_set_pool(kernels.pool_address())
        _lib = lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _reason = f"the qlinear kernel could not be built: {e}"
        log.warning("phaselab: linear layers fall back to torch (%s)", _reason)
    return _lib


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def build_id() -> str:
    """Names this build (source, compiler, flags, CPU, and the threads that run it: the pool or
    OpenMP's team, whose speeds differ): the key of cached probe results."""
    cc = kernels._compiler() or "none"
    runner = "team" if kernels.pool_address() is None else "pool-" + kernels.build_key(kernels.POOL_SOURCE, cc)[:8]
    return kernels.build_key(SOURCE, cc) + "-" + runner


def features() -> dict[str, bool]:
    """What the compiled kernel uses on this CPU: AVX-512 intrinsics, vdpbf16ps."""
    lib = _load()
    f = lib.qlinear_features() if lib is not None else 0
    return {"avx512": bool(f & 1), "avx512_bf16_dot": bool(f & 2)}


def _lib_or_raise() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"qlinear kernel unavailable: {_reason}; run with --weights dequantized")
    return lib


def linear(fmt: str, w: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor,
           scratch: torch.Tensor | None, bias: torch.Tensor | None = None, use_dp: bool = True) -> torch.Tensor:
    """out (M, N) = x (M, K) W^T + bias, W in `fmt` as stored in `w` (contiguous).

    x and out: contiguous float32 or bfloat16. scratch: float32 with >= M*K elements, needed when
    x is bf16 (widened there once). bias: float32 (N,) or None. No checks beyond the cheap ones:
    the layer modules in `phaselab/model/linear.py` own the shapes.
    """
    m = x.shape[0]
    x_bf16 = x.dtype == torch.bfloat16
    rc = _lib_or_raise().qlinear(
        FORMAT_IDS[fmt], w.data_ptr(), n, k, x.data_ptr(), int(x_bf16), m,
        scratch.data_ptr() if scratch is not None else None,
        bias.data_ptr() if bias is not None else None, out.data_ptr(), int(out.dtype == torch.bfloat16), int(use_dp),
    )
    if rc != 0:
        raise RuntimeError(f"qlinear failed for {fmt} weight ({n}, {k}) and {m} rows (unsupported shape)")
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
