"""The simulator's catalogs: KV sizing (DistServe's OPT-66B figure, Llama-3-70B's GQA), parameter
counts, Hugging Face config.json parsing, and where every number came from."""

from __future__ import annotations

import pytest

from phaselab.errors import ConfigError, UnsupportedModelError
from phaselab.cost.catalog import (
    HARDWARE, LINKS, MODELS, get_hardware, get_link, get_model, model_from_hf_config, source_of,
)
from phaselab.modelinfo.model_config import ModelConfig

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


# -- devices, links and models from files (issue 15, item 3) ---------------------------------------------------
def _write(path, obj):
    import json

    path.write_text(json.dumps(obj))
    return str(path)


def test_hardware_and_link_from_files_work_where_names_do(tmp_path):
    from phaselab.cost.pricing import RooflineCostModel, default_params
    from phaselab.sim.deployment import Deployment, RoleConfig
    from phaselab.sim.loop import simulate
    from phaselab.sim.workload import random_requests

    link = _write(tmp_path / "fabric.json", {"name": "fabric", "bandwidth": 64e9, "latency_s": 3e-6, "per_gpu": True,
                                             "sources": {"bandwidth": "datasheet: made up for the test"}})
    hw_path = _write(tmp_path / "accel.json", {
        "name": "accel", "peak_flops": 500e12, "mem_bandwidth": 4e12, "memory_bytes": 128e9, "tp_link": "fabric.json",
        "cost_params": {"compute_efficiency": 0.6, "memory_efficiency": 0.9, "iteration_overhead_s": 2e-3}})
    hw = get_hardware(hw_path)
    assert (hw.name, hw.peak_flops, get_link(hw.tp_link).bandwidth) == ("accel", 500e12, 64e9)
    p = default_params(hw)
    assert p.compute_efficiency == 0.6 and "hardware file of accel" in p.source("compute_efficiency")
    # the same model on the file's device costs what its figures say: decode ~ weights / (4 TB/s x 0.9)
    cm = RooflineCostModel(get_model("llama-3-8b"), hw)
    d = Deployment(get_model("llama-3-70b"), hw, colocated=RoleConfig(tp=2), tp_link=link)
    assert d.tp_link_spec().name == "fabric"
    result = simulate(d, random_requests(5, "256", "8", seed=0))
    assert all(m.finish_reason == "length" for m in result.requests)
    from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
    from phaselab.core.sampling_params import SamplingParams
    from phaselab.sim.simulate_cli import main

    decode = cm.predict(SchedulerOutput(0, [ScheduledRequest("r", [0], 100, [], [], True, False, SamplingParams())]))
    assert decode.linear_s == pytest.approx(decode.modeled.weight_bytes / (4e12 * 0.9), rel=1e-6)
    assert main(["simulate", "run", "--model", "llama-3-8b", "--hardware", hw_path, "--interconnect", link,
                 "--num-prompts", "4", "--input-len", "128", "--output-len", "4"]) == 0


@pytest.mark.parametrize("field", ["peak_flops", "mem_bandwidth", "memory_bytes", "name"])
def test_a_hardware_file_missing_a_field_is_an_error_naming_it(tmp_path, field):
    d = {"name": "x", "peak_flops": 1e12, "mem_bandwidth": 1e11, "memory_bytes": 1e10}
    del d[field]
    with pytest.raises(ConfigError, match=f"lacks the field '{field}'"):
        get_hardware(_write(tmp_path / "hw.json", d))


def test_a_link_file_missing_a_field_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="lacks the field 'latency_s'"):
        get_link(_write(tmp_path / "link.json", {"name": "l", "bandwidth": 1e9}))
    with pytest.raises(ConfigError, match="not in \\(0, 1\\]"):
        get_hardware(_write(tmp_path / "hw.json", {"name": "x", "peak_flops": 1e12, "mem_bandwidth": 1e11,
                                                  "memory_bytes": 1e10, "cost_params": {"compute_efficiency": 2}}))


YI_34B_200K = {  # config.json of 01-ai/Yi-34B-200K (the fields the simulator reads)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 7168, "intermediate_size": 20480,
    "num_attention_heads": 56, "num_hidden_layers": 60, "num_key_value_heads": 8, "vocab_size": 64000,
    "max_position_embeddings": 200000, "rope_theta": 10000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}


def test_a_long_context_model_from_its_hf_config(tmp_path):
    from phaselab.sim.deployment import Deployment, RoleConfig
    from phaselab.sim.loop import simulate
    from phaselab.sim.workload import SimRequest

    path = _write(tmp_path / "config.json", YI_34B_200K)
    from phaselab.sim.simulate_cli import resolve_model

    m = resolve_model(path)
    assert m.max_position_embeddings == 200000 and m.kv_bytes_per_token(2) == 2 * 60 * 8 * 128 * 2
    d = Deployment(m, get_hardware("h200"), colocated=RoleConfig(tp=4, max_num_batched_tokens=8192),
                   max_model_len=131072)
    assert d.resolved_max_model_len() == 131072
    result = simulate(d, [SimRequest("long", 120000, 4)])
    (req,) = result.requests
    assert req.finish_reason == "length" and req.ttft_s > 1.0  # 120k tokens of prefill take seconds
