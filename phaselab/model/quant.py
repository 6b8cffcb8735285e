"""Weights kept in a storage format: GGUF's quantized blocks, or dense bf16 / fp32 rows.

A `PackedTensor` is a (N, K) weight matrix whose rows are stored one after another in one of

    Q4_0 / Q4_1 / Q8_0   GGML blocks of 32 weights along K (18 / 20 / 34 bytes), uint8 (N, K/32*bytes)
    BF16 / F32           dense (N, K)

Blocks run along K, so rows are independent: fusing q/k/v (concatenating rows) and undoing
llama.cpp's q/k row permutation both work on the packed bytes directly, without dequantizing.
The kernels in `kernels/qlinear_*.c` read these layouts; `phaselab/model/linear.py` builds the layers.

K-quants (Q2_K..Q6_K) and Q5_0/Q5_1 have no native kernel: `from_gguf` dequantizes them and
re-quantizes to Q8_0 blocks (8-bit, one fp16 scale per 32 weights), which adds a rounding of at
most half a step (amax/254 of each block) on top of the file's own. Say `--weights dequantized`
to run those weights exactly as dequantized instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
NATIVE_QUANT = tuple(BLOCK_BYTES)  # kept in their own blocks
REQUANTIZED = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # -> Q8_0 at load
DENSE = {"F32": torch.float32, "BF16": torch.bfloat16}


@dataclass
class PackedTensor:
    fmt: str  # "Q4_1" | "Q4_0" | "Q8_0" | "BF16" | "F32"
    data: torch.Tensor  # uint8 (N, row_bytes) for blocks, bf16/fp32 (N, K) dense; contiguous
    shape: tuple[int, int]  # (N, K), as the HF weight
    source_fmt: str = ""  # the file's storage type when it differs (requantized K-quants)
    # the file's own dequantization (gguf-py), for the torch path: exact even for K-quants
    exact: Callable[[torch.dtype], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PackedTensor:
        """Apply a row permutation (a function of a (N, ...) tensor) to the stored rows."""
        exact = self.exact
        return PackedTensor(self.fmt, fn(self.data).contiguous(), self.shape, self.source_fmt,
                            None if exact is None else (lambda dtype: fn(exact(dtype)).contiguous()))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense (N, K) matrix (torch code, independent of the C kernel)."""
        return dequantize_blocks(self.fmt, self.data, self.shape).to(dtype)


def cat_rows(parts: list[PackedTensor]) -> PackedTensor:
    """Stack the rows of packed tensors of one format (fused q/k/v, gate/up)."""
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot fuse packed tensors of formats {sorted(fmts)} / shapes {[p.shape for p in parts]}")
    data = torch.cat([p.data for p in parts], dim=0).contiguous()
    return PackedTensor(parts[0].fmt, data, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                        "+".join(dict.fromkeys(p.source_fmt for p in parts if p.source_fmt)))


# Blocks re-laid at load for the small-row kernel (kernels/qlinear_*.c): Q4_1 for vdpbf16ps (Q4_1X,
# dot_rows_q41x), Q4_1 and Q8_0 for AVX2's float32 FMAs (Q4_1L, Q8_0L: dot_rows_lanes). Same bytes,
# never read from or written to a file.
REPACKED = {"Q4_1X": "Q4_1", "Q4_1L": "Q4_1", "Q8_0L": "Q8_0"}


def row_bytes(fmt: str, k: int) -> int:
    if fmt in DENSE:
        return k * DENSE[fmt].itemsize
    return k // 32 * BLOCK_BYTES[REPACKED.get(fmt, fmt)]


