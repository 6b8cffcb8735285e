"""Linear layers over weights as stored, and the choice of path for a model.

Four paths run a model's linear layers (`PATHS`):

    q      GGUF blocks kept as in the file (Q4_0/Q4_1/Q8_0; K-quants re-quantized to Q8_0),
           dequantized in registers by kernels/qlinear_*.c for small row counts (Q4_1 re-laid
           at load as Q4_1X for vdpbf16ps with bf16 activations, as Q4_1L for AVX2's float32
           FMAs: qlinear.native_format)
    bf16   weights as dense bf16 rows, the same native kernel (vdpbf16ps on bf16 activations
           where the CPU has AVX512-BF16, FMA on widened weights otherwise)
    fp32   weights as dense fp32 rows, the same native kernel
    torch  today's nn.Linear on weights dequantized to the engine dtype (torch's BLAS / oneDNN)

On the native paths a layer runs the kernel for up to `max_native_rows` activation rows (decode
batches). Above that (batched decode, prefill) it calls torch's GEMM on a dense weight in the
engine dtype, held one of two ways (`BATCHED`):

    tile      widened from the stored blocks at every call into a tile buffer shared by all
              layers, in row chunks so the tile stays a few MB: no memory beyond the blocks, and
              the GEMM then reads the tile from cache (the step reads 0.6 bytes per weight from
              memory, not 2)
    resident  widened once at load and kept beside the blocks (the bundled model: +269 MB in
              bf16): small batches still stream the blocks, large ones run the GEMM directly;
              kept only where it measures faster (linear_probe.py)

When the stored format already is the engine dtype the GEMM reads the weight directly (no copy).

Activations and outputs stay in the engine dtype; sums run in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phaselab import envs
from phaselab.model import hugepages
from phaselab.model.kernels import qlinear
from phaselab.model.quant import DENSE, PackedTensor, cat_rows, to_dense_format

PATHS = ("q", "bf16", "fp32", "torch")
BATCHED = ("tile", "resident")
TILE_ELEMENTS = 4 * 2**20  # the GEMM path widens at most this many weights at a time
DEFAULT_MAX_NATIVE_ROWS = 16


class Workspace:
    """Buffers shared by every layer of one model (layers run one after another)."""

    def __init__(self, act_dtype: torch.dtype) -> None:
        self.act_dtype = act_dtype
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._tile = torch.empty(0, dtype=act_dtype)

    def scratch(self, n: int) -> torch.Tensor:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        return self._scratch

    def tile(self, n: int) -> torch.Tensor:
        if self._tile.numel() < n:
            self._tile = torch.empty(n, dtype=self.act_dtype)
        return self._tile[:n]


# bumped whenever any layer's max_native_rows is set: a model caches the smallest over its layers
# (LlamaForCausalLM.native_rows) without walking 121 modules per decode step
native_rows_version = 0


class PackedLinear(nn.Module):
    """y = x W^T + b with W a PackedTensor. W is a plain attribute, not a Parameter, so
    `module.to(dtype)` / `to_empty` leave the stored format alone."""

    @property
    def max_native_rows(self) -> int:
        return self._max_native_rows

    @max_native_rows.setter
    def max_native_rows(self, rows: int) -> None:
        global native_rows_version
        self._max_native_rows = rows
        native_rows_version += 1

    def __init__(self, packed: PackedTensor, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 max_native_rows: int, workspace: Workspace, batched: str = "tile") -> None:
        super().__init__()
        self.packed = packed
        self.out_features, self.in_features = packed.shape
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self.bias_act = None if bias is None else bias.detach().to(act_dtype).contiguous()
        self.act_dtype = act_dtype
        self.max_native_rows = max_native_rows
        self.ws = workspace
        assert batched in BATCHED, batched
        # the dense weight the GEMM reads above max_native_rows: the stored one when it already is
        # in the engine dtype, else a resident copy (batched="resident") or None (widened per call)
        self.direct = packed.data if DENSE.get(packed.fmt) == act_dtype else None
        self.resident_bytes = 0
        if self.direct is None and batched == "resident":
            n, k = packed.shape
            self.direct = qlinear.dequant(packed.fmt, packed.data, n, k, torch.empty((n, k), dtype=act_dtype))
            self.resident_bytes = self.direct.numel() * self.direct.element_size()
        # The blocks in the layout the small-row kernel reads fastest (Q4_1 -> Q4_1X for bf16
        # activations with AVX512-BF16, Q4_1L in the AVX2 build); the tile GEMM then widens Q4_1X
        # in that layout's column order and permutes its activations to match
        # (qlinear.kernel_order), Q4_1L back into the file's order.
        layout = qlinear.native_format(packed.fmt, act_dtype)
        if layout != packed.fmt:
            n, k = packed.shape
            self.packed = PackedTensor(layout, qlinear.repack(layout, packed.data, n, k), packed.shape,
                                       packed.source_fmt)

    def extra_repr(self) -> str:
        batched = "direct" if self.resident_bytes == 0 and self.direct is not None else (
            "resident" if self.direct is not None else "tile")
        return (f"{self.in_features} -> {self.out_features}, {self.packed.fmt}, native <= {self.max_native_rows} rows, "
                f"GEMM on {batched} weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if 0 < m <= self.max_native_rows:
            x2 = x2.contiguous()
            out = torch.empty((m, self.out_features), dtype=x.dtype)
            need = qlinear.scratch_floats(self.packed.fmt, m, k, x.dtype)
            scratch = self.ws.scratch(need) if need else None
            qlinear.linear(self.packed.fmt, self.packed.data, self.out_features, k, x2, out, scratch, self.bias_f32)
        elif self.direct is not None and x.dtype == self.direct.dtype:
            out = F.linear(x2, self.direct, self.bias_act)
        else:
            out = self._tiled_gemm(x2)
        return out.view(*lead, self.out_features)

    def _tiled_gemm(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.packed.shape
        chunk = max(1, min(n, TILE_ELEMENTS // k))
        fmt, data = self.packed.fmt, self.packed.data
        relaid = qlinear.kernel_order(fmt, k) is not None  # Q4_1X widens in its own column order
        if relaid:  # the tile's columns come in the layout's order (qlinear.kernel_order): so do x's
            x = qlinear.to_kernel_order(fmt, x.contiguous())

        def widen(rows_data: torch.Tensor, rows: int, tile: torch.Tensor) -> None:
            if not relaid:
                qlinear.dequant(fmt, rows_data, rows, k, tile)
            else:
                qlinear.dequant_kernel_order(fmt, rows_data, rows, k, tile)

        if chunk >= n:
            tile = self.ws.tile(n * k).view(n, k)
            widen(data, n, tile)
            return F.linear(x.to(tile.dtype), tile, self.bias_act).to(x.dtype)
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        xa = x.to(self.ws.act_dtype)
        for n0 in range(0, n, chunk):
            rows = min(chunk, n - n0)
            tile = self.ws.tile(rows * k).view(rows, k)
            widen(data[n0:n0 + rows], rows, tile)
            bias = None if self.bias_act is None else self.bias_act[n0:n0 + rows]
            out[:, n0:n0 + rows] = F.linear(xa, tile, bias)
        return out


class PackedEmbedding(nn.Module):
    """Embedding lookup from packed rows: only the looked-up rows are widened."""

    def __init__(self, packed: PackedTensor, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.shape
        self.act_dtype = act_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], self.embedding_dim), dtype=self.act_dtype)
        qlinear.dequant(self.packed.fmt, self.packed.data, self.num_embeddings, self.embedding_dim, out, idx=flat)
        return out.view(*ids.shape, self.embedding_dim)


# -- installing a path into a model -------------------------------------------------------------

def _linear_names(config: Any) -> list[tuple[str, list[str], str | None]]:
    """(module path, HF weight names fused into it, HF bias names' common suffix or None)."""
    from phaselab.model.llama import has_o_proj_bias

    out = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = [a + "q_proj", a + "k_proj", a + "v_proj"]
        out.append((a + "qkv_proj", qkv, "bias" if config.attention_bias else None))
        out.append((a + "o_proj", [a + "o_proj"], "bias" if has_o_proj_bias(config) else None))
        out.append((p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], None))
        out.append((p + "mlp.down_proj", [p + "mlp.down_proj"], None))
    return out


