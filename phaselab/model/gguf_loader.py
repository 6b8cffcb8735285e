"""GGUF (llama.cpp) checkpoints -> Hugging Face names, shapes and layouts.

Three things differ from a Hugging Face checkpoint, and each is undone here:

1. Names: ``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight`` (table below).
2. Shapes: GGUF lists dimensions fastest-first (ggml's ``ne``), the reverse of PyTorch's; a
   matrix stored as ``[in, out]`` is read as HF's row-major ``[out, in]``.
3. Q/K row order (llama/mistral only): llama.cpp's LLAMA RoPE rotates adjacent pairs
   (x0,x1),(x2,x3)..., HF's rotates halves (x0,x32),(x1,x33)... so ``convert_hf_to_gguf.py``
   permutes the rows of q_proj and k_proj (weights and biases) within each head::

       w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)

   with n_head = head_count for q and head_count_kv for k. Qwen2 uses llama.cpp's NEOX RoPE,
   which rotates halves like HF, so its GGUFs are not permuted.

Quantized tensors are dequantized with gguf-py's reference (numpy) kernels, one tensor at a
time, then cast to the requested dtype.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from phaselab.errors import ModelFormatError, UnsupportedModelError
from phaselab.model.checkpoint import LoadedCheckpoint, check_tensor_shapes
from phaselab.modelinfo.gguf import open_gguf, read_gguf_config, read_metadata
from phaselab.modelinfo.tokenizer import Tokenizer, load_tokenizer


def _gguf() -> Any:
    import gguf

    return gguf


SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
# Architectures whose q/k rows llama.cpp's converter permuted (see module docstring).
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# rope_freqs.weight: llama3 RoPE factors precomputed by the converter; the scaling is rebuilt
# from them into ModelConfig.rope_scaling instead (see _rope_scaling).
_NON_WEIGHT_TENSORS = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None when it has no counterpart."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    m = _BLOCK_TENSOR.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def hf_to_gguf_name(name: str) -> str:
    """Inverse of gguf_to_hf_name, for error messages that name the tensor as the file does."""
    for gguf_name, hf_name in _TOP_LEVEL_NAMES.items():
        if name == hf_name:
            return gguf_name
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m:
        for short, hf_short in _BLOCK_NAMES.items():
            if m.group(2) == hf_short:
                return f"blk.{m.group(1)}.{short}.{m.group(3)}"
    return name


def _describe_tensor(hf_name: str) -> str:
    gguf_name = hf_to_gguf_name(hf_name)
    return hf_name if gguf_name == hf_name else f"{hf_name} (GGUF {gguf_name})"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (see module docstring) for a weight or bias."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: Any, hf_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One tensor in the HF shape and ``dtype``. Only this tensor's fp32 copy exists at a time."""
    array = _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:  # F32 comes back as a view of the read-only memory map
        array = array.copy()
    return torch.from_numpy(array.reshape(hf_shape)).to(dtype)


def load_gguf(path: str, dtype: torch.dtype, tokenizer_path: str | None = None,
              keep_packed: bool = False) -> LoadedCheckpoint:
    """Read, check and dequantize a GGUF checkpoint (see module docstring for the conversions).

    keep_packed: quantized matrices stay in their blocks as `quant.PackedTensor`s (the native
    linear path, `phaselab/model/linear.py`) instead of being dequantized here."""
    gguf = _gguf()
    reader = open_gguf(path)
    metadata = read_metadata(reader)
    file_size = os.path.getsize(path)

    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_size:
            raise ModelFormatError(
                f"{path}: tensor {t.name} extends past the end of the file ({t.data_offset + t.n_bytes} > "
                f"{file_size} bytes); the file looks truncated or corrupted, re-download or re-convert it"
            )
    config = read_gguf_config(reader)

    supported = {getattr(gguf.GGMLQuantizationType, n) for n in SUPPORTED_QUANT_TYPES}
    hf_tensors: dict[str, Any] = {}
    for t in reader.tensors:
        if t.name in _NON_WEIGHT_TENSORS:
            continue
        if t.tensor_type not in supported:
            raise UnsupportedModelError(
                f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which phaselab cannot dequantize; "
                f"supported types: {', '.join(SUPPORTED_QUANT_TYPES)}. Re-quantize the model to one of them "
                "(e.g. llama-quantize ... Q4_K_M)"
            )
        hf_name = gguf_to_hf_name(t.name)
        hf_tensors[hf_name if hf_name is not None else t.name] = t
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in hf_tensors.items()}
    check_tensor_shapes(config, shapes, path, describe=_describe_tensor)

    # Before the tensors: a vocabulary we cannot rebuild should fail fast, not after dequantizing.
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else Tokenizer.from_gguf(metadata)
    permute = config.architecture in _PERMUTED_ARCHITECTURES
    weights: dict[str, torch.Tensor] = {}
    quant_types: dict[str, int] = {}
    for name, t in hf_tensors.items():
        heads = None
        if permute and ".self_attn.q_proj." in name:
            heads = config.num_attention_heads
        elif permute and ".self_attn.k_proj." in name:
            heads = config.num_key_value_heads
        packed = None
        if keep_packed:
            from phaselab.model import quant

            exact = (lambda dt, t=t, shape=shapes[name]: _dequantize(t, shape, dt))
            packed = quant.from_gguf(t, shapes[name], exact)
        if packed is not None:  # rows are independent in block storage: permute the packed rows
            weights[name] = packed if heads is None else packed.map_rows(lambda w, h=heads: _unpermute_rows(w, h))
        else:
            w = _dequantize(t, shapes[name], dtype)
            weights[name] = (w if heads is None else _unpermute_rows(w, heads)).contiguous()
        quant_types[t.tensor_type.name] = quant_types.get(t.tensor_type.name, 0) + 1
    return LoadedCheckpoint(config, weights, tokenizer, path, "gguf", quant_types)
