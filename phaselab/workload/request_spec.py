"""RequestSpec: one request of a text workload, as `phaselab bench` sends it (light: no tokenizer import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestSpec:
    """One request of a workload, fully built before the run starts (no work on the hot path)."""

    request_id: str
    prompt: str  # user message (chat) or prompt text (completions)
    max_tokens: int
    num_prompt_tokens: int | None = None  # what the server should count, when the builder knows
    group: str = "default"  # workload role: "stream"/"long" (interference), "group-3" (shared-prefix)
    arrival_s: float | None = None  # self-timed workloads (trace, interference): offset from start
    warmup: bool = False
    prompt_token_ids: list[int] | None = None  # completions: sent as the prompt instead of the text
