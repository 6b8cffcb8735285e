"""The simulator's catalogs: KV sizing (DistServe's OPT-66B figure, Llama-3-70B's GQA), parameter
counts, Hugging Face config.json parsing, and where every number came from."""

from __future__ import annotations

import pytest

from phaselab.errors import ConfigError, UnsupportedModelError
from phaselab.sim.catalog import (
    HARDWARE, LINKS, MODELS, get_hardware, get_link, get_model, model_from_hf_config, source_of,
)
from phaselab.spec.config import ModelConfig

GiB, KiB = 2**30, 2**10


def test_opt_66b_kv_per_request_is_distserves_1_13_gb():
    # DistServe: "the KV cache of a single 512-token request on OPT-66B is about 1.13 GB".
    # 2 (K and V) x 64 layers x 9216 hidden (MHA: 72 KV heads x 128) x 2 bytes (fp16) x 512 tokens:
    opt = get_model("opt-66b")
    assert opt.num_key_value_heads == opt.num_attention_heads == 72 and opt.kv_size == 9216
    per_request = opt.kv_bytes_per_token(dtype_bytes=2) * 512
    assert per_request == 2 * 64 * 9216 * 2 * 512 == 1_207_959_552
    # = 1.208e9 bytes = 1.125 GiB: DistServe's "1.13 GB" is in GiB (binary gigabytes)
    assert per_request / GiB == pytest.approx(1.125) and abs(per_request / GiB - 1.13) < 0.006
    assert per_request / 1e9 == pytest.approx(1.208, abs=1e-3)  # in decimal GB it would read 1.21


def test_llama_3_70b_is_320_kib_per_token():
    # bf16, GQA with 8 KV heads of 128 over 80 layers: 2 x 80 x 8 x 128 x 2 bytes
    m = get_model("llama-3-70b")
    assert m.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2 == 320 * KiB
    # GQA: 8x smaller than the same model with multi-head attention (64 heads)
    assert m.num_attention_heads // m.num_key_value_heads == 8
    # under TP=8 each GPU holds one KV head; under TP=16 the head is replicated, not split
    assert m.kv_bytes_per_token_per_gpu(2, 8) == 40 * KiB
    assert m.kv_bytes_per_token_per_gpu(2, 16) == 40 * KiB


@pytest.mark.parametrize("name,billions", [
    ("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("llama-2-70b", 68.98), ("mistral-7b", 7.24), ("yi-34b", 34.39),
    ("qwen2-7b", 7.62), ("qwen2-72b", 72.71), ("opt-13b", 12.85), ("opt-66b", 65.7), ("opt-175b", 174.6),
])
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert get_model(name).num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_opt_config_json_is_mha_with_learned_positions_and_plain_mlp():
    d = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 9216, "num_attention_heads": 72,
         "num_hidden_layers": 64, "ffn_dim": 36864, "vocab_size": 50272, "max_position_embeddings": 2048,
         "word_embed_proj_dim": 9216, "enable_bias": True}
    spec = model_from_hf_config(d, name="opt-66b")
    assert spec == MODELS["opt-66b"]  # sources are not compared
    assert spec.mlp_matrices == 2 and spec.learned_position_rows == 2050 and spec.norm == "layer"


def test_llama_config_json_and_model_config_agree():
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
         "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
         "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}
    spec = model_from_hf_config(d, name="llama-3-70b")
    assert spec == MODELS["llama-3-70b"]
    # the simulator's lenient reader and the engine's strict one give the same type and the same counts
    from_engine = ModelConfig.from_hf_dict(d, name="llama-3-70b")
    assert type(spec) is type(from_engine) is ModelConfig
    assert from_engine.num_parameters() == spec.num_parameters()
    assert from_engine.kv_bytes_per_token(2) == spec.kv_bytes_per_token(2)
    assert from_engine.linear_macs_per_token_per_layer() == spec.linear_macs_per_token_per_layer()


def test_unknown_family_is_accepted_with_its_assumption_stated():
    d = {"model_type": "fancy", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4,
         "num_attention_heads": 8, "vocab_size": 1000}
    spec = model_from_hf_config(d, name="fancy")
    assert "gated MLP" in spec.sources["*"] and spec.num_key_value_heads == 8
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        model_from_hf_config({"model_type": "x"}, name="x")


def test_every_datasheet_figure_has_a_source():
    for name in ("a100", "h100", "h200", "cpu"):
        h = HARDWARE[name]
        for field in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            src = source_of(h, field)
            assert src.startswith(("datasheet", "measured")), (name, field, src)
    assert HARDWARE["h100"].peak_flops == pytest.approx(989.4e12)  # dense, not the 2x sparsity figure
    assert HARDWARE["h200"].mem_bandwidth == pytest.approx(4.8e12)
    for link in LINKS.values():
        assert source_of(link, "bandwidth").startswith("datasheet")
    assert get_link("25gbe").bandwidth == pytest.approx(25e9 / 8)
    assert get_link("nvlink4").bandwidth == pytest.approx(450e9)


def test_unknown_names_list_the_catalog():
    with pytest.raises(ConfigError, match="did you mean h100"):
        get_hardware("h10")
    with pytest.raises(ConfigError, match="llama-3-8b"):
        get_model("no-such-model")