def _as_format(w: torch.Tensor | PackedTensor, path: str, act_dtype: torch.dtype) -> PackedTensor:
    """A weight in the stored format of `path` (q keeps blocks; dense tensors go to the act dtype)."""
    dense_fmt = {"bf16": "BF16", "fp32": "F32"}.get(path) or ("BF16" if act_dtype == torch.bfloat16 else "F32")
    if isinstance(w, PackedTensor):
        if path == "q" and w.fmt not in DENSE:
            return w
        return w if w.fmt == dense_fmt else to_dense_format(w, dense_fmt)
    return PackedTensor(dense_fmt, w.detach().to(DENSE[dense_fmt]).contiguous(), tuple(w.shape))


def _fuse(parts: list[PackedTensor], path: str, act_dtype: torch.dtype) -> PackedTensor:
    if len(parts) == 1:
        return parts[0]
    if len({p.fmt for p in parts}) > 1:  # e.g. Q4_1 q/k with a Q8_0 v: fuse exactly, in dense rows
        parts = [_as_format(p.dequantize(act_dtype), "torch", act_dtype) for p in parts]
    return cat_rows(parts)


def densify(weights: dict[str, Any], dtype: torch.dtype) -> None:
    """Replace every PackedTensor in `weights` by its dense matrix (the torch path)."""
    for name, w in list(weights.items()):
        if isinstance(w, PackedTensor):
            weights[name] = w.exact(dtype) if w.exact is not None else w.dequantize(dtype)


