"""Text workloads: the requests `phaselab bench` sends, built before the run starts (docs/bench.md
lists every parameter). Lengths, arrivals, the interference timing and the trace reader are this
package's other modules; this one turns them into prompt text of exact token lengths.

    random          input/output lengths drawn from LengthDists; open or closed loop
    shared-prefix   groups of requests whose prompts share a long prefix (prefix caching)
    interference    N long-lived streams decoding while long prompts arrive at intervals:
                    "a new long prompt freezes the other streams", measured from the streams' gaps
    trace           JSONL: arrival time, input tokens or text, output tokens (Mooncake keys too)

Prompts of an exact token length. Prompts are made of whole-word vocabulary entries (" word"
tokens that encode back to themselves), so a prompt of k words is k tokens in any position where
the pre-tokenizer splits on spaces. The count that matters is the server's: for completions the
encoded prompt (BOS included when the tokenizer adds it), for chat the rendered chat template
encoded without special tokens. Each prompt is checked with that exact count and its word count
corrected until it matches, so the server counts what was asked.

The bench never imports torch: the tokenizer, a GGUF's vocabulary and the bundled model's location
come from `phaselab.modelinfo` (the torch-free model description).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import numpy as np

from phaselab.modelinfo.bundled import default_model_path
from phaselab.modelinfo.tokenizer import Tokenizer, load_tokenizer
from phaselab.workload.interference import InterferenceParams
from phaselab.workload.params import RandomParams, SharedPrefixParams
from phaselab.workload.lengths import LengthDist, WorkloadError
from phaselab.workload.request_spec import RequestSpec
from phaselab.workload.trace_file import TRACE_INPUT_TOKENS, TRACE_OUTPUT_TOKENS, first_of, read_trace_rows


# -- the tokenizer, torch-free -------------------------------------------------------------------------
def load_bench_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer at `path` (GGUF file, HF directory or tokenizer.json; default: the bundled model).

    Cached per path: reading a GGUF header takes seconds.
    """
    return _load_tokenizer_cached(os.path.abspath(path or default_model_path()))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str) -> Tokenizer:
    return load_tokenizer(path)




# -- prompts of an exact token length ------------------------------------------------------------------------
class PromptBuilder:
    """Builds prompt text that the server will count as exactly n tokens (see module docstring)."""

    def __init__(self, tokenizer: Tokenizer, endpoint: str) -> None:
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        vocab = tokenizer.backend.get_vocab()
        spaced, bare = [], []
        for piece, token_id in vocab.items():
            # "Ġ" is the byte-level form of a leading space
            if re.fullmatch(r"Ġ[a-z]{2,12}", piece):
                word = piece[1:]
                if tokenizer.backend.encode(" " + word, add_special_tokens=False).ids == [token_id]:
                    spaced.append(word)
                    if len(tokenizer.backend.encode(word, add_special_tokens=False).ids) == 1:
                        bare.append(word)
        if len(spaced) < 100 or not bare:
            raise WorkloadError(
                "this tokenizer has too few whole-word tokens (' word') to build prompts of exact lengths; "
                "use a trace with text prompts"
            )
        self.words = np.array(sorted(spaced))
        self.first_words = np.array(sorted(bare))
        probe = str(self.first_words[0])
        self.overhead = self.count(probe) - 1  # template/BOS tokens around the text
        # of which before the text (the part a shared prefix shares too)
        probe_id = tokenizer.backend.encode(probe, add_special_tokens=False).ids[0]
        self.leading_overhead = self.ids(probe).index(probe_id)

    def ids(self, text: str) -> list[int]:
        """The prompt token ids the server sees for `text` on this endpoint."""
        tok = self.tokenizer
        if self.endpoint == "chat":
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            return tok.encode(rendered, add_special_tokens=False)
        return tok.encode(text)

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def min_tokens(self) -> int:
        return self.overhead + 1

    def random_words(self, rng: np.random.Generator, n: int) -> list[str]:
        if n <= 0:
            return []
        first = str(rng.choice(self.first_words))
        return [first, *rng.choice(self.words, size=n - 1).tolist()]

    def build(self, rng: np.random.Generator, num_tokens: int, prefix: list[str] | None = None) -> str:
        """Text that counts as exactly `num_tokens`, starting with the words of `prefix` if given."""
        if num_tokens < self.min_tokens() + len(prefix or ()):
            where = "the chat template" if self.endpoint == "chat" else "the special tokens"
            raise WorkloadError(
                f"a prompt of {num_tokens} tokens is impossible here: {where} alone take {self.overhead} "
                f"tokens{' and the shared prefix ' + str(len(prefix)) if prefix else ''}; ask for more "
                f"(at least {self.min_tokens() + len(prefix or ())})"
                + ("" if self.endpoint == "completions" else ", or use --endpoint completions")
            )
        head = list(prefix or ())
        budget = num_tokens - self.overhead - len(head)
        pool = (rng.choice(self.words, size=budget + 16).tolist() if head
                else self.random_words(rng, budget + 16))
        k = budget
        for _ in range(8):
            text = " ".join(head + pool[:k])
            got = self.count(text)
            if got == num_tokens:
                return text
            k += num_tokens - got
            if k < 0 or k > len(pool):
                break
        raise WorkloadError(f"could not build a prompt of exactly {num_tokens} tokens with this tokenizer")


