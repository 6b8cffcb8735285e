"""Huge pages for the memory a decode step streams: the packed weights and the KV cache.

A batch-1 decode step reads every weight once, in ~120 calls of 0.2-1.1 MB (the bundled model),
then its KV cache. On 4 KiB pages that is ~25,000 pages a step, each a TLB miss and a page walk on
the way: on a 2-core Xeon (THP in `madvise` mode, as many distributions ship it) a synthetic read
of the model's layer shapes in that order streamed at 8-12 GB/s on 4 KiB pages and 21-23 GB/s on
2 MiB pages, against 15-19 GB/s for one long stream (benchmarks/RESULTS.md). torch's allocator
asks for neither, and in `madvise` mode the kernel gives huge pages only where asked.

So the engine puts its weights in one anonymous mapping advised MADV_HUGEPAGE (`pack`), and the KV
cache in another (`zeros`). Both are plain torch tensors over that memory (torch.frombuffer on a
Python mmap, which the tensor keeps alive). Where the OS refuses (THP `never`, no madvise), the
memory is the same, on small pages. PHASELAB_HUGEPAGES=0 turns it off (the "before" of the
benchmark, and a way out should a kernel misbehave).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from phaselab import envs

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20  # the x86-64 transparent huge page
PAGE = 4096  # the small page `populate` touches one byte of


def mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "unsupported"."""
    try:
        text = _THP.read_text()
    except OSError:
        return "unsupported"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unsupported"


def enabled() -> bool:
    """Whether this process asks for huge pages: not turned off by PHASELAB_HUGEPAGES=0, and a
    kernel that can give them."""
    return not envs.HUGEPAGES.off() and hasattr(mmap, "MADV_HUGEPAGE") and mode() in ("always", "madvise")


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` on memory advised for huge pages (see the module
    docstring); torch's own allocation when that is off or refused. Its pages are faulted in here,
    as huge pages where the kernel has them (`populate`), as torch.zeros does by writing them."""
    if nbytes <= 0 or not enabled():
        return torch.zeros(max(nbytes, 0), dtype=torch.uint8)
    size = -(-nbytes // HUGE) * HUGE  # whole huge pages: the tail would fall back to small ones
    try:
        # one huge page more, to start on a 2 MiB boundary where the kernel does not align large
        # anonymous mappings itself (before Linux 6.7)
        m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.zeros(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    return populate(whole[start:start + nbytes])



def populate(t: torch.Tensor) -> torch.Tensor:
    """Fault in every page of `t` (uint8) now, by writing a zero into each 4 KiB page (the first
    write in a 2 MiB range takes a whole huge page, which the kernel zeroes). Left to first touch,
    the KV cache's pages were faulted in by the forwards that first wrote them: an engine's first
    prefill (4 prompts, 256 tokens; bf16, a 256 MiB cache) took 400-440 ms against 150-165 ms for the
    same prefill after it, on 4 KiB pages 150-160 ms both times, and a diagnosis calibrated on such a
    run priced every 256-token iteration at the first one's cost (tests/test_analysis_verify.py's
    stall run: chunking predicted at -42% ITL p99, measured -59%)."""
    if t.numel():
        t[::PAGE].zero_()
    return t


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on huge-page memory (contiguous)."""
    n = 1
    for s in shape:
        n *= s
    return empty_bytes(n * dtype.itemsize).view(dtype).view(shape)


def pack(tensors: list[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous) laid end to end in one huge-page mapping, each `align`-byte
    aligned, in the order given (the order a step reads them, so one stream runs through them):
    views of the same shapes and dtypes. The originals are left to the caller to drop."""
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // align) * align
        offsets.append(total)
        total += t.numel() * t.element_size()
    arena = empty_bytes(total)
    out = []
    for t, off in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        view = arena[off:off + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def huge_bytes() -> int:
    """Anonymous memory of this process on transparent huge pages now (AnonHugePages of
    /proc/self/smaps_rollup; 0 where the file is missing)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