def install(model: nn.Module, weights: dict[str, Any], path: str, act_dtype: torch.dtype,
            max_native_rows: int = DEFAULT_MAX_NATIVE_ROWS, batched: str = "tile") -> dict[str, Any]:
    """Put `path`'s layers into `model` (built on the meta device, before `to_empty`).

    Linear layers, the embedding and the LM head become Packed* modules holding their weights;
    `load_weights` then fills the remaining (dense) parameters. For "torch", packed weights are
    dequantized in `weights` and the model is left as built. `batched`: how layers hold the dense
    weight of their GEMM above `max_native_rows` (`BATCHED`). Returns a summary for config.json:
    `weight_bytes` is the weights as stored (what a small-batch step reads), `resident_bytes` the
    dense copies kept for the GEMM, `memory_bytes` both.
    """
    config = model.config
    if path == "torch":
        densify(weights, act_dtype)
        return {"path": "torch", "weight_bytes": sum(w.numel() * w.element_size() for w in weights.values())}
    ws = Workspace(act_dtype)
    formats: dict[str, int] = {}
    layouts: dict[str, int] = {}  # blocks re-laid for the small-row kernel (qlinear.native_format)
    total = resident = 0
    for module_path, names, bias_suffix in _linear_names(config):
        packed = _fuse([_as_format(weights[n + ".weight"], path, act_dtype) for n in names], path, act_dtype)
        bias = None
        if bias_suffix:
            bias = torch.cat([weights[n + "." + bias_suffix].float() for n in names])
        parent_name, _, attr = module_path.rpartition(".")
        layer = PackedLinear(packed, bias, act_dtype, max_native_rows, ws, batched)
        setattr(model.get_submodule(parent_name), attr, layer)
        formats[packed.fmt] = formats.get(packed.fmt, 0) + 1
        if layer.packed.fmt != packed.fmt:
            layouts[layer.packed.fmt] = layouts.get(layer.packed.fmt, 0) + 1
        total += packed.nbytes + (0 if bias is None else bias.numel() * 4)
        resident += layer.resident_bytes
    embed = _as_format(weights["model.embed_tokens.weight"], path, act_dtype)
    model.model.embed_tokens = PackedEmbedding(embed, act_dtype)
    total += embed.nbytes
    head_source = embed if config.tie_word_embeddings else _as_format(weights["lm_head.weight"], path, act_dtype)
    if not config.tie_word_embeddings:
        total += head_source.nbytes
        model.lm_head = None  # its weight lives in the packed head below
    model.head = PackedLinear(head_source, None, act_dtype, max_native_rows, ws, batched)
    resident += model.head.resident_bytes
    if model.head.packed is not head_source:
        layouts[model.head.packed.fmt] = layouts.get(model.head.packed.fmt, 0) + 1
        if config.tie_word_embeddings:  # one table: the lookup widens the re-laid rows (C, per row)
            model.model.embed_tokens.packed = model.head.packed
    formats[embed.fmt] = formats.get(embed.fmt, 0) + 1
    huge = _onto_huge_pages(model)
    dense = sum(w.numel() * act_dtype.itemsize for w in weights.values()
                if isinstance(w, torch.Tensor) and w.dim() == 1)
    return {
        "path": path,
        "formats": formats,
        "kernel_layouts": layouts,
        "max_native_rows": max_native_rows,
        "batched": batched,
        "weight_bytes": total + dense,
        # an untied embedding table is only gathered (T rows per pass); the tied one is the head's
        "gathered_bytes": 0 if config.tie_word_embeddings else embed.nbytes,
        "resident_bytes": resident,
        "memory_bytes": total + dense + resident,
        "tied_head": "embedding's packed rows" if config.tie_word_embeddings else "own packed rows",
        "requantized_from": sorted({w.source_fmt for w in weights.values()
                                    if isinstance(w, PackedTensor) and w.source_fmt}),
        "huge_pages": huge,
    }