# -- workloads ------------------------------------------------------------------------------------------------
def random_workload(p: RandomParams, builder: PromptBuilder, rng: np.random.Generator,
                    id_prefix: str = "req") -> list[RequestSpec]:
    ins = LengthDist.parse(p.input_len).sample(rng, p.num_prompts)
    outs = LengthDist.parse(p.output_len).sample(rng, p.num_prompts)
    return [
        RequestSpec(f"{id_prefix}-{i}", builder.build(rng, n_in), n_out, num_prompt_tokens=n_in)
        for i, (n_in, n_out) in enumerate(zip(ins, outs))
    ]


def shared_prefix_workload(p: SharedPrefixParams, builder: PromptBuilder, rng: np.random.Generator,
                           id_prefix: str = "req") -> list[RequestSpec]:
    """Request i belongs to group i % num_groups (groups interleave, so a prefix is reused while
    others are too). The first `prefix_len` prompt tokens (template tokens before the text included)
    are the group's; each prompt is prefix_len + suffix tokens (template tokens after the text
    included), so the requested lengths are what the server counts."""
    prefix_words = p.prefix_len - builder.leading_overhead
    if prefix_words < 1:
        raise WorkloadError(
            f"prefix_len {p.prefix_len} is not longer than the template before the text ({builder.leading_overhead} tokens)")
    prefixes = [builder.random_words(rng, prefix_words) for _ in range(p.num_groups)]
    suffixes = LengthDist.parse(p.suffix_len).sample(rng, p.num_prompts)
    trailing = builder.overhead - builder.leading_overhead
    if suffixes and min(suffixes) <= trailing:
        raise WorkloadError(f"suffix lengths must exceed the {trailing} template tokens after the text "
                            f"(drew {min(suffixes)} from {p.suffix_len!r})")
    outs = LengthDist.parse(p.output_len).sample(rng, p.num_prompts)
    specs = []
    for i, (n_suffix, n_out) in enumerate(zip(suffixes, outs)):
        g = i % p.num_groups
        n_in = p.prefix_len + n_suffix
        specs.append(RequestSpec(f"{id_prefix}-{i}", builder.build(rng, n_in, prefix=prefixes[g]), n_out,
                                 num_prompt_tokens=n_in, group=f"group-{g}"))
    return specs


def interference_workload(p: InterferenceParams, builder: PromptBuilder, rng: np.random.Generator,
                          id_prefix: str = "req") -> list[RequestSpec]:
    """Streams ("stream") at t=0; long prompts ("long") at long_start_s + k * long_interval_s
    (seconds: a client sends at times, not at the streams' token counts).
    The streams should still be decoding when the last long prompt arrives: with ignore_eos, give
    them stream_output_len > (last arrival + its prefill) / the server's decode step time."""
    specs = [
        RequestSpec(f"{id_prefix}-stream-{i}", builder.build(rng, p.stream_input_len), p.stream_output_len,
                    num_prompt_tokens=p.stream_input_len, group="stream", arrival_s=0.0)
        for i in range(p.num_streams)
    ]
    specs += [
        RequestSpec(f"{id_prefix}-long-{k}", builder.build(rng, p.long_input_len), p.long_output_len,
                    num_prompt_tokens=p.long_input_len, group="long",
                    arrival_s=p.long_arrival_s(k))
        for k in range(p.num_long_prompts)
    ]
    return specs


