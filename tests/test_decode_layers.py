"""A fused decode step's decoder layers in one native call (`kernels.decode_layers`), and the whole
forward in one (`kernels.decode_forward`: the embedding, RoPE rows, layers, final norm and LM head),
must equal the Python layer loop bit for bit: they make the same kernel calls in the same order
(decode_layers.c), so greedy tokens and top-5 logprobs are compared for equality, not within a
tolerance.

The truth is the layer loop on its native path, which tests/test_attention_fused.py,
tests/test_elementwise.py and tests/test_qlinear_model.py hold to references of their own. A spy
counts the calls, so an equality that came from the loop running twice cannot pass.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from phaselab.engine_args import EngineArgs
from phaselab.core.sampling_params import SamplingParams
from phaselab.engine.engine import LLMEngine
from phaselab.llm import LLM
from phaselab.model import kernels
from phaselab.model.kernels import qlinear
from tests._loader_helpers import TINY_VOCAB_SIZE, random_weights, tiny_hf_config, write_gguf

pytestmark = pytest.mark.skipif(not (kernels.available() and qlinear.available()),
                                reason=f"native kernels unavailable: {kernels.unavailable_reason()}")
Q = gguf.GGMLQuantizationType


def _spy(monkeypatch) -> dict[str, list[int]]:
    """Batch sizes of the calls to decode_forward and decode_layers, as they happen."""
    calls: dict[str, list[int]] = {"forward": [], "layers": []}
    real_forward, real_layers = kernels.decode_forward, kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_forward",
                        lambda *a, **k: calls["forward"].append(a[2].shape[0]) or real_forward(*a, **k))
    monkeypatch.setattr(kernels, "decode_layers",
                        lambda *a, **k: calls["layers"].append(a[1].shape[0]) or real_layers(*a, **k))
    return calls


def _run_both(llm: LLM, prompts: list[list[int]], monkeypatch) -> tuple[list, list, dict[str, int]]:
    """(outputs with the one-call paths, outputs with the loop, {path: calls} the first run made)."""
    calls = _spy(monkeypatch)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=True)

    def run() -> list[tuple[list[int], str]]:
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in llm.generate(prompts, params)]

    model = llm.engine.executor.model
    assert model.decode_layers, "PHASELAB_DECODE_LAYERS is unset: the one-call path should be on"
    one_call = run()
    n = {k: len(v) for k, v in calls.items()}
    model.decode_layers = False
    try:
        loop = run()
    finally:
        model.decode_layers = True
    assert {k: len(v) for k, v in calls.items()} == n, "the loop run must not go through a one-call path"
    return one_call, loop, n


@pytest.mark.parametrize("ends", ["native", "python"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["q", "bf16", "fp32"])
def test_tiny_biased_model_one_call_equals_loop(tmp_path, monkeypatch, dtype, path, ends):
    """A 2-layer GQA Llama with q/k/v and o biases, weights in Q4_0, Q4_1 and Q8_0 (the fused qkv
    falls back to dense rows), each forced linear path; four prompts decode together with differing
    lengths, so batches of 1-4 rows and several cache blocks per sequence. ends="native": the whole
    forward in one call (decode_forward); "python": its ends refused, so the layers alone in one call
    (decode_layers) with the embedding and head around them in Python."""
    config = tiny_hf_config(attention_bias=True)
    weights = random_weights(config, seed=5)
    qtypes = {n: Q.Q4_0 if n.endswith(("q_proj.weight", "k_proj.weight")) else
              Q.Q4_1 if n.endswith(("v_proj.weight", "gate_proj.weight", "up_proj.weight")) else Q.Q8_0
              for n in weights if n.endswith("proj.weight")}
    monkeypatch.setenv("PHASELAB_LINEAR", path)
    engine = LLMEngine(EngineArgs(model=write_gguf(str(tmp_path / "tiny.gguf"), config, weights, qtypes),
                                  dtype=dtype, kv_cache_memory="8MiB", max_model_len=200, block_size=16,
                                  enable_prefix_caching=False))  # a cached prefix takes another prefill path
    assert engine.executor.fused_decode and engine.executor.model.native_elementwise
    if ends == "python":
        monkeypatch.setattr(engine.executor.model, "decode_ends", lambda dtype: None)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (3, 40, 17, 70)]
    one_call, loop, calls = _run_both(LLM.from_engine(engine), prompts, monkeypatch)
    used, unused = ("forward", "layers") if ends == "native" else ("layers", "forward")
    assert calls[used] > 0 and calls[unused] == 0, calls
    assert one_call == loop


def test_whole_forward_runs_only_within_every_layers_native_rows(tmp_path, monkeypatch):
    """The one-call forward runs a batch only when every linear layer and the LM head would run it on
    the native kernel: a head limited to one row sends larger decode batches to the layers-only call
    (its head then on the GEMM path), and the limit is read again after it changes."""
    config = tiny_hf_config()
    weights = random_weights(config, seed=6)
    engine = LLMEngine(EngineArgs(model=write_gguf(str(tmp_path / "tiny.gguf"), config, weights,
                                                   {n: Q.Q8_0 for n in weights if n.endswith("proj.weight")}),
                                  dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=200,
                                  enable_prefix_caching=False))
    model = engine.executor.model
    assert model.decode_ends(torch.bfloat16) is not None
    calls = _spy(monkeypatch)
    llm = LLM.from_engine(engine)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    llm.generate(prompts, params)
    assert calls["forward"] and set(calls["forward"]) == {2} and not calls["layers"], calls
    model.head.max_native_rows = 1
    calls["forward"].clear()
    llm.generate(prompts, params)
    assert calls["layers"] and set(calls["layers"]) == {2} and not calls["forward"], calls
    calls["layers"].clear()
    llm.generate(prompts[:1], params)  # one row: within the head's limit again
    assert calls["forward"] and set(calls["forward"]) == {1} and not calls["layers"], calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_model_one_call_equals_loop(monkeypatch, dtype):
    """The bundled model (Q4_1 blocks, 30 layers): batched decodes of varied lengths."""
    llm = LLM(dtype=dtype, kv_cache_memory="256MiB", max_model_len=1024, enable_prefix_caching=False)
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, 40000, n).tolist() for n in (5, 40, 300, 17)]
        one_call, loop, calls = _run_both(llm, prompts, monkeypatch)
    finally:
        llm.shutdown()
    assert calls["forward"] > 0 and calls["layers"] == 0, calls
    assert one_call == loop


def test_refusal_names_the_switch():
    """A shape the kernels refuse is an error that says how to run without the one call."""
    layers = (kernels.DecodeLayer * 1)()  # formats 0 (F32) with no weights: n = k = 0, refused
    emb = torch.zeros(1, 64)
    kv = torch.zeros(1, 2, 4, 16, 2, 16)
    with pytest.raises(RuntimeError, match="PHASELAB_DECODE_LAYERS=0"):
        kernels.decode_layers(layers, emb, torch.zeros(1, 16), torch.zeros(1, 16), kv, torch.zeros(1, dtype=torch.long),
                              torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 4, 0.25, 1e-5)


def test_forward_refuses_an_id_or_position_outside_its_table():
    """decode_forward checks each token id against the embedding's rows and each position against
    the RoPE tables before reading them: a clear error naming the switch, no read past a table."""
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=256, enable_prefix_caching=False)
    try:
        model = llm.engine.executor.model
        ends = model.decode_ends(torch.bfloat16)
        assert ends is not None
        kv = llm.engine.executor.kv_caches
        one = torch.zeros(1, dtype=torch.long)
        table = torch.zeros(1, 1, dtype=torch.long)
        a = model.model.layers[0].self_attn
        for ids, pos in ((torch.tensor([ends.vocab_in]), one), (one, torch.tensor([ends.max_pos])),
                         (torch.tensor([-1]), one)):
            with pytest.raises(RuntimeError, match="PHASELAB_DECODE_LAYERS=0"):
                kernels.decode_forward(model.layer_table()[0], ends, ids, pos, kv, one, table, torch.ones(1, dtype=torch.long),
                                       a.num_heads, a.scale, 1e-5, True)
    finally:
        llm.shutdown()
