"""Builders for tiny checkpoints on disk: HF safetensors directories and GGUF files.

Both are made from one dict of HF-named tensors, so a test can load each format and compare
the result with the tensors it started from. The GGUF writer does what llama.cpp's
convert_hf_to_gguf.py does to a Llama: renames, reverses shapes and permutes q/k rows.
"""

from __future__ import annotations

import json
import os
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from phaselab.model.checkpoint import expected_tensor_shapes
from phaselab.model.gguf_loader import hf_to_gguf_name
from phaselab.modelinfo.model_config import ModelConfig

# A byte-level BPE vocabulary small enough to embed in tests: the 256 byte symbols, a few merges
# (some across digits and spaces, so pre-tokenizer differences show up), three control tokens.
BYTE_SYMBOLS = sorted(pre_tokenizers.ByteLevel.alphabet())
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2", "12 3", "Ġ 1", "Ġ Ġ", "Ċ Ċ", "ĠĠ 1", "o r", "Ġ w", "Ġw or"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int]]:
    """(tokens, GGUF token types): specials first (ids 0..2, like SmolLM), then bytes, then merges."""
    merged = [a + b for a, b in (m.split(" ") for m in TINY_MERGES)]
    tokens = SPECIAL_TOKENS + BYTE_SYMBOLS + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types


def tiny_tokenizer_metadata(pre: str = "smollm", add_bos: bool = False) -> dict[str, Any]:
    """GGUF tokenizer metadata as phaselab.modelinfo.gguf.read_metadata returns it."""
    tokens, types = tiny_vocab()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(TINY_MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


TINY_VOCAB_SIZE = len(tiny_vocab()[0])


def tiny_hf_config(arch: str = "LlamaForCausalLM", tie: bool = False, **overrides: Any) -> dict[str, Any]:
    """config.json of a 2-layer GQA model (4 query heads share 2 KV heads) over the tiny vocabulary."""
    config = {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(arch, "gpt2"),
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    return config | overrides


def random_weights(hf_config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the config implies, random normal (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = expected_tensor_shapes(ModelConfig.from_hf_dict(hf_config))
    weights = {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()}
    for name in weights:
        if "norm" in name:
            weights[name] += 1.0
    return weights


def write_tiny_tokenizer(directory: str, add_bos: bool = False) -> None:
    """tokenizer.json + tokenizer_config.json exported from the tiny GGUF vocabulary."""
    from phaselab.modelinfo.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(tiny_tokenizer_metadata(add_bos=add_bos))
    tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": add_bos,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def write_hf_dir(
    directory: str,
    hf_config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
) -> str:
    """A Hugging Face model directory; num_shards > 1 writes model-0000k-of-0000n + index.json."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    tensors = {name: w.to(dtype).contiguous() for name, w in weights.items()}
    if num_shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for k in range(num_shards):
            shard = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
            part = names[k::num_shards]
            save_file({n: tensors[n] for n in part}, os.path.join(directory, shard))
            weight_map |= dict.fromkeys(part, shard)
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    write_tiny_tokenizer(directory)
    return directory


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF half-rotation -> llama.cpp pair rotation)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, original: int = 8192) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for llama3 scaling (low 1, high 4)."""
    import math

    low_wavelen, high_wavelen = original / 1.0, original / 4.0
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    path: str,
    hf_config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    arch: str | None = None,
    permute: bool | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]] | None = None,
    extra_metadata: dict[str, Any] | None = None,
    tokenizer_pre: str = "smollm",
) -> str:
    """A GGUF of ``weights`` the way llama.cpp writes one.

    ``qtypes`` maps HF names to storage types (default F32). q/k rows are permuted for llama
    unless ``permute`` says otherwise. ``extra_tensors`` adds raw GGUF tensors (name -> (array,
    raw type or None)); a tied model has no lm_head in ``weights`` and so no output.weight.
    """
    cfg = ModelConfig.from_hf_dict(hf_config)
    arch = arch or cfg.architecture
    permute = (arch == "llama") if permute is None else permute
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    meta = tiny_tokenizer_metadata(pre=tokenizer_pre)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    qtypes = qtypes or {}
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if permute and ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif permute and ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        qtype = qtypes.get(name, gguf.GGMLQuantizationType.F32)
        data = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
        raw = None if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else qtype
        w.add_tensor(hf_to_gguf_name(name), data, raw_dtype=raw)
    for name, (array, raw) in (extra_tensors or {}).items():
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip_quant(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """What a tensor reads back as after storing it as ``qtype`` (quantization is per row block,
    so it commutes with llama.cpp's row permutation)."""
    data = gguf.quants.quantize(np.ascontiguousarray(tensor.float().numpy()), qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype)).reshape(tensor.shape))
