"""The process's runtime settings an engine's speed depends on, applied or read when an engine is
built and recorded with every run (config.json's `machine`): the allocator's thresholds and the
thread settings. Process-wide; the engine layer (reads torch and the kernels' pool)."""

from __future__ import annotations

import os

_ALLOCATOR_TUNED: bool | None = None


def tune_allocator() -> bool:
    """Keep freed activation buffers in the process instead of returning them to the OS.

    glibc serves allocations above 128 KiB with fresh mmap()s and unmaps them on free, so every
    layer of every step page-faults its multi-MB activations in again. Raising the mmap threshold
    to its maximum (32 MiB) and the trim threshold well above it makes them reuse heap memory.
    Process-wide, glibc-only, idempotent; returns whether it applied.
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            m_trim_threshold, m_mmap_threshold = -1, -3
            ok = libc.mallopt(m_mmap_threshold, 32 * 2**20) == 1
            _ALLOCATOR_TUNED = ok and libc.mallopt(m_trim_threshold, 2**30) == 1
        except (OSError, AttributeError):
            _ALLOCATOR_TUNED = False
    return _ALLOCATOR_TUNED



def runtime_settings() -> dict[str, str | int | bool | None]:
    """Thread settings that decide speed on a small shared machine; recorded with every run."""
    import torch

    from phaselab.model import kernels

    return {
        "torch_num_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "kernel_threads": kernels.pool_description(),
        "malloc_tuned": bool(_ALLOCATOR_TUNED),
    }