def trace_workload(path: str, builder: PromptBuilder | None, rng: np.random.Generator,
                   num_prompts: int | None = None, id_prefix: str = "req") -> list[RequestSpec]:
    """One request per JSONL line: {"arrival_s": 0.5, "input_tokens": 812, "output_tokens": 64}.

    Arrival: `arrival_s`/`timestamp_s` (seconds) or `timestamp_ms`/`timestamp` (milliseconds, as in
    the Mooncake traces); offsets are taken from the earliest one. Input: `prompt` (text sent as
    is) or `input_tokens`/`input_length`/`prompt_tokens` (a prompt of exactly that many tokens is
    built). Output: `output_tokens`/`output_length`/`max_tokens`. Optional `request_id`, `group`.
    """
    rows = read_trace_rows(path, num_prompts)
    t0 = min(a for a, _ in rows)
    specs = []
    for i, (arrival, row) in enumerate(rows):
        n_out = first_of(row, TRACE_OUTPUT_TOKENS)
        if n_out is None:
            raise WorkloadError(f"{path}: request {i} has no output length (one of {TRACE_OUTPUT_TOKENS})")
        if isinstance(row.get("prompt"), str):
            text = row["prompt"]
            n_in = builder.count(text) if builder is not None else None
        else:
            n_in = first_of(row, TRACE_INPUT_TOKENS)
            if n_in is None:
                raise WorkloadError(f"{path}: request {i} has neither 'prompt' nor an input length")
            if builder is None:
                raise WorkloadError("a trace with input lengths needs a tokenizer to build the prompts")
            text = builder.build(rng, int(n_in))
        specs.append(RequestSpec(
            str(row.get("request_id") or f"{id_prefix}-{i}"), text, int(n_out),
            num_prompt_tokens=None if n_in is None else int(n_in),
            group=str(row.get("group", "default")), arrival_s=arrival - t0,
        ))
    return specs


def build_specs(ns: Any, builder: PromptBuilder | None,
                   rng: np.random.Generator) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(measured specs, warm-up specs) of `phaselab bench`'s options `ns` (its argparse namespace; the
    simulator's --tokenizer mode builds the same). Warm-ups come from the same workload, with their own ids."""
    n_warm = ns.num_warmups
    if ns.workload == "trace":
        if not ns.trace:
            raise WorkloadError("--workload trace needs --trace FILE")
        specs = trace_workload(ns.trace, builder, rng, num_prompts=ns.num_prompts)
        warm = [RequestSpec(f"warmup-{i}", s.prompt, s.max_tokens, s.num_prompt_tokens, warmup=True)
                for i, s in enumerate(specs[:n_warm])]
        return specs, warm
    assert builder is not None
    if ns.workload == "random":
        specs = random_workload(RandomParams(ns.num_prompts, ns.input_len, ns.output_len), builder, rng)
        warm = random_workload(RandomParams(n_warm, ns.input_len, ns.output_len), builder, rng, "warmup")
    elif ns.workload == "shared-prefix":
        params = SharedPrefixParams(ns.num_prompts, ns.num_groups, ns.prefix_len, ns.suffix_len, ns.output_len)
        specs = shared_prefix_workload(params, builder, rng)
        # warm-ups of the same length but their own text: they must not warm the groups' prefixes
        warm = random_workload(RandomParams(n_warm, str(ns.prefix_len), ns.output_len), builder, rng, "warmup")
    else:
        params = InterferenceParams(
            ns.num_streams, ns.stream_input_len, ns.stream_output_len, ns.num_long_prompts, ns.long_input_len,
            ns.long_output_len, ns.long_start_s, ns.long_interval_s)
        specs = interference_workload(params, builder, rng)
        warm = random_workload(RandomParams(n_warm, str(ns.stream_input_len), "8"), builder, rng, "warmup")
    for s in warm:
        s.warmup = True
    return specs, warm
