"""What the cost package reads of a plan and of a recorded iteration, as structural types.

The cost package sits below `core` (the scheduler prices its plans with it), so it cannot name
core's classes; it names the attributes it reads instead. `core.outputs.SchedulerOutput` /
`ScheduledRequest` and `core.timing.IterationRecord` / `ScheduledChunk` satisfy these protocols,
and `mypy --strict` (tests/test_core_typing.py) checks that they do wherever core passes them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PlanEntry(Protocol):
    """One request's share of an iteration (core.outputs.ScheduledRequest)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def start_position(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...

    @property
    def sample(self) -> bool: ...

    @property
    def is_prefill(self) -> bool: ...


class Plan(Protocol):
    """One iteration's plan (core.outputs.SchedulerOutput)."""

    @property
    def scheduled(self) -> Sequence[PlanEntry]: ...

    @property
    def block_size(self) -> int: ...


class RecordedChunk(Protocol):
    """One entry of a recorded iteration (core.timing.ScheduledChunk)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def context_len(self) -> int: ...

    @property
    def is_prefill(self) -> bool: ...


class Modeled(Protocol):
    """The modeled cost a recorded iteration carries (cost.formulas.ModeledCost)."""

    @property
    def matmul_flops(self) -> int: ...

    @property
    def weight_bytes(self) -> int: ...


class RecordedIteration(Protocol):
    """One recorded iteration of one worker (core.timing.IterationRecord)."""

    @property
    def worker(self) -> str: ...

    @property
    def start_ns(self) -> int: ...

    @property
    def end_ns(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_prefill_tokens(self) -> int: ...

    @property
    def num_decode_tokens(self) -> int: ...

    @property
    def chunks(self) -> Sequence[RecordedChunk]: ...

    @property
    def modeled(self) -> Modeled: ...