def _onto_huge_pages(model: nn.Module) -> str:
    """Move every packed weight (and a dense weight a layer's GEMM reads) into one huge-page
    mapping, in the order a step reads them: layer by layer, then the head (hugepages.py says
    why). A tensor two modules share (the tied embedding and head) moves once. Returns what was
    done, for config.json."""
    if not hugepages.enabled():
        return f"off ({envs.HUGEPAGES.name}=0)" if envs.HUGEPAGES.off() else f"off (THP {hugepages.mode()})"
    head = getattr(model, "head", None)
    # the layers in order, then the head, then an untied embedding table (only gathered)
    modules = [m for m in model.modules() if isinstance(m, PackedLinear) and m is not head]
    modules += [head] if isinstance(head, PackedLinear) else []
    modules += [m for m in model.modules() if isinstance(m, PackedEmbedding)]
    tensors: dict[int, torch.Tensor] = {}
    # the packed blocks first (what decode streams), then the dense copies the GEMM reads
    for t in [m.packed.data for m in modules] + [getattr(m, "direct", None) for m in modules]:
        if t is not None and t.is_contiguous():
            tensors.setdefault(t.data_ptr(), t)
    moved = dict(zip(tensors, hugepages.pack(list(tensors.values()))))
    for m in modules:
        if m.packed.data.data_ptr() in moved:
            m.packed = dataclasses.replace(m.packed, data=moved[m.packed.data.data_ptr()])
        direct = getattr(m, "direct", None)
        if direct is not None and direct.data_ptr() in moved:
            m.direct = moved[direct.data_ptr()]
    mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    return f"{mib:.1f} MiB of weights on huge pages (madvise, THP {hugepages.mode()})"