def unpack_q4_1x(data: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_1X rows back to Q4_1 blocks (torch, independent of the C kernel's repack): groups of 16
    blocks hold 8 pairs p of 32 bytes, byte 2b+e's low nibble element 4p+e of block b, its high
    nibble element 4p+2+e; then the nb % 16 tail blocks as Q4_1; then d and m of the groups."""
    n, nb = data.shape[0], k // 32
    ng, nt = nb // 16, nb % 16
    out = torch.empty(n, nb, 20, dtype=torch.uint8)
    if ng:
        g = data[:, :256 * ng].reshape(n, ng, 8, 16, 2).to(torch.int32)  # (n, g, p, b, e)
        lo, hi = g & 0x0F, g >> 4
        el = torch.stack([lo, hi], dim=3)  # (n, g, p, h, b, e): element 4p + 2h + e
        el = el.permute(0, 1, 4, 2, 3, 5).reshape(n, ng * 16, 32)  # (n, block, element)
        qs = (el[..., :16] | (el[..., 16:] << 4)).to(torch.uint8)
        dm = data[:, 256 * ng + 20 * nt:].reshape(n, 2, ng * 16, 2)
        out[:, :16 * ng, 0:2] = dm[:, 0]
        out[:, :16 * ng, 2:4] = dm[:, 1]
        out[:, :16 * ng, 4:] = qs
    if nt:
        out[:, 16 * ng:] = data[:, 256 * ng:256 * ng + 20 * nt].reshape(n, nt, 20)
    return out.reshape(n, nb * 20)


def unpack_lanes(data: torch.Tensor, k: int, fmt: str) -> torch.Tensor:
    """Q4_1L / Q8_0L rows back to Q4_1 / Q8_0 blocks (torch, independent of the C kernel's repack):
    groups of 8 blocks hold their quant bytes interleaved, byte 8c+b being byte c of block b's
    nibbles (Q4_1L: 128 bytes) or int8s (Q8_0L: 256 bytes), then d (and, Q4_1L, m) of the 8
    blocks, fp16 each; then the nb % 8 tail blocks as stored."""
    n, nb = data.shape[0], k // 32
    ng, nt = nb // 8, nb % 8
    bb = BLOCK_BYTES[REPACKED[fmt]]
    nq, head = (16, 4) if fmt == "Q4_1L" else (32, 2)  # quant bytes per block; where they start in it
    out = torch.empty(n, nb, bb, dtype=torch.uint8)
    if ng:
        g = data[:, :8 * bb * ng].reshape(n, ng, 8 * bb)
        qs = g[:, :, :8 * nq].reshape(n, ng, nq, 8).permute(0, 1, 3, 2)  # (n, g, b, c)
        out[:, :8 * ng, head:] = qs.reshape(n, 8 * ng, nq)
        out[:, :8 * ng, 0:2] = g[:, :, 8 * nq:8 * nq + 16].reshape(n, 8 * ng, 2)
        if fmt == "Q4_1L":
            out[:, :8 * ng, 2:4] = g[:, :, 144:160].reshape(n, 8 * ng, 2)
    if nt:
        out[:, 8 * ng:] = data[:, 8 * bb * ng:8 * bb * ng + bb * nt].reshape(n, nt, bb)
    return out.reshape(n, nb * bb)


UNPACK: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "Q4_1X": unpack_q4_1x, "Q4_1L": partial(unpack_lanes, fmt="Q4_1L"), "Q8_0L": partial(unpack_lanes, fmt="Q8_0L")}


def dequantize_blocks(fmt: str, data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """float32 (N, K) from packed rows, vectorized in torch (used at load and as a check)."""
    n, k = shape
    if fmt in DENSE:
        return data.float()
    if fmt in REPACKED:
        data, fmt = UNPACK[fmt](data, k), REPACKED[fmt]
    blocks = data.view(n, k // 32, BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (n, nb, 1)
    if fmt == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, k)
    off = 4 if fmt == "Q4_1" else 2
    qs = blocks[..., off:off + 16]
    q = torch.cat([(qs & 0x0F), (qs >> 4)], dim=-1).float()  # element j low nibble, j+16 high
    if fmt == "Q4_0":
        return (d * (q - 8)).reshape(n, k)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, k)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """ggml's Q8_0 quantization of a float (N, K) matrix (K a multiple of 32) -> uint8 rows."""
    n, k = w.shape
    x = w.float().reshape(n, k // 32, 32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    out[..., 0:2] = d.to(torch.float16).view(torch.uint8)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(n, k // 32 * 34)


def from_gguf(tensor: Any, hf_shape: tuple[int, ...],
              exact: Callable[[torch.dtype], torch.Tensor] | None = None) -> PackedTensor | None:
    """A GGUF matrix kept packed, or None when it is better read dense (1-D, F16/F32/BF16).
    `exact(dtype)`: the loader's own dequantization of this tensor, kept for the torch path."""
    kind = tensor.tensor_type.name
    if len(hf_shape) != 2 or hf_shape[1] % 32 != 0:
        return None
    n, k = int(hf_shape[0]), int(hf_shape[1])
    if kind in NATIVE_QUANT:
        data = torch.from_numpy(np.ascontiguousarray(tensor.data).reshape(n, row_bytes(kind, k)).copy())
        return PackedTensor(kind, data, (n, k), exact=exact)
    if kind in REQUANTIZED:
        from gguf import quants

        dense = torch.from_numpy(np.asarray(quants.dequantize(tensor.data, tensor.tensor_type)).reshape(n, k))
        return PackedTensor("Q8_0", quantize_q8_0(dense), (n, k), source_fmt=kind, exact=exact)
    return None


def to_dense_format(p: PackedTensor, fmt: str) -> PackedTensor:
    """The same weight as dense BF16 or F32 rows (the bf16 / fp32 kernel paths)."""
    return PackedTensor(fmt, p.dequantize(DENSE[fmt]).contiguous(), p.shape, p.source_fmt or p.fmt)
