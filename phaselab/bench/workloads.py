"""Workloads: the requests of a run, built before it starts (docs/bench.md lists every parameter).

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
come from `phaselab.spec` (the torch-free model description).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from phaselab.bench.client import RequestSpec
from phaselab.spec.bundled import default_model_path
from phaselab.spec.tokenizer import Tokenizer, load_tokenizer


class WorkloadError(ValueError):
    """A workload cannot be built as asked (bad length spec, prompt shorter than the template, ...)."""


# -- the tokenizer, torch-free -------------------------------------------------------------------------
def load_bench_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer at `path` (GGUF file, HF directory or tokenizer.json; default: the bundled model).

    Cached per path: reading a GGUF header takes seconds.
    """
    return _load_tokenizer_cached(os.path.abspath(path or default_model_path()))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str) -> Tokenizer:
    return load_tokenizer(path)


# -- length distributions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, parsed from a short spec (every draw is >= 1):

        "256"                  always 256
        "uniform:128:512"      integers uniform in [128, 512]   (vLLM --random-range-ratio r on L:
                                                                 uniform:L*(1-r):L*(1+r))
        "normal:256:64"        mean 256, std 64, rounded
        "lognormal:256:0.5"    median 256, sigma 0.5 of the log (long tail, like chat traffic)
        "choice:128,256,1024"  one of the listed lengths, equally likely
    """

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        text = str(spec).strip()
        if re.fullmatch(r"\d+", text):
            return cls("fixed", (float(text),))
        kind, _, rest = text.partition(":")
        try:
            if kind == "choice":
                values = tuple(float(v) for v in rest.split(","))
                if not values:
                    raise ValueError
                return cls(kind, values)
            params = tuple(float(v) for v in rest.split(":"))
        except ValueError:
            params = ()
        arity = {"uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in arity or len(params) != arity[kind]:
            raise WorkloadError(
                f"length spec {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA "
                "or choice:A,B,C"
            )
        if kind == "uniform" and params[0] > params[1]:
            raise WorkloadError(f"length spec {spec!r}: LO must be <= HI")
        return cls(kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        p = self.params
        if self.kind == "fixed":
            draws = np.full(n, p[0])
        elif self.kind == "uniform":
            draws = rng.integers(int(p[0]), int(p[1]), size=n, endpoint=True)
        elif self.kind == "normal":
            draws = np.rint(rng.normal(p[0], p[1], size=n))
        elif self.kind == "lognormal":
            draws = np.rint(rng.lognormal(math.log(p[0]), p[1], size=n))
        else:
            draws = rng.choice(np.asarray(p), size=n)
        return [max(1, int(v)) for v in draws]

    def mean(self) -> float:
        p = self.params
        return {
            "fixed": lambda: p[0], "uniform": lambda: (p[0] + p[1]) / 2, "normal": lambda: p[0],
            "lognormal": lambda: p[0] * math.exp(p[1] ** 2 / 2), "choice": lambda: sum(p) / len(p),
        }[self.kind]()

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        sep = "," if self.kind == "choice" else ":"
        return self.kind + ":" + sep.join(f"{v:g}" for v in self.params)


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
@dataclass(frozen=True)
class RandomParams:
    num_prompts: int = 100
    input_len: str = "256"
    output_len: str = "128"


@dataclass(frozen=True)
class SharedPrefixParams:
    num_prompts: int = 100
    num_groups: int = 4  # distinct prefixes
    prefix_len: int = 512  # tokens shared by every request of a group (template included)
    suffix_len: str = "64"  # tokens after the prefix, per request
    output_len: str = "64"


@dataclass(frozen=True)
class InterferenceParams:
    num_streams: int = 4  # long-lived streams, all started at t=0
    stream_input_len: int = 64
    stream_output_len: int = 256
    num_long_prompts: int = 3
    long_input_len: int = 1024
    long_output_len: int = 8
    long_start_s: float = 2.0  # first long prompt, once the streams are decoding
    long_interval_s: float = 2.0  # between long prompts


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
    """Streams ("stream") at t=0; long prompts ("long") at long_start_s + k * long_interval_s.
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
                    arrival_s=p.long_start_s + k * p.long_interval_s)
        for k in range(p.num_long_prompts)
    ]
    return specs


# Trace keys, first match wins. Arrival: seconds, or milliseconds (Mooncake's "timestamp").
_TRACE_ARRIVAL_S = ("arrival_s", "timestamp_s")
_TRACE_ARRIVAL_MS = ("timestamp_ms", "timestamp")
_TRACE_INPUT_TOKENS = ("input_tokens", "input_length", "prompt_tokens")
_TRACE_OUTPUT_TOKENS = ("output_tokens", "output_length", "max_tokens")


def read_trace_rows(path: str, num_prompts: int | None = None) -> list[tuple[float, dict[str, Any]]]:
    """(arrival in seconds, row) of every request line of a trace JSONL, in file order: the one
    reader of the trace format, shared with the simulator. Raises WorkloadError naming the line."""
    rows: list[tuple[float, dict[str, Any]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{lineno}: not JSON ({e.msg})") from e
            arrival = _first(row, _TRACE_ARRIVAL_S)
            if arrival is None and (ms := _first(row, _TRACE_ARRIVAL_MS)) is not None:
                arrival = ms / 1000.0
            if arrival is None:
                raise WorkloadError(f"{path}:{lineno}: no arrival time (one of {_TRACE_ARRIVAL_S + _TRACE_ARRIVAL_MS})")
            rows.append((float(arrival), row))
            if num_prompts is not None and len(rows) >= num_prompts:
                break
    if not rows:
        raise WorkloadError(f"{path} holds no requests")
    return rows


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
        n_out = _first(row, _TRACE_OUTPUT_TOKENS)
        if n_out is None:
            raise WorkloadError(f"{path}: request {i} has no output length (one of {_TRACE_OUTPUT_TOKENS})")
        if isinstance(row.get("prompt"), str):
            text = row["prompt"]
            n_in = builder.count(text) if builder is not None else None
        else:
            n_in = _first(row, _TRACE_INPUT_TOKENS)
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


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        if row.get(k) is not None:
            return row[k]
    return None


