"""Workloads: prompts of exact token lengths (bundled tokenizer), shared prefixes, interference, traces."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from phaselab.workload.prompts import (
    InterferenceParams, PromptBuilder, RandomParams, SharedPrefixParams, WorkloadError, interference_workload,
    load_bench_tokenizer, random_workload, shared_prefix_workload, trace_workload,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_bench_tokenizer()


@pytest.fixture(scope="module")
def chat(tokenizer):
    return PromptBuilder(tokenizer, "chat")


@pytest.fixture(scope="module")
def completions(tokenizer):
    return PromptBuilder(tokenizer, "completions")


def rendered_ids(tokenizer, text: str) -> list[int]:
    """What a server does with a chat request: render the template, encode without special tokens."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 257, 1000, 3000])
def test_completions_prompts_have_the_exact_length(completions, tokenizer, n):
    text = completions.build(np.random.default_rng(n), n)
    assert len(tokenizer.encode(text)) == n


@pytest.mark.parametrize("extra", [1, 2, 50, 999])
def test_chat_prompts_count_the_template(chat, tokenizer, extra):
    n = chat.overhead + extra
    text = chat.build(np.random.default_rng(extra), n)
    assert len(rendered_ids(tokenizer, text)) == n
    assert chat.overhead > 10  # SmolLM2's template adds a system prompt


def test_too_short_for_the_template_is_a_friendly_error(chat):
    with pytest.raises(WorkloadError, match="chat template alone take"):
        chat.build(np.random.default_rng(0), chat.overhead)


def test_random_workload_is_seeded(completions):
    p = RandomParams(num_prompts=20, input_len="uniform:5:300", output_len="choice:4,8")
    a = random_workload(p, completions, np.random.default_rng(11))
    b = random_workload(p, completions, np.random.default_rng(11))
    c = random_workload(p, completions, np.random.default_rng(12))
    assert [(s.prompt, s.max_tokens) for s in a] == [(s.prompt, s.max_tokens) for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert all(5 <= s.num_prompt_tokens <= 300 and s.max_tokens in (4, 8) for s in a)
    assert len({s.request_id for s in a}) == 20


def test_shared_prefix_groups_share_exactly_the_prefix(chat, tokenizer):
    p = SharedPrefixParams(num_prompts=9, num_groups=3, prefix_len=120, suffix_len="uniform:10:40", output_len="4")
    specs = shared_prefix_workload(p, chat, np.random.default_rng(5))
    ids = [rendered_ids(tokenizer, s.prompt) for s in specs]
    for s, toks in zip(specs, ids):
        assert len(toks) == s.num_prompt_tokens and 130 <= len(toks) <= 160
    assert [s.group for s in specs[:4]] == ["group-0", "group-1", "group-2", "group-0"]
    for i in range(9):
        for j in range(i + 1, 9):
            same_prefix = ids[i][:120] == ids[j][:120]
            assert same_prefix == (specs[i].group == specs[j].group)


def test_interference_workload_times_and_groups(chat):
    p = InterferenceParams(num_streams=3, stream_input_len=40, stream_output_len=50, num_long_prompts=2,
                           long_input_len=500, long_output_len=4, long_start_s=1.5, long_interval_s=2.5)
    specs = interference_workload(p, chat, np.random.default_rng(0))
    assert [(s.group, s.arrival_s, s.num_prompt_tokens, s.max_tokens) for s in specs] == [
        ("stream", 0.0, 40, 50)] * 3 + [("long", 1.5, 500, 4), ("long", 4.0, 500, 4)]


def test_trace_formats(tmp_path, completions, tokenizer):
    f = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": 10.5, "input_tokens": 33, "output_tokens": 5},
        {"timestamp_ms": 12000, "prompt": "Hello there", "output_tokens": 3, "request_id": "mine"},
        {"timestamp": 11000, "input_length": 12, "output_length": 2},  # Mooncake's keys (ms)
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = trace_workload(str(f), completions, np.random.default_rng(0))
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 1.5, 0.5])
    assert [s.max_tokens for s in specs] == [5, 3, 2]
    assert len(tokenizer.encode(specs[0].prompt)) == 33 and specs[0].num_prompt_tokens == 33
    assert specs[1].prompt == "Hello there" and specs[1].request_id == "mine"
    assert specs[1].num_prompt_tokens == len(tokenizer.encode("Hello there"))
    assert len(trace_workload(str(f), completions, np.random.default_rng(0), num_prompts=2)) == 2
    # text-only traces need no tokenizer
    only_text = tmp_path / "text.jsonl"
    only_text.write_text(json.dumps({"arrival_s": 0, "prompt": "x", "max_tokens": 1}) + "\n")
    (spec,) = trace_workload(str(only_text), None, np.random.default_rng(0))
    assert spec.num_prompt_tokens is None


@pytest.mark.parametrize("line, match", [
    ("{not json", "not JSON"),
    ('{"input_tokens": 3, "output_tokens": 1}', "no arrival time"),
    ('{"arrival_s": 0, "input_tokens": 3}', "no output length"),
    ('{"arrival_s": 0, "output_tokens": 3}', "neither 'prompt' nor an input length"),
])
def test_trace_errors(tmp_path, completions, line, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=match):
        trace_workload(str(f), completions, np.random.default_rng(0))


def test_the_bench_never_imports_torch():
    code = (
        "import sys\n"
        "import phaselab.bench.bench_cli, phaselab.bench.bench_run, phaselab.bench.bench_report\n"
        "from phaselab.workload.prompts import PromptBuilder, load_bench_tokenizer\n"
        "PromptBuilder(load_bench_tokenizer(), 'chat')\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
