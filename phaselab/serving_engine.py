"""The engine surface every front drives, and the one place that picks colocated or disaggregated.

    LLM (offline) ─┐
    server ────────┼─▶ make_engine(args, ...) ─▶ ServingEngine ─┬─ LLMEngine    (engine/: one process)
    cli, compare ──┘                                            └─ DisaggEngine (disagg/: router over
                                                                   prefill/decode workers on Ray)

A front calls only what `ServingEngine` names: it never reaches into a scheduler (queue lengths
and KV usage come from `stats()`), and it passes the stamps it measured itself (arrival,
tokenization) to `add_request` instead of patching records. This module sits above `engine/`
and `disagg/`, so the engine package never imports the disaggregated one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from phaselab.engine_args import EngineArgs
from phaselab.core.outputs import EngineStats
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import IterationRecord, RequestMetrics

if TYPE_CHECKING:
    from phaselab.engine.request_output import RequestOutput


@runtime_checkable
class ServingEngine(Protocol):
    """What LLMEngine and DisaggEngine both are (a test checks both against it)."""

    stamp_sent: bool  # True: "sent" = handed to the caller; False: the front stamps deliveries itself

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrived_ns: int | None = None, *,
                    tokenized_ns: int | None = None, queued_ns: int | None = None,
                    prompt_text: str | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def mark_delivered(self, request_id: str, sent_ns: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def run_config(self) -> dict[str, Any]: ...

    def write_record(self, path: str) -> None: ...

    def shutdown(self) -> None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_config(self) -> Any: ...

    # the phase record (kept only with keep_records)
    @property
    def finished_requests(self) -> list[RequestMetrics]: ...

    @property
    def iterations(self) -> list[IterationRecord]: ...

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    def validate_prompt(self, prompt_token_ids: list[int]) -> None: ...


def make_engine(args: EngineArgs | None = None, *, checkpoint: Any = None, keep_records: bool = True,
                disagg_config: Any = None, **disagg_options: Any) -> ServingEngine:
    """An LLMEngine, or a DisaggEngine when `args.mode == "disagg"` (prefill/decode worker pools).

    checkpoint: an already loaded LoadedCheckpoint (loaded once, shared). keep_records: keep every
    closed record and iteration for a run directory (off: observe them into Prometheus and drop
    them, for a long-running server without --record). disagg_config / disagg_options
    (prefill_overrides, decode_overrides, routing policies): DisaggEngine only."""
    args = args or EngineArgs()
    if args.mode == "disagg":
        from phaselab.disagg.router import DisaggEngine

        return DisaggEngine(args, disagg_config, checkpoint=checkpoint, keep_records=keep_records,
                            **disagg_options)
    if disagg_config is not None or disagg_options:
        raise TypeError(f"disaggregation options {sorted(disagg_options) or ['disagg_config']} need mode='disagg'")
    from phaselab.engine.engine import LLMEngine

    return LLMEngine(args, checkpoint=checkpoint, keep_records=keep_records)
