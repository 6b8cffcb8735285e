"""phaselab.modelinfo, the torch-free model description: it imports no torch, and its counts (parameters,
modeled FLOPs and bytes) agree with counts taken elsewhere: a hand count of SmolLM2's published shape,
the tensors stored in the bundled GGUF, and a Hugging Face transformers model built in torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
from phaselab.core.sampling_params import SamplingParams
from phaselab.cost.formulas import CostFormulas, modeled_cost
from phaselab.cost.catalog import get_model
from phaselab.modelinfo.model_config import ModelConfig
from phaselab.modelinfo.gguf import open_gguf, read_gguf_config

# SmolLM2-135M (docs/design.md, "The bundled model"): 30 layers, hidden 576, 9 heads, 3 KV heads of 64, MLP 1536,
# vocab 49152, tied embeddings. By hand:
#   attention  576 x (576 + 2 x 192) + 576 x 576 = 552,960 + 331,776      =   884,736
#   MLP        3 x 576 x 1536                                            = 2,654,208
#   norms      2 x 576                                                   =     1,152
#   per layer                                                            = 3,540,096
#   30 layers 106,202,880 + embedding 49152 x 576 = 28,311,552 + final norm 576 = 134,515,008
SMOLLM2_PARAMETERS = 134_515_008


def test_spec_imports_no_torch():
    code = (
        "import sys\n"
        "import phaselab.modelinfo, phaselab.modelinfo.model_config, phaselab.modelinfo.gguf, phaselab.modelinfo.tokenizer, "
        "phaselab.modelinfo.bundled\n"
        "from phaselab.modelinfo.bundled import default_model_path\n"
        "from phaselab.modelinfo.tokenizer import load_tokenizer\n"
        "load_tokenizer(default_model_path())  # a GGUF vocabulary, read without the model loader\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, f'phaselab.modelinfo imported {bad[:3]}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_smollm2_parameter_count_by_hand_and_from_the_gguf(bundled_path):
    catalog = get_model("smollm2-135m")
    assert catalog.num_parameters() == SMOLLM2_PARAMETERS
    reader = open_gguf(bundled_path)
    from_file = read_gguf_config(reader)
    assert from_file.num_parameters() == SMOLLM2_PARAMETERS
    # the tensors the file stores, counted element by element (rope_freqs would be no weight; it has none)
    stored = sum(int(np.prod(t.shape)) for t in reader.tensors if t.name != "rope_freqs.weight")
    assert stored == SMOLLM2_PARAMETERS
    for f in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(from_file, f) == getattr(catalog, f), f


def _hf_config(arch: str, tie: bool, bias: bool) -> dict:
    return {
        "architectures": [arch], "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[arch],
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
        "tie_word_embeddings": tie, "attention_bias": bias, "torch_dtype": "float32",
    }


@pytest.mark.parametrize("arch,tie,bias", [
    ("LlamaForCausalLM", True, False), ("LlamaForCausalLM", False, True), ("Qwen2ForCausalLM", False, True),
])
def test_formulas_match_a_transformers_model(arch, tie, bias):
    """Parameters and matmul FLOPs of a real torch model, counted on the module: every parameter's
    numel, and 2 x rows x in x out for every nn.Linear call of one prefill forward (T tokens, one
    sampled row), against num_parameters() and the modeled matmul_flops of the same plan."""
    import transformers

    d = _hf_config(arch, tie, bias)
    config = ModelConfig.from_hf_dict(d)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d)).eval()
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()

    flops = 0

    def count(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal flops
        rows = inputs[0].numel() // module.in_features
        flops += 2 * rows * module.in_features * module.out_features

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(count)
    T = 11
    with torch.no_grad():
        model(torch.arange(T).unsqueeze(0), logits_to_keep=1)  # the LM head on the sampled row only
    plan = SchedulerOutput(0, [ScheduledRequest("r", list(range(T)), 0, [0], [0], True, True, SamplingParams())])
    cost = modeled_cost(config, plan, dtype_bytes=4)
    assert cost.matmul_flops == flops
    # a prefill from position 0 writes every token's K and V: 2 x layers x T x kv_heads x head_dim x 4 bytes
    assert cost.kv_write_bytes == 2 * 2 * T * 2 * 8 * 4 and cost.kv_read_bytes == 0
    assert cost.attention_flops == 2 * 4 * 4 * 8 * (T * (T + 1) // 2)  # L x 4 x heads x head_dim x causal keys


def test_opt_counts_by_hand():
    """The OPT-only terms (plain MLP, LayerNorm and linear biases, a learned position table that is
    gathered, not streamed), on a shape small enough to count by hand."""
    opt = ModelConfig(architecture="opt", vocab_size=10, hidden_size=4, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=2, tie_word_embeddings=True,
                      mlp_matrices=2, linear_bias=True, norm="layer", learned_position_rows=6)
    # q, k, v, o: 4 x (4x4 + 4) = 80; fc1 4x16 + 16 = 80; fc2 16x4 + 4 = 68; two LayerNorms 2 x 8 = 16
    # -> 244 per layer; embedding 40 + positions 24 + final LayerNorm 8 = 72; total 316
    assert opt.num_parameters() == 316
    assert not opt.runnable
    f = CostFormulas(opt, dtype_bytes=2)
    # 3 tokens read the whole tied table (the LM head) but only 3 rows of the position table
    assert f.weight_bytes(3) == (316 - 24 + 3 * 4) * 2
