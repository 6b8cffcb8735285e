"""Checkpoint loading: a Hugging Face safetensors directory or a GGUF file -> one LoadedCheckpoint.

Both formats end in the same place: Hugging Face parameter names and shapes, cast to the
requested dtype, and a config that every tensor was checked against. The check is strict
(nanoGPT-style): every tensor the config implies must be present with its exact shape and
nothing unexplained may be left over, because a silently missing bias or a transposed matrix
gives fluent garbage instead of an error.

    path ──┬─ directory ─▶ config.json ─▶ ModelConfig ─┐
           │                safetensors (one or sharded) ├─▶ check names/shapes ─▶ read + cast per tensor
           └─ *.gguf ─────▶ gguf_loader (modelinfo.gguf metadata ─▶ ModelConfig, tensors ─▶ HF names, dequantized)

Tensors are cast one at a time as they are read, so a bf16 load of a big model never holds a
second full fp32 copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable

import torch

from phaselab.errors import ConfigError, ModelFormatError, ModelNotFoundError
from phaselab.model.checkpoint import LoadedCheckpoint, check_tensor_shapes
from phaselab.model.gguf_loader import load_gguf
from phaselab.modelinfo.bundled import default_model_path
from phaselab.modelinfo.model_config import ModelConfig
from phaselab.modelinfo.gguf import is_gguf_file
from phaselab.modelinfo.tokenizer import load_tokenizer

# Tensors some checkpoints carry that hold nothing the model needs (old Llama exports saved the
# RoPE inverse frequencies, which are recomputed from the config).
_HARMLESS_SUFFIXES = (".rotary_emb.inv_freq",)


def load_checkpoint(
    path: str | None, dtype: torch.dtype = torch.float32, tokenizer_path: str | None = None,
    keep_packed: bool = False,
) -> LoadedCheckpoint:
    """Load and check a model. ``path``: an HF directory, a ``.gguf`` file, or None (the default model).

    ``tokenizer_path`` replaces the checkpoint's own tokenizer (an HF directory, a
    tokenizer.json, or a .gguf); needed for GGUFs whose vocabulary phaselab cannot rebuild.
    ``keep_packed``: a GGUF's quantized matrices stay in their blocks (see gguf_loader.load_gguf).
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
        if not is_gguf_file(path):
            raise ModelFormatError(
                f"{path} is neither a GGUF file (no GGUF magic bytes) nor a directory; pass a Hugging "
                "Face model directory or a .gguf file"
            )
        checkpoint = load_gguf(path, dtype, tokenizer_path, keep_packed)
    _reconcile_tokenizer(checkpoint)
    return checkpoint


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
