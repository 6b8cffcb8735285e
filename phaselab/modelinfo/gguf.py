"""GGUF (llama.cpp) metadata, read without torch: the header's key/values, the model config and
the tokenizer vocabulary a file describes. No tensor data is read except the small
``rope_freqs.weight`` (llama3 RoPE factors). Dequantization and weight loading are the model's
(phaselab/model/gguf_loader.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from phaselab.errors import ModelFormatError, UnsupportedModelError
from phaselab.modelinfo.model_config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")


def _gguf() -> Any:
    import gguf

    return gguf


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


def read_gguf_config(reader: Any) -> ModelConfig:
    """The ModelConfig of an open GGUF (metadata, tensor names and the llama3 RoPE factors)."""
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = by_name.get("rope_freqs.weight")
    return config_from_gguf(
        read_metadata(reader), set(by_name),
        None if rope_freqs is None else np.asarray(rope_freqs.data, dtype=np.float64).ravel(),
    )
