"""The one prompt check: what every front (engine, router, server, simulator) refuses before queueing.

Pure: the caller passes the limits. A prompt is servable when it is non-empty, every token id is in
the vocabulary, and prompt plus at least one output token fit `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Sequence

from phaselab.errors import InvalidRequestError


def first_out_of_vocab(token_ids: Sequence[object], vocab_size: int) -> object | None:
    """The first entry that is not an int in [0, vocab_size), or None."""
    return next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)


def prompt_too_long(num_prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt of this length cannot be served (None: it can)."""
    if num_prompt_tokens >= max_model_len:
        return (f"the prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len} (prompt plus at "
                "least one output token must fit); shorten the prompt or raise --max-model-len / --kv-cache-memory")
    return None


def validate_prompt(token_ids: Sequence[object], vocab_size: int | None, max_model_len: int) -> None:
    """Raise InvalidRequestError (touching no state) for a prompt that cannot be served.
    `vocab_size` None: ids are not checked (a simulated workload has no vocabulary)."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty; give at least one token")
    if vocab_size is not None:
        bad = first_out_of_vocab(token_ids, vocab_size)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    why = prompt_too_long(len(token_ids), max_model_len)
    if why is not None:
        raise InvalidRequestError(why)
