"""What a checkpoint loader hands the engine, and the strict name/shape check both formats share.

Its own module so that phaselab/model/loader.py (format dispatch, safetensors) and
phaselab/model/gguf_loader.py (GGUF tensors) both import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from phaselab.errors import ModelFormatError
from phaselab.modelinfo.model_config import ModelConfig
from phaselab.modelinfo.tokenizer import Tokenizer


@dataclass
class LoadedCheckpoint:
    """A checked model: config, weights under Hugging Face names, and its tokenizer."""

    config: ModelConfig
    # HF parameter names and shapes ("model.layers.0.self_attn.q_proj.weight": [q_size, hidden]),
    # already in the requested dtype. No "lm_head.weight" when config.tie_word_embeddings.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: str  # resolved file (GGUF) or directory (HF)
    format: str  # "hf" | "gguf"
    # Storage type -> number of tensors stored that way in the source ({"Q4_1": 210, "F32": 61}).
    quant_types: dict[str, int]


# -- the strict check both formats share --------------------------------------------------------


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (HF name -> shape) a checkpoint of ``config`` must hold, and nothing else.

    Qwen2 biases q/k/v only; a Llama with ``attention_bias`` also biases o_proj (as HF's
    LlamaAttention does).
    """
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
            if config.architecture != "qwen2":
                shapes[p + "self_attn.o_proj.bias"] = (h,)
    return shapes


def check_tensor_shapes(
    config: ModelConfig,
    found: Mapping[str, tuple[int, ...]],
    source: str,
    describe: Callable[[str], str] = lambda name: name,
) -> None:
    """Raise ModelFormatError naming every missing, unexpected or mis-shaped tensor.

    ``found`` maps HF names to the shapes in the file (after any renaming); ``describe`` adds the
    file's own name for a tensor to the message (GGUF names differ from HF ones).
    """
    expected = expected_tensor_shapes(config)
    problems: list[str] = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing tensor {describe(name)} (expected shape {list(shape)})")
        elif tuple(found[name]) != shape:
            problems.append(f"tensor {describe(name)} has shape {list(found[name])}, expected {list(shape)}")
    problems += [
        f"unexpected tensor {describe(name)} with shape {list(shape)}"
        for name, shape in found.items()
        if name not in expected
    ]
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ModelFormatError(
            f"{source}: the tensors do not match the model config ({_describe_config(config)}):\n  {shown}\n"
            "The file is incomplete, of a different model size, or of an architecture variant phaselab does not run."
        )


def _describe_config(config: ModelConfig) -> str:
    return (
        f"{config.architecture}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads of {config.head_dim}, "
        f"vocab {config.vocab_size}, tied={config.tie_word_embeddings}, attention_bias={config.attention_bias}"
    )
