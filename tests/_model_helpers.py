"""Helpers for tests that run the bundled model next to Hugging Face transformers."""

from __future__ import annotations

import os
import warnings

import torch

from phaselab import envs

# A few paragraphs of ordinary prose and code; repeated with numbered sections they make long
# prompts whose tokens are realistic (not random ids), so greedy continuations are meaningful.
PARAGRAPHS = [
    "Large language model inference has two phases. Prefill runs the whole prompt through the model "
    "at once and fills the key-value cache; decode then adds one token per step, reading every weight "
    "and the cached keys and values of the whole history.",
    "The river wound through the valley past the old mill, where children used to gather chestnuts in "
    "the autumn. Nobody remembered who had built the bridge, but everyone agreed it had outlasted "
    "three floods and at least one stubborn mayor.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, "
    "oxygen is released, and carbon dioxide is fixed into sugars through the Calvin cycle.",
    "Question: What is the capital of Australia, and why was it chosen over Sydney and Melbourne? "
    "Answer: Canberra was chosen as a compromise between the two rival cities in 1908.",
]


def bundled_gguf_path() -> str:
    from phaselab.modelinfo.bundled import default_model_path

    return default_model_path()


def load_hf_reference(gguf_path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=dtype
        )
    return model.eval()


def long_text(num_sections: int) -> str:
    parts = []
    for i in range(num_sections):
        parts.append(f"Section {i + 1}. " + PARAGRAPHS[i % len(PARAGRAPHS)])
    return "\n\n".join(parts)


def make_prompts(tokenizer) -> list[list[int]]:
    """8 chat prompts of varied lengths; the last is >= 1500 tokens."""
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why they are prime.",
        "Summarize this: " + long_text(2),
        "Explain what this code does:\n" + PARAGRAPHS[2],
        "Translate to French: The weather is nice today and I would like to go for a walk.",
        "Give a short answer. " + long_text(6) + "\nWhich section talks about plants?",
        "Read the following document and answer the question at the end.\n" + long_text(30)
        + "\nQuestion: which section first mentions the old mill?",
    ]
    prompts = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    assert len(prompts[-1]) >= 1500, len(prompts[-1])
    return prompts


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits at every position of one sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()


NEAR_TIE = 1e-3  # docs/design.md's near-tie rule: both candidates' fp32 logits this close is a tie


def compare_greedy(ours: list[int], ref: list[int], prompt: list[int], ref_logits_fn) -> str | None:
    """Token-identical, with the one allowance of docs/design.md (the near-tie rule).

    Returns None when equal, or a report of the near-tie at which they diverged (the comparison
    stops there). Raises AssertionError for a real divergence.
    """
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            logits = ref_logits_fn(prompt + ref[:i])[-1]
            gap = abs(float(logits[ours[i]]) - float(logits[ref[i]]))
            if gap < NEAR_TIE:
                return f"near-tie at output position {i}: tokens {ours[i]} vs {ref[i]}, fp32 logit gap {gap:.2e}"
            raise AssertionError(
                f"greedy outputs diverge at position {i}: ours {ours[i]} vs reference {ref[i]} "
                f"(fp32 logit gap {gap:.4f} > {NEAR_TIE}); ours={ours[: i + 3]} ref={ref[: i + 3]}"
            )
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)} (with equal common prefix)"
    return None


def make_llm(checkpoint, **options):
    """An LLM over an already loaded checkpoint (saves reloading the GGUF per engine)."""
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine
    from phaselab.llm import LLM

    return LLM.from_engine(LLMEngine(EngineArgs(**options), checkpoint=checkpoint))


def serving_dtype() -> str:
    """The dtype the tests that drive whole workloads through the engine (diagnosis, verify, the
    simulator's fidelity) serve in: bf16 where the CPU computes it natively (AVX512-BF16 or AMX),
    float32 elsewhere. Without either, torch emulates bf16 GEMMs (an AVX2-only AMD EPYC: 19 GFLOP/s
    against fp32's 124-161) and these runs took 4-6x as long: CI ran past its 90 minutes. The engine's
    own dtype=auto makes the same call by measurement (linear_probe.auto_dtype); the tests decide by
    the CPU's flags so that a loaded machine cannot change what they run. PHASELAB_TEST_DTYPE forces
    one."""
    forced = envs.TEST_DTYPE.get()
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{envs.TEST_DTYPE.name}={forced!r}: use float32 or bfloat16")
        return forced
    from phaselab.model.kernels.linear_timing import cpu_info

    isa = cpu_info()["isa"]
    return "bfloat16" if isa["avx512_bf16"] or isa["amx_tile"] else "float32"


def serving_checkpoint():
    """The bundled model as the workload tests serve it, loaded once per module. Serving bf16 (AVX512-BF16
    or AMX): widened to dense bf16 at load, the path these scenarios were sized on. Serving fp32: the
    GGUF's quantized blocks kept and read by the native kernel, as the engine's default keeps them there
    (linear_probe.decide picks the q path). Widened to dense fp32 instead, torch's GEMM ran a decode
    step at batch 2 slower than at batch 1 and at batch 4 (an AVX2-only EPYC: 78, 150 and 136 ms,
    against 38, 41 and 39 ms on the blocks), a cost curve no serving engine has and the one the
    diagnosis was then asked to explain."""
    from phaselab.model.loader import load_checkpoint

    dtype = serving_dtype()
    return load_checkpoint(None, getattr(torch, dtype), keep_packed=dtype == "float32")


def kv_memory(bf16_mib: int) -> str:
    """--kv-cache-memory for as many KV blocks as `bf16_mib` MiB holds in bf16, in serving_dtype():
    the workloads were sized in blocks (a 4 MiB cache is 11 blocks of the bundled model in bf16, 5 in
    fp32, where a request growing to 6 blocks could never run)."""
    return f"{bf16_mib * getattr(torch, serving_dtype()).itemsize // 2}MiB"
