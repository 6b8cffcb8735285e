"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

One library (`library.py` builds and loads it, declares every function's signature and checks its
one ABI number) holds: paged decode attention (`paged_decode.c`), which reads each request's K/V in
place through its block table instead of gathering the context into a buffer first; prefill
attention (`prefill_attn.c`), a chunk's causal attention over its whole cached context in bf16 dot
products; the decoder layer's bf16 elementwise glue (`elementwise.c`: residual add + RMSNorm,
SiLU * up, one call each instead of 3-6 torch ops); a decode step's layers in one call
(`decode_layers.c`, bound in `decode_call.py`); and the small-batch linear layers (`qlinear_*.c`,
one file per instruction-set tier, `qlinear.h` the map; bound in `qlinear.py`). All run their work
on `pool.c`, a thread pool whose workers stay awake for a bounded time between calls
(`PHASELAB_POOL_SPIN_US`, default 200 us) and steal chunks, so a decode step's ~120 short calls
neither pay OpenMP's wake-up under OMP_WAIT_POLICY=PASSIVE nor wait at a barrier for a thread the
OS has descheduled. `PHASELAB_POOL=0` runs them on OpenMP's team instead (the measurement is in
benchmarks/RESULTS.md, "Kernel thread pool"). The start-up probes that set the linear kernel's
process-wide thresholds live beside it: `linear_probe.py` (the path and row thresholds, on
`linear_timing.py`) and `prefetch_probe.py` (Q4_1X's prefetch distance).

Why C through ctypes rather than a torch C++ extension: the sources compile in seconds with plain
`cc` (a torch extension takes a minute of header parsing), need no Python headers, and the library
links the OpenMP runtime torch already loaded (`libgomp.so.1`, same SONAME), so the thread count is
torch's (`omp_get_max_threads()`, which `torch.set_num_threads` sets) whether the pool or OpenMP's
team runs the work.

The build (build.py) is cached under `$PHASELAB_CACHE_DIR/kernels`, keyed by the sources, the
compiler, the flags and the CPU's features. `PHASELAB_KERNELS=0` turns the native path off (torch fallback everywhere). When no compiler is
found or the build fails, the fallback is used and the reason is kept in `unavailable_reason()`
(logged once at warning level).
"""

from __future__ import annotations

import ctypes

import torch

import phaselab.model.kernels.library as library
from phaselab import envs
from phaselab.model.kernels.build import ISA_FLAGS, build_key, cache_dir, kernel_isa  # noqa: F401 (re-exported)
from phaselab.model.kernels.decode_call import (  # noqa: F401 (re-exported)
    DECODE_LAYERS_KINDS, DecodeEnds, DecodeLayer, decode_forward, decode_layers, decode_layers_profile, take_step_split)

# PHASELAB_PREFILL_ATTN values -> prefill_attend's `mode` (None: the torch path)
PREFILL_MODES = {"auto": 0, "amx": 4, "dpbf16": 3, "avx512": 1, "c": 2, "torch": None}
# PHASELAB_DECODE_ATTN values -> paged_decode's part kernel (paged_decode_set_mode)
DECODE_MODES = {"auto": 0, "dpbf16": 1, "c": 2}


def _as_set(var: envs.EnvVar) -> str:
    """`var` as set, else its default: here a value set but empty is an error, not the default."""
    value = var.raw()
    return value if value is not None else str(var.default)


def _load() -> ctypes.CDLL | None:
    """The kernel library, or None (library.load)."""
    return library.load()


def pool_address() -> int | None:
    """Address of `phaselab_pool_run` for the kernels, or None: they use OpenMP's team."""
    return library.pool_address()


def pool_description() -> str:
    """One line for config.json and start-up logs: which threads run the kernels, and how they wait."""
    why = library.pool_reason()
    if why is not None and library.load() is None:
        return f"torch only ({why})"
    if why is not None:
        return f"OpenMP's team ({why})"
    spin = _as_set(envs.POOL_SPIN_US)
    return f"phaselab pool (workers spin {spin} us after a call, then sleep; {envs.POOL.name}=0 for OpenMP's team)"


def pool_stats() -> dict[str, int] | None:
    """Counters of this process's pool (None without it): calls pooled / inline, chunks workers ran."""
    if library.pool_address() is None:
        return None
    buf = (ctypes.c_int64 * 5)()
    library.require("pool").phaselab_pool_stats(buf)
    return dict(zip(("calls_pooled", "calls_inline", "chunks_by_workers", "workers", "sleeping"), buf))


def _require(kernel: str) -> ctypes.CDLL:
    """The kernel library, or a RuntimeError naming `kernel` and why it is missing."""
    return library.require(kernel)


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    return library.reason()


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
    lib = _require("paged_decode")
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


def decode_rope_attend(
    qkv: torch.Tensor,  # (B, (H + 2*KVH) * D) bfloat16 or float32: the fused projection's output, rows contiguous
    cos: torch.Tensor,  # (B, D) in qkv's dtype: each row's position (RotaryEmbedding's tables, cast)
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # (2, num_blocks, BS, KVH, D) in qkv's dtype: this layer's cache
    slot_mapping: torch.Tensor,  # (B,) int64
    block_tables: torch.Tensor,  # (B, max_blocks) int64
    seq_lens: torch.Tensor,  # (B,) int64: tokens each row attends to, its own included
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """A decode-only batch's RoPE, K/V write and paged attention in one call: (B, H*D) in qkv's dtype.

    Bit-identical to apply_rope + write_kv + paged_decode (+ the cast to bf16) (paged_decode.c says
    where each rounding happens; tests/test_attention_fused.py compares them). The runner checks
    the dtypes and layout once per step (`AttentionMetadata.fused_decode`), so nothing is checked
    here beyond what the C side refuses.
    """
    lib = _require("paged_decode")
    B = qkv.shape[0]
    _, _, BS, KVH, D = kv_cache.shape
    out = torch.empty((B, num_heads * D), dtype=qkv.dtype)
    kc, vc = kv_cache[0], kv_cache[1]
    fn = lib.decode_rope_attend_f32 if qkv.dtype == torch.float32 else lib.decode_rope_attend
    rc = fn(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(),
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(),
        B, num_heads, KVH, D, BS, scale,
    )
    if rc != 0:
        raise RuntimeError(f"decode_rope_attend failed (code {rc}: 1 = unsupported shape, 2 = out of memory)")
    return out


def decode_features() -> dict[str, bool]:
    """What paged_decode.c's part kernels were compiled with on this CPU (empty without the library)."""
    lib = _load()
    return {} if lib is None else {"avx512_bf16_dot": bool(lib.paged_decode_features() & 1)}


def decode_attn_mode() -> str:
    """The decode attention part kernel `PHASELAB_DECODE_ATTN` asks for.

    auto (default): vdpbf16ps scores where the CPU has AVX512-BF16 and the call qualifies (bf16
    cache, head size 64 or 128, q exactly bf16 as the bf16 model's RoPE leaves it), else the
    portable float32 loops; dpbf16 and c force one (a call dpbf16 cannot take still runs the loops).
    dpbf16 on a build without AVX512-BF16 is an error, not a silent fallback.
    """
    want = _as_set(envs.DECODE_ATTN)
    if want not in DECODE_MODES:
        raise ValueError(f"{envs.DECODE_ATTN.name}={want!r}: use one of {', '.join(DECODE_MODES)}")
    return want


_decode_attn_set: str | None = None


def set_decode_attn(mode: str) -> None:
    """Select paged_decode's part kernel for this process (a DECODE_MODES name)."""
    global _decode_attn_set
    if mode not in DECODE_MODES:
        raise ValueError(f"decode attention {mode!r}: use one of {', '.join(DECODE_MODES)}")
    lib = _load()
    if lib is None:
        return
    if mode == "dpbf16" and not lib.paged_decode_features() & 1:
        raise ValueError(f"{envs.DECODE_ATTN.name}=dpbf16: this CPU's build lacks AVX512-BF16; use auto or c")
    lib.paged_decode_set_mode(DECODE_MODES[mode])
    _decode_attn_set = mode


@library.on_load
def _decode_attn_from_env(lib: ctypes.CDLL) -> None:
    """At load, whoever loads the library first: the decode attention PHASELAB_DECODE_ATTN asks for."""
    set_decode_attn(decode_attn_mode())


def decode_attn_description() -> str:
    """The decode attention path this process runs, for start-up lines and config.json."""
    if _load() is None:
        return "torch"
    mode = _decode_attn_set or "auto"
    if mode == "auto":
        mode = "dpbf16" if decode_features().get("avx512_bf16_dot") else "c"
    return {"dpbf16": "vdpbf16ps scores (bf16 cache)", "c": "float32 loops"}[mode]


def prefill_features() -> dict[str, bool]:
    """What prefill_attn.c was compiled with on this CPU (empty without the library)."""
    lib = _load()
    if lib is None:
        return {}
    f = lib.prefill_attn_features()
    return {"avx512": bool(f & 1), "avx512_bf16_dot": bool(f & 2), "amx": bool(f & 4)}


def prefill_supports(head_dim: int) -> bool:
    """Head sizes prefill_attn.c takes: multiples of 32 up to 256 (64 and 128 have their own copies)."""
    return head_dim % 32 == 0 and 0 < head_dim <= 256


def prefill_mode(head_dim: int = 64) -> int | None:
    """The prefill attention path `PHASELAB_PREFILL_ATTN` asks for: a kernel mode, or None (torch).

    auto (default): AVX512-BF16 dot products where the CPU has them, else AVX-512 float32 FMA, else
    torch (the portable C path measured 4x slower than torch's flash attention: it exists for tests
    and as the reference layout), and torch for a head size the kernel does not take. amx (AMX tiles:
    2.7x faster on an AMX Xeon, opt-in for now, see benchmarks/RESULTS.md), dpbf16, avx512, c, torch
    force one path; one this CPU's build or this head size cannot run is an error, not a
    silent fallback.
    """
    want = _as_set(envs.PREFILL_ATTN)
    if want not in PREFILL_MODES:
        raise ValueError(f"{envs.PREFILL_ATTN.name}={want!r}: use one of {', '.join(PREFILL_MODES)}")
    if want == "torch" or _load() is None:
        return None
    feats = prefill_features()
    if want == "auto" and (not feats["avx512"] or not prefill_supports(head_dim)):
        return None
    if not prefill_supports(head_dim):
        raise ValueError(f"{envs.PREFILL_ATTN.name}={want}: the kernel takes head sizes that are multiples of 32 up to 256, "
                         f"not {head_dim}; use auto or torch")
    if ((want == "dpbf16" and not feats["avx512_bf16_dot"]) or (want == "avx512" and not feats["avx512"])
            or (want == "amx" and not feats["amx"])):
        raise ValueError(f"{envs.PREFILL_ATTN.name}={want}: this CPU's build lacks it ({feats}); use auto, c or torch")
    return PREFILL_MODES[want]


def prefill_attend(
    q: torch.Tensor,  # (n, H, D) bfloat16, rows `q.stride(0)` apart, heads and dims contiguous
    kv_cache: torch.Tensor,  # (2, num_blocks, BS, KVH, D) bfloat16: this layer's cache, the chunk written
    block_table: torch.Tensor,  # (>= ceil((start + n) / BS),) int64: the request's blocks in order
    start: int,  # tokens cached before the chunk: row i is at position start + i
    scale: float,
    mode: int = 0,
    out: torch.Tensor | None = None,  # (n, H, D) bfloat16, contiguous
) -> torch.Tensor:
    """Causal attention of a prefill chunk over its request's whole context, read from the cache."""
    lib = _require("prefill_attend")
    n, H, D = q.shape
    _, _, BS, KVH, Dk = kv_cache.shape
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or Dk != D:
        raise ValueError(f"prefill_attend: q {q.dtype} {tuple(q.shape)}, cache {kv_cache.dtype} {tuple(kv_cache.shape)}")
    if q.stride(2) != 1 or q.stride(1) != D or not kv_cache.is_contiguous() or not block_table.is_contiguous():
        raise ValueError("prefill_attend: q's heads and dims, the cache and the block table must be contiguous")
    if block_table.dtype != torch.int64:
        raise ValueError("prefill_attend: block_table must be int64")
    if out is None:
        out = torch.empty((n, H, D), dtype=torch.bfloat16)
    elif out.shape != (n, H, D) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"prefill_attend: out must be a contiguous bfloat16 {(n, H, D)}, got {out.dtype} {tuple(out.shape)}")
    rc = lib.prefill_attend(
        q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_table.data_ptr(),
        block_table.shape[0], out.data_ptr(), start, n, H, KVH, D, BS, scale, mode,
    )
    if rc != 0:
        raise RuntimeError(f"prefill_attend failed (code {rc}: 1 = unsupported shape or mode, 2 = out of memory)")
    return out


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` (in place; x None: no add), then RMSNorm(residual) * weight, as a new tensor.

    (T, N) bfloat16 or float32, contiguous. Torch's roundings (elementwise.c; in float32 up to the
    order of the sum of squares); for the decoder layer's hot path, so shapes are the caller's to
    get right beyond what is checked here.
    """
    lib = _require("add_rms_norm")
    T, N = residual.shape
    dt = residual.dtype
    if dt not in (torch.bfloat16, torch.float32) or weight.dtype != dt or not residual.is_contiguous() or (
            x is not None and (x.dtype != dt or x.shape != residual.shape or not x.is_contiguous())):
        raise ValueError("add_rms_norm: contiguous (T, N) tensors of one shape and one dtype "
                         "(bfloat16 or float32) expected")
    out = torch.empty_like(residual)
    fn = lib.add_rms_norm_f32 if dt == torch.float32 else lib.add_rms_norm
    fn(None if x is None else x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), T, N, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused (T, 2N) projection, as torch rounds it (float32: up to exp's last
    bits): (T, N) in its dtype."""
    lib = _require("silu_mul")
    T, N2 = gate_up.shape
    if gate_up.dtype not in (torch.bfloat16, torch.float32) or not gate_up.is_contiguous() or N2 % 2:
        raise ValueError("silu_mul: a contiguous bfloat16 or float32 (T, 2N) tensor expected")
    out = torch.empty((T, N2 // 2), dtype=gate_up.dtype)
    fn = lib.silu_mul_f32 if gate_up.dtype == torch.float32 else lib.silu_mul
    fn(gate_up.data_ptr(), out.data_ptr(), T, N2 // 2)
    return out


def to_float(x: torch.Tensor) -> torch.Tensor:
    """x.float() for a contiguous 2-D bf16 tensor (the logits), without waking torch's OpenMP team
    for a few rows (elementwise.c says why); any other tensor goes to torch."""
    lib = _load()
    if lib is None or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        return x.float()
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.bf16_to_f32(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a contiguous 2-D float32 tensor (the greedy pick: the first largest
    value, a NaN counting as the largest, as torch) natively; any other tensor goes to torch."""
    lib = _load()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


def rope_write_kv(
    qkv: torch.Tensor,  # (T, (H + 2*KVH) * D) bfloat16, rows contiguous
    cos: torch.Tensor,  # (T, D) bfloat16
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # (2, num_blocks, BS, KVH, D) bfloat16
    slot_mapping: torch.Tensor,  # (T,) int64
    num_heads: int,
) -> torch.Tensor:
    """RoPE of every row's q and k heads, k and v written to their cache slots: the rotated q,
    (T, H, D) bfloat16. Bit-identical to apply_rope + write_kv (paged_decode.c's rope_row)."""
    lib = _require("rope_write_kv")
    T = qkv.shape[0]
    _, _, _, KVH, D = kv_cache.shape
    q = torch.empty((T, num_heads, D), dtype=torch.bfloat16)
    kc, vc = kv_cache[0], kv_cache[1]
    rc = lib.rope_write_kv(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                           slot_mapping.data_ptr(), q.data_ptr(), T, num_heads, KVH, D)
    if rc != 0:
        raise RuntimeError(f"rope_write_kv failed (code {rc}: 1 = unsupported shape)")
    return q

