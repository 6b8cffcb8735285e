"""A request's state: token counters are the state; the phase is derived from them.

    WAITING ──schedule──▶ RUNNING ──update (stop/length)──▶ FINISHED_*
       ▲                     │
       └──── PREEMPTED ◀─────┘  (blocks freed; recompute from token 0 on resume)

There is no stored "prefill" or "decode" flag: a request computes `num_tokens -
num_computed_tokens` more tokens, and samples when that reaches zero. `phase` labels it for
measurement only.
"""

from __future__ import annotations

import enum

from phaselab.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that every finished state compares greater than PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason of a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        prefill_only: bool = False,
    ) -> None:
        assert prompt_token_ids, "a request needs at least one prompt token"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time  # caller's clock (seconds); core never reads one
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not admitted yet
        # prompt tokens at first admission in full blocks that started an earlier request too, cache on or
        # off (KVCacheManager.count_repeats): what a prefix cache with room for them could skip
        self.num_repeat_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        # Disaggregated prefill: once a step has sampled its next token (and it did not finish),
        # the request is parked: no longer scheduled, its blocks kept until the caller frees them
        # (the KV is moved to a decode worker). See Scheduler.parked.
        self.prefill_only = prefill_only
        max_tokens = sampling_params.max_tokens
        # The most tokens this request may ever hold: prompt + max_tokens, capped by max_model_len.
        cap = len(prompt_token_ids) + max_tokens if max_tokens is not None else None
        if max_model_len is not None:
            cap = max_model_len if cap is None else min(cap, max_model_len)
        self.max_num_tokens = cap

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Derived phase: more than one token to compute, or no token sampled yet.

        After a preemption the recomputation of prompt + outputs is a prefill too.
        """
        return self.num_tokens_to_compute > 1 or self.num_output_tokens == 0

    @property
    def phase(self) -> str:
        return "prefill" if self.is_prefill else "decode"

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
