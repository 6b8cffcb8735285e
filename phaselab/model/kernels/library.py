"""The one native kernel library: every C source of this package compiled into one shared object
(build.py: the compiler, the flags, the cache), loaded once with ctypes, every function's signature
declared here, and one ABI number checked (`phaselab_kernel_abi` in paged_decode.c).

The sources, one job each (each file's opening comment says more):

    paged_decode.c      decode attention over the paged cache; RoPE + K/V write (+ the ABI number)
    prefill_attn.c      a prefill chunk's causal attention over its cached context
    elementwise.c       the decoder layer's bf16 / float32 glue: add + RMSNorm, SiLU * up, argmax
    decode_layers.c     a decode step's layers, or its whole forward, in one call
    pool.c              the thread pool every kernel runs its chunks on
    qlinear_*.c         the small-batch linear layers, per instruction-set tier (qlinear.h: the map)

Loading also applies the process-wide settings read from the environment: the pool (PHASELAB_POOL,
PHASELAB_POOL_SPIN_US) handed to every kernel, AMX off (PHASELAB_AMX=0); and then runs the hooks
the binding modules registered with `on_load` (the decode attention mode). Nothing here imports the
package's other modules: `kernels/__init__.py`, `qlinear.py` and `decode_call.py` import this one.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

import phaselab.model.kernels.build as build
from phaselab import envs

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
QLINEAR_SOURCES = tuple(_HERE / f"qlinear_{part}.c"
                        for part in ("entry", "avx512", "amx", "avx2", "portable", "layouts"))
SOURCES = (*(_HERE / f for f in ("paged_decode.c", "prefill_attn.c", "elementwise.c", "decode_layers.c", "pool.c")),
           *QLINEAR_SOURCES)
HEADERS = tuple(_HERE / h for h in ("simd.h", "qlinear.h", "qlinear_avx512.h", "qlinear_avx2.h"))  # for the build key
NAME = "phaselab_kernels"
ABI = 13
QLINEAR_FORMATS = 8  # qlinear.h's formats (FMT_LAST + 1): qlinear.FORMAT_IDS names them
AMX_OFF = 1 << 30  # an amx_min no call reaches

_lib: ctypes.CDLL | None = None
_tried = False
_reason: str | None = None
_pool_on = False
_hooks: list[Callable[[ctypes.CDLL], None]] = []


def on_load(hook: Callable[[ctypes.CDLL], None]) -> Callable[[ctypes.CDLL], None]:
    """Run `hook(lib)` once the library is loaded (at once if it already is)."""
    _hooks.append(hook)
    if _lib is not None:
        hook(_lib)
    return hook


def build_key() -> str:
    """Names this build: the sources and headers, the compiler, the flags and the CPU (build.build_key)."""
    return build.build_key((*SOURCES, *HEADERS), build.compiler() or "none")


def _spin_us() -> int:
    spin = envs.POOL_SPIN_US.raw()
    spin = spin if spin is not None else str(envs.POOL_SPIN_US.default)  # set but empty: an error
    try:
        return int(spin)
    except ValueError:
        raise ValueError(f"{envs.POOL_SPIN_US.name} must be a whole number of microseconds, got {spin!r}") from None


def load() -> ctypes.CDLL | None:
    """The library (built on first use), or None: the torch fallback everywhere (`reason()` says why)."""
    global _lib, _tried, _reason, _pool_on
    if _tried:
        return _lib
    pool_on = not envs.POOL.off()
    spin_us = _spin_us() if pool_on and not envs.KERNELS.off() else 0  # a bad value: an error each time
    _tried = True
    if envs.KERNELS.off():
        _reason = f"turned off by {envs.KERNELS.name}=0"
    else:
        cc = build.compiler()
        if cc is None:
            _reason = "no C compiler found (set CC, or install gcc: apt-get install gcc)"
        else:
            try:
                lib = ctypes.CDLL(str(build.build(cc, (*SOURCES, *HEADERS), name=NAME)))
                if lib.phaselab_kernel_abi() != ABI:
                    raise RuntimeError("stale kernel library (ABI mismatch); delete " + str(build.cache_dir()))
                _declare(lib)
                pool = ctypes.cast(lib.phaselab_pool_run, ctypes.c_void_p).value if pool_on else None
                if pool_on:
                    lib.phaselab_pool_set_spin_us(spin_us)
                for set_pool in (lib.paged_decode_set_pool, lib.prefill_attn_set_pool, lib.elementwise_set_pool,
                                 lib.qlinear_set_pool):
                    set_pool(pool)
                if envs.AMX.off():
                    for fmt in range(QLINEAR_FORMATS):
                        lib.qlinear_set_amx_min(fmt, AMX_OFF)
                _lib, _pool_on = lib, pool_on
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _reason = f"native kernels could not be built: {e}"
    if _lib is None:
        log.warning("phaselab: native kernels unavailable, torch fallback everywhere (%s)", _reason)
        return None
    for hook in _hooks:
        hook(_lib)
    return _lib


def reason() -> str | None:
    """Why `load()` gives None (None when it gives the library)."""
    load()
    return _reason


def require(kernel: str) -> ctypes.CDLL:
    """The library, or a RuntimeError naming `kernel` and why it is missing."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"{kernel} kernel unavailable: {_reason}")
    return lib


