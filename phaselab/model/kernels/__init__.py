"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

One kernel so far: paged decode attention (`paged_decode.c`), which reads each request's K/V in
place through its block table instead of gathering the context into a buffer first.

Why C through ctypes rather than a torch C++ extension: the file compiles in about a second with
plain `cc` (a torch extension takes a minute of header parsing), needs no Python headers, and
the library links the OpenMP runtime torch already loaded (`libgomp.so.1`, same SONAME), so its
threads are torch's threads under the same `OMP_NUM_THREADS` / `OMP_WAIT_POLICY`.

The build is cached under `$PHASELAB_CACHE_DIR` (default `~/.cache/phaselab`) in `kernels/`,
keyed by the source's hash, the compiler and the CPU's flags; concurrent processes (disaggregated
workers) race safely: each compiles to a private temp file, then renames it into place.
`PHASELAB_KERNELS=0` turns the native path off (torch fallback everywhere). When no compiler is
found or the build fails, the fallback is used and the reason is kept in `unavailable_reason()`
(logged once at warning level).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
# The parts of -ffast-math that let the compiler vectorize the reductions, spelled out: -ffast-math
# itself (like -Ofast and -funsafe-math-optimizations) makes gcc link crtfastmath.o into the shared
# object, whose constructor sets flush-to-zero / denormals-are-zero for the WHOLE process on load,
# changing torch's and numpy's arithmetic too (tests/test_kernels.py checks that loading keeps them).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC", "-mprefer-vector-width=512"]
_ABI = 1

_lib: ctypes.CDLL | None = None
_tried = False
_reason: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("PHASELAB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "phaselab")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_key(source: Path, cc: str) -> str:
    """Hash of what decides a build: the source, the compiler, the flags and the CPU's features."""
    src = source.read_bytes()
    return hashlib.sha256(src + cc.encode() + " ".join(_FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]


def _build(cc: str, source: Path = _SOURCE) -> Path:
    out = cache_dir() / f"{source.stem}-{build_key(source, cc)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key yields the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _reason
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PHASELAB_KERNELS", "1") == "0":
        _reason = "turned off by PHASELAB_KERNELS=0"
        return None
    cc = _compiler()
    if cc is None:
        _reason = "no C compiler found (set CC, or install gcc: apt-get install gcc)"
    else:
        try:
            lib = ctypes.CDLL(str(_build(cc)))
            if lib.phaselab_kernel_abi() != _ABI:
                raise RuntimeError("stale kernel library (ABI mismatch); delete " + str(cache_dir()))
            f = lib.paged_decode
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                  ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_float]
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _reason = f"native kernels could not be built: {e}"
    if _lib is None:
        log.warning("phaselab: using the torch attention fallback (%s)", _reason)
    return _lib


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def supports(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in (torch.float32, torch.bfloat16) and available()


def paged_decode(
    q: torch.Tensor,  # (B, H, D) float32, contiguous
    k_cache: torch.Tensor,  # (num_blocks, BS, KVH, D) float32 or bfloat16, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int64
    seq_lens: torch.Tensor,  # (B,) int64
    scale: float,
    out: torch.Tensor | None = None,  # (B, H, D) float32
) -> torch.Tensor:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"paged_decode kernel unavailable: {_reason}")
    B, H, D = q.shape
    _, BS, KVH, Dk = k_cache.shape
    if q.dtype != torch.float32 or Dk != D or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"paged_decode: q {q.dtype} {tuple(q.shape)}, cache {k_cache.dtype} {tuple(k_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not t.is_contiguous():
            raise ValueError(f"paged_decode: {name} must be contiguous")
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise ValueError("paged_decode: block_tables and seq_lens must be int64")
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32)
    rc = lib.paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(),
        B, H, KVH, D, BS, scale,
    )
    if rc != 0:
        raise RuntimeError(f"paged_decode kernel failed (code {rc}: 1 = unsupported shape, 2 = out of memory)")
    return out
