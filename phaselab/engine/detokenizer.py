"""Token ids -> streamed text, one request at a time, with stop strings. Pure Python, no torch.

Incremental decoding (the prefix_offset/read_offset technique of HF text-generation-inference
and vLLM). Only a small window of tokens is decoded per new token:

    ids:   ... | prefix_offset ........ read_offset ............ len(ids)
                 └ prefix_text: decoded, └ new tokens: their text is emitted
                   already emitted           once it is complete

    new_text = decode(ids[prefix_offset:])[len(prefix_text):]

Decoding the window with some already-emitted context (rather than the new tokens alone) keeps
tokenizer-specific joins right (e.g. SentencePiece's leading-space handling). With byte-level BPE
one character can span several tokens; until the window decodes to text that does not end in
U+FFFD the new tokens are held (read_offset stays), so a half character is never emitted. Each
emission starts at a character boundary, which is what makes the concatenation of all emitted
pieces equal `decode(output_ids)` (checked by tests/test_detokenizer.py with hypothesis).

Stop strings are searched only in the newly emitted text plus the last len(stop) - 1 characters
before it, so the per-token cost is independent of the output length.
"""

from __future__ import annotations

from typing import Protocol

from phaselab.core.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM uses the same number).
NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class SupportsDecode(Protocol):
    """The one tokenizer method the detokenizer needs (phaselab.modelinfo.tokenizer.Tokenizer and
    `tokenizers.Tokenizer` both have it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Per-request text state: turns the sampled token ids into text and detects stop strings.

    Lifecycle: `update()` after every step with the request's new token ids (it returns the stop
    string that just matched, if any: the caller then finishes the request with that
    stop_reason), `get_next_output_text()` whenever output is streamed; once the request is
    finished, `get_next_output_text(finished=True, ...)` also flushes any text still held back.
    """

    def __init__(self, tokenizer: SupportsDecode, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Streaming holds back this many trailing chars so a partial stop string is never sent and
        # then retracted. Not needed when the stop string itself is part of the output.
        self._stop_buffer_len = max((len(s) for s in self._stop), default=1) - 1 if not self._include_stop else 0

        # Window state. `_ids` holds the prompt context then every output token. The context is
        # used only if it decodes cleanly: a prompt ending mid-character (raw token-id prompts
        # can) would otherwise glue its half character onto the first output token.
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT_CHAR):
            context, context_text = [], ""
        self._ids: list[int] = context
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text

        self._text = ""  # all emitted text; truncated at the stop string once one matched
        self._stop_reason: str | None = None
        self._num_sent_chars = 0  # how much of _text get_next_output_text has handed out

    # ---------------------------------------------------------------- public state

    @property
    def output_text(self) -> str:
        """All text so far (stop string excluded unless include_stop_str_in_output).

        Never ends in half a character: tokens whose text is incomplete (e.g. max_tokens cut an
        emoji in two) are left out until more tokens complete it or the final
        `get_next_output_text(finished=True, ...)` flushes them, so read the final text after
        that call (or use its return value with delta=False)."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens taken so far (none after a stop string matched)."""
        return self._ids[self._num_context_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_context_tokens

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_reason

    # ---------------------------------------------------------------- per step

    def update(self, new_token_ids: list[int]) -> str | None:
        """Take new tokens one by one; return the stop string as soon as one is in the text.

        Tokens after the one that completed a stop string are not taken (`output_token_ids`
        says which were). Once stopped, every later call takes nothing and returns the same stop
        string again, so a caller racing a finish cannot miss or restart it.
        """
        if self._stop_reason is not None:
            return self._stop_reason
        for token_id in new_token_ids:
            self._ids.append(token_id)
            new_text = self._decode_next()
            if new_text:
                self._text += new_text
                if self._stop and self.num_output_tokens >= self._min_tokens and self._check_stop(len(new_text)):
                    return self._stop_reason
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream: what is new since the last call (delta) or everything so far.

        While not finished the last (max stop length - 1) characters are held back; a finished
        (or stopped) request gets everything, including text of tokens that never decoded to a
        complete character (that text then ends in U+FFFD, exactly as the full decode does).
        """
        if finished:
            self._flush()
        hold = 0 if finished or self._stop_reason is not None else self._stop_buffer_len
        end = max(len(self._text) - hold, 0)
        if not delta:
            return self._text[:end]
        if end <= self._num_sent_chars:
            return ""
        start, self._num_sent_chars = self._num_sent_chars, end
        return self._text[start:end]

    # ---------------------------------------------------------------- internals

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self) -> str:
        """Complete text added by the tokens after read_offset, or "" while it is incomplete."""
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still waits for its remaining bytes
        new_text = window_text[len(self._prefix_text) :]
        # Advance: the just-emitted tokens become the next window's context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        return new_text

    def _flush(self) -> None:
        """Emit the held text of tokens that never completed a character (end of request)."""
        if self._stop_reason is not None or self._read_offset == len(self._ids):
            return
        window_text = self._decode(self._ids[self._prefix_offset :])
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        if new_text:
            self._text += new_text
            if self._stop and self.num_output_tokens >= self._min_tokens:
                self._check_stop(len(new_text))  # too late to report, but keeps the text clean

    def _check_stop(self, num_new_chars: int) -> bool:
        """Find the earliest stop string that ends inside the new text; truncate there.

        A match must overlap the new text, so only the new chars plus len(stop) - 1 older ones are
        searched. Earliest start wins; equal starts go to the one listed first.
        """
        text = self._text
        best: tuple[int, int] | None = None  # (start, index in self._stop)
        for i, stop in enumerate(self._stop):
            start = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
            if start != -1 and (best is None or start < best[0]):
                best = (start, i)
        if best is None:
            return False
        start, i = best
        stop = self._stop[i]
        self._text = text[: start + len(stop)] if self._include_stop else text[:start]
        self._stop_reason = stop
        return True