def pool_address() -> int | None:
    """Address of `phaselab_pool_run` as the kernels were handed it, or None: they use OpenMP's team."""
    lib = load()
    return ctypes.cast(lib.phaselab_pool_run, ctypes.c_void_p).value if lib is not None and _pool_on else None


def pool_reason() -> str | None:
    """Why the kernels run without the pool (None when they run on it)."""
    if load() is None:
        return f"no native kernels: {envs.KERNELS.name}=0" if envs.KERNELS.off() else f"no native kernels: {_reason}"
    return None if _pool_on else f"turned off by {envs.POOL.name}=0"


def _declare(lib: ctypes.CDLL) -> None:
    """Every exported function's argument and result types (ctypes' default: int arguments and result)."""
    vp, i64, ci, cf = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

    def sig(fn, restype, argtypes) -> None:  # type: ignore[no-untyped-def]
        fn.restype, fn.argtypes = restype, argtypes

    # paged_decode.c, prefill_attn.c
    sig(lib.paged_decode, ci, [vp] * 3 + [ci, vp, i64, vp, vp] + [i64] * 5 + [cf])
    sig(lib.decode_rope_attend, ci, [vp, i64, vp, vp, vp, vp, vp, vp, i64, vp, vp] + [i64] * 5 + [cf])
    sig(lib.decode_rope_attend_f32, ci, lib.decode_rope_attend.argtypes)
    sig(lib.rope_write_kv, ci, [vp, i64, vp, vp, vp, vp, vp, vp] + [i64] * 4)
    sig(lib.prefill_attend, ci, [vp, i64, vp, vp, vp, i64, vp] + [i64] * 6 + [cf, ci])
    sig(lib.paged_decode_set_mode, None, [ci])
    sig(lib.paged_decode_features, ci, [])
    sig(lib.prefill_attn_features, ci, [])
    # elementwise.c
    for fn in (lib.add_rms_norm, lib.add_rms_norm_f32):
        sig(fn, ci, [vp] * 4 + [i64, i64, cf])
    for fn in (lib.silu_mul, lib.silu_mul_f32, lib.bf16_to_f32, lib.argmax_rows):
        sig(fn, ci, [vp, vp, i64, i64])
    # decode_layers.c
    sig(lib.decode_layers, ci, [vp, i64, i64, ci] + [vp] * 6 + [i64, i64] + [vp, vp, i64, vp] + [i64] * 4 + [cf] * 2)
    sig(lib.decode_forward, ci,
        [vp, i64, vp, i64, ci, vp, vp, vp, vp, i64, i64, vp, vp, i64, vp] + [i64] * 4 + [cf] * 2)
    sig(lib.decode_layers_profile, None, [ci, vp])
    # pool.c
    sig(lib.phaselab_pool_set_spin_us, None, [i64])
    sig(lib.phaselab_pool_stats, None, [vp])
    for fn in (lib.paged_decode_set_pool, lib.prefill_attn_set_pool, lib.elementwise_set_pool, lib.qlinear_set_pool):
        sig(fn, None, [vp])
    # qlinear_entry.c, qlinear_layouts.c
    sig(lib.qlinear, ci, [ci, vp, i64, i64, vp, ci, i64, vp, vp, vp, ci, ci])
    sig(lib.dequant_rows, ci, [ci, vp, i64, i64, vp, i64, vp, ci])
    sig(lib.kernel_order_x, ci, [ci, vp, i64, i64, vp])
    sig(lib.dequant_kernel_order, ci, [ci, vp, i64, i64, vp, ci])
    sig(lib.qlinear_repack, ci, [ci, vp, i64, i64, vp])
    sig(lib.qlinear_set_rows4_min, None, [ci, ci])
    sig(lib.qlinear_rows4_min, ci, [ci])
    sig(lib.qlinear_set_prefetch, None, [i64])
    sig(lib.qlinear_prefetch, i64, [])
    sig(lib.qlinear_set_amx_min, None, [ci, ci])
    sig(lib.qlinear_amx_min, ci, [ci])
    sig(lib.qlinear_scratch_floats, i64, [ci, i64, i64, ci])
    sig(lib.qlinear_features, ci, [])
