"""Incremental detokenizer: streamed text == full decode (byte-level BPE, hypothesis), stop
strings found across tokens, earliest match wins, nothing streamed is ever retracted."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phaselab.core.sampling_params import SamplingParams
from phaselab.engine.detokenizer import NUM_PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. naïve café — déjà vu.",
    "你好，世界。日本語のテキストを少し。한국어 문장도 있습니다.",
    "Emoji: 😀🎉🚀 👩‍👩‍👧 🇫🇷 and math ∑∫√ plus STOP and stop and done.",
]


@functools.cache
def bpe() -> Tokenizer:
    """A tiny real byte-level BPE (GPT-2 style): multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


class PieceTokenizer:
    """A fake tokenizer whose token i decodes to PIECES[i] (some empty, like a skipped special
    token); counts decode calls and the longest window it was asked to decode."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.num_calls = 0
        self.max_window = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_calls += 1
        self.max_window = max(self.max_window, len(ids))
        return "".join(self.pieces[i] for i in ids)


PIECES = ["a", "b", "c", "ab", "bc", "cab", "", "x", "abca"]


def stream(
    detok: IncrementalDetokenizer, chunks: list[list[int]]
) -> tuple[list[str], str | None, int | None]:
    """Feed chunks, streaming deltas after each; return (deltas, stop, index of stopping chunk)."""
    deltas = []
    for i, chunk in enumerate(chunks):
        stop = detok.update(chunk)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop, i
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None, None


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, pos = [], 0
    for size in sizes:
        if pos >= len(ids):
            break
        chunks.append(ids[pos : pos + size])
        pos += size
    if pos < len(ids):
        chunks.append(ids[pos:])
    return chunks


# ---------------------------------------------------------------- byte-level BPE: exactness


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    output_ids=st.lists(st.integers(0, 399), max_size=40),
    prompt_ids=st.lists(st.integers(0, 399), max_size=8),
    sizes=st.lists(st.integers(1, 4), max_size=40),
    skip_special_tokens=st.booleans(),
)
def test_streamed_text_equals_full_decode(
    output_ids: list[int], prompt_ids: list[int], sizes: list[int], skip_special_tokens: bool
) -> None:
    """Random ids (half characters, stray continuation bytes, special tokens included): the
    concatenated stream is exactly the full decode, and no piece sent before the end is cut
    mid-character. A decode ending in U+FFFD is flushed as such when the request finishes."""
    tok = bpe()
    params = SamplingParams(skip_special_tokens=skip_special_tokens, max_tokens=None)
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, stop, _ = stream(detok, split(output_ids, sizes))
    expected = tok.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert stop is None
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_multibyte_characters_wait_for_all_their_tokens() -> None:
    tok = bpe()
    text = "ok 😀🚀 你好 done"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # the emoji really are split over several tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    pieces = []
    for token_id in ids:
        detok.update([token_id])
        pieces.append(detok.get_next_output_text(finished=False, delta=True))
        assert "\ufffd" not in detok.output_text
    assert "".join(pieces) == text
    assert "" in pieces  # some tokens completed no character on their own


def test_prompt_context_and_sentencepiece_leading_space() -> None:
    """Decoding with prompt context keeps the space a SentencePiece decoder strips at the start."""

    class Metaspace(PieceTokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return super().decode(ids).replace("▁", " ").removeprefix(" ")

    tok = Metaspace(["▁Say", "▁Hello", "▁world", "!"])
    detok = IncrementalDetokenizer(tok, [0], SamplingParams())
    detok.update([1, 2, 3])
    assert detok.get_next_output_text(finished=True, delta=False) == " Hello world!"
    assert IncrementalDetokenizer(tok, [], SamplingParams()).update([1]) is None


def test_per_token_work_is_a_small_window() -> None:
    """No full re-decode: each step decodes a few tokens, whatever the output length."""
    tok = PieceTokenizer(PIECES)
    detok = IncrementalDetokenizer(tok, [7] * 20, SamplingParams(stop=["zzz"], max_tokens=None))
    num_tokens = 2000
    for i in range(num_tokens):
        detok.update([i % 6])
    assert tok.max_window <= NUM_PROMPT_CONTEXT_TOKENS + 2  # context + held empty-text tokens
    assert tok.num_calls <= 2 * num_tokens + 1
    assert len(detok.output_token_ids) == num_tokens


# ---------------------------------------------------------------- stop strings


def reference_stop(pieces: list[str], stops: list[str], include: bool) -> tuple[str, str | None, int]:
    """Brute force: after the first token whose text makes any stop string appear, the earliest
    occurrence (list order on a tie) ends the text. Returns (text, stop, tokens taken)."""
    text = ""
    for n, piece in enumerate(pieces, 1):
        text += piece
        hits = sorted((text.find(s), i) for i, s in enumerate(stops) if s in text)
        if hits:
            start, i = hits[0]
            return (text[: start + len(stops[i])] if include else text[:start]), stops[i], n
    return text, None, len(pieces)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(PIECES) - 1), max_size=30),
    stops=st.lists(st.text(alphabet="abcx", min_size=1, max_size=5), max_size=3),
    include=st.booleans(),
    sizes=st.lists(st.integers(1, 3), max_size=30),
)
def test_stop_strings_match_brute_force(ids: list[int], stops: list[str], include: bool, sizes: list[int]) -> None:
    tok = PieceTokenizer(PIECES)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    detok = IncrementalDetokenizer(tok, [], params)
    chunks = split(ids, sizes)

    deltas, stop, stop_chunk = stream(detok, chunks)
    text, ref_stop, num_taken = reference_stop([PIECES[i] for i in ids], stops, include)
    assert stop == ref_stop
    assert detok.output_text == text
    assert detok.output_token_ids == ids[:num_taken]
    if stop is not None:
        assert stop_chunk is not None and sum(map(len, chunks[:stop_chunk])) < num_taken
    # never retracted: every streamed prefix is a prefix of the final text, and they add up
    streamed = ""
    for d in deltas:
        streamed += d
        assert text.startswith(streamed)
    assert streamed == text


def test_stop_string_spanning_byte_level_tokens() -> None:
    tok = bpe()
    ids = tok.encode("Hello 😀🚀 world").ids
    for include, expected in [(False, "Hello 😀"), (True, "Hello 😀🚀")]:
        detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["🚀", "zzz"], include_stop_str_in_output=include))
        results = [detok.update([t]) for t in ids]
        first = results.index("🚀")
        assert all(r is None for r in results[:first])
        assert tok.decode(ids[: first + 1]).endswith("🚀")  # found at the token completing it
        assert not tok.decode(ids[:first]).endswith("🚀")
        assert detok.output_text == expected
        assert detok.get_next_output_text(finished=True, delta=True) == expected


def test_earliest_match_wins_over_list_order() -> None:
    tok = PieceTokenizer(list("helo wrd"))
    ids = [list("helo wrd").index(c) for c in "hello world"]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world", "o w", "llo w"]))
    assert detok.update(ids) == "llo w"  # "o w" and "llo w" complete with the same token; "llo w" starts first
    assert detok.output_text == "he"
    assert detok.output_token_ids == ids[: len("hello w")]
    assert detok.update([0, 1]) == "llo w"  # stopped: takes nothing more
    assert detok.output_token_ids == ids[: len("hello w")]


def test_partial_stop_string_is_held_back_while_streaming() -> None:
    tok = PieceTokenizer(["ab", "ST", "OP", "cd", "S"])
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP", "xy"]))
    detok.update([0, 3, 1])  # "abcdST"
    assert detok.get_next_output_text(finished=False, delta=True) == "abc"  # 3 = len("STOP") - 1 held
    assert detok.get_next_output_text(finished=False, delta=False) == "abc"
    assert detok.update([4]) is None  # "abcdSTS"
    assert detok.get_next_output_text(finished=False, delta=True) == "d"
    assert detok.update([1, 2]) == "STOP"  # "abcdSTSSTOP"
    assert detok.get_next_output_text(finished=True, delta=True) == "STS"
    assert detok.output_text == "abcdSTS"


def test_no_hold_back_without_stops_or_when_stop_is_included() -> None:
    tok = PieceTokenizer(["ab", "ST"])
    for params in [SamplingParams(), SamplingParams(stop=["STOP"], include_stop_str_in_output=True)]:
        detok = IncrementalDetokenizer(tok, [], params)
        detok.update([0, 1])
        assert detok.get_next_output_text(finished=False, delta=True) == "abST"


@pytest.mark.parametrize("min_tokens, stop_at, expected_stop, expected_text", [(0, 1, "b", "a"), (3, 2, "c", "ab")])
def test_stop_strings_wait_for_min_tokens(min_tokens: int, stop_at: int, expected_stop: str, expected_text: str) -> None:
    """Like vLLM, stop strings count only once min_tokens tokens exist (the "b" of token 2 is
    text by then, and is not searched again)."""
    tok = PieceTokenizer(PIECES)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["b", "c"], min_tokens=min_tokens))
    results = [detok.update([t]) for t in [0, 1, 2, 0]]  # a b c a
    assert results[stop_at] == expected_stop
    assert all(r is None for r in results[:stop_at])
    assert detok.output_text == expected_text
