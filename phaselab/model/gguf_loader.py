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

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from phaselab.errors import ModelFormatError, UnsupportedModelError
from phaselab.model.config import ModelConfig
from phaselab.model.loader import LoadedCheckpoint, check_tensor_shapes
from phaselab.model.tokenizer import Tokenizer, load_tokenizer

def _gguf() -> Any:
    import gguf

    return gguf


SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
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


def is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf(path: str) -> Any:
    """A gguf.GGUFReader over ``path``; a file it cannot parse is reported as damaged."""
    gguf = _gguf()
    if not is_gguf_file(path):
        raise ModelFormatError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError on damaged headers
        raise ModelFormatError(
            f"{path}: cannot read it as GGUF ({type(e).__name__}: {e}); the file looks truncated or "
            "corrupted, re-download or re-convert it"
        ) from e


def read_metadata(reader: Any) -> dict[str, Any]:
    """All metadata key -> value (strings decoded, arrays as lists), minus the GGUF.* bookkeeping."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types and field.types[0] == _gguf().GGUFValueType.FLOAT32:
            # Shortest decimal that round-trips the float32, so 1e-5 reads back as 1e-05 (as in
            # config.json) and not 9.999999747378752e-06.
            value = float(str(np.float32(value)))
        metadata[key] = value
    return metadata


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """The tokenizer stored in a GGUF's metadata (no tensors are read)."""
    return Tokenizer.from_gguf(read_metadata(open_gguf(path)))


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: set[str], rope_freqs: np.ndarray | None) -> ModelConfig:
    """ModelConfig from llama.cpp's ``{arch}.*`` keys; tying and biases from which tensors exist."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; phaselab runs {list(SUPPORTED_GGUF_ARCHITECTURES)} "
            "(Llama-family decoders)"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(
                f"GGUF metadata lacks {arch}.{key}; the file was not written by a llama.cpp converter"
            )
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list (some converters); we need it uniform
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embedding (rope dims {rope_dim} of head_dim {head_dim}) is not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab_size is None:
        raise ModelFormatError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    eos_ids = [
        int(metadata[f"tokenizer.ggml.{k}"])
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if metadata.get(f"tokenizer.ggml.{k}") is not None
    ]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(metadata, arch, head_dim, rope_theta, rope_freqs),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        name=str(metadata.get("general.name", "")),
    )


def _llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-frequency divisors llama3 scaling applies (HF's _compute_llama3_parameters)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _rope_scaling(
    metadata: Mapping[str, Any], arch: str, head_dim: int, theta: float, rope_freqs: np.ndarray | None
) -> dict[str, Any] | None:
    """llama3 RoPE scaling from ``rope.scaling.*`` metadata or, failing that, ``rope_freqs.weight``.

    llama.cpp's converter writes Llama 3.1+'s scaling only as the tensor of per-frequency divisors;
    the factor is its largest entry, and low/high frequency factors and the original context
    default to 1, 4 and 8192 as in llama.cpp. The rebuilt divisors must reproduce the tensor, so
    a file scaled some other way is refused instead of being run with the wrong positions.
    """
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") and rope_freqs is None:
        return None
    if kind not in (None, "none", "llama3"):
        if factor is not None and float(factor) == 1.0:
            return None
        raise UnsupportedModelError(f"RoPE scaling type {kind!r} is not supported (only llama3)")
    original = int(metadata.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    low = float(metadata.get(f"{arch}.rope.scaling.low_freq_factor", 1.0))
    high = float(metadata.get(f"{arch}.rope.scaling.high_freq_factor", 4.0))
    if factor is None:
        if rope_freqs is None:
            raise ModelFormatError("llama3 RoPE scaling without rope.scaling.factor or rope_freqs.weight")
        factor = float(np.max(rope_freqs))
    scaling = {
        "rope_type": "llama3",
        "factor": float(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    if rope_freqs is not None:
        expected = _llama3_factors(head_dim, theta, float(factor), low, high, original)
        if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-4, atol=0):
            raise UnsupportedModelError(
                f"rope_freqs.weight does not match llama3 scaling {scaling}; this RoPE variant is not supported"
            )
    return scaling


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


def load_gguf(path: str, dtype: torch.dtype, tokenizer_path: str | None = None) -> LoadedCheckpoint:
    """Read, check and dequantize a GGUF checkpoint (see module docstring for the conversions)."""
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
    rope_freqs = by_name.get("rope_freqs.weight")
    config = config_from_gguf(
        metadata, set(by_name), None if rope_freqs is None else np.asarray(rope_freqs.data, dtype=np.float64).ravel()
    )

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
        w = _dequantize(t, shapes[name], dtype)
        if permute and ".self_attn.q_proj." in name:
            w = _unpermute_rows(w, config.num_attention_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = _unpermute_rows(w, config.num_key_value_heads)
        weights[name] = w.contiguous()
        quant_types[t.tensor_type.name] = quant_types.get(t.tensor_type.name, 0) + 1
    return LoadedCheckpoint(config, weights, tokenizer, path, "gguf", quant_types)
