"""The interference workload, one definition for the bench, the simulator, compare and the benchmarks.

"A new long prompt freezes the other streams", measured from the streams' gaps: `num_streams`
requests start at t=0 and decode `stream_output_len` tokens each; while they stream,
`num_long_prompts` prompts of `long_input_len` tokens arrive and ask for `long_output_len` tokens.

When the long prompts arrive is given in one of two units, named in the field:

    seconds (wall or simulated clock)   long prompt k at long_start_s + k * long_interval_s
    tokens (the streams' progress)      long prompt k when every stream has received
                                        long_start_tokens + k * long_interval_tokens tokens

Token time puts a long prompt at the same point of the streams' progress whatever the machine's
speed (what `phaselab compare` uses on this CPU); seconds are what a client or a trace can send.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class InterferenceParams:
    # each field is also the flag of the bench's and the simulator's interference workload (cliargs.add_fields)
    num_streams: int = field(default=4, metadata={"help": "long-lived streams, all started at t=0"})
    stream_input_len: int = field(default=64, metadata={"help": "prompt tokens of a stream"})
    stream_output_len: int = field(default=256, metadata={
        "help": "tokens each stream decodes (against a server: with --ignore-eos)"})
    num_long_prompts: int = field(default=3, metadata={"help": "long prompts sent among the streams"})
    long_input_len: int = field(default=1024, metadata={"help": "prompt tokens of a long prompt"})
    long_output_len: int = field(default=8, metadata={"help": "tokens a long prompt decodes"})
    long_start_s: float | None = field(default=2.0, metadata={
        "flag": "--long-start", "metavar": "SECONDS", "help": "seconds before the first long prompt, once the "
                                                              "streams are decoding"})
    long_interval_s: float | None = field(default=2.0, metadata={
        "flag": "--long-interval", "metavar": "SECONDS", "help": "seconds between long prompts"})
    # token time: set both (and the seconds to None); no flag (compare and the tests use it)
    long_start_tokens: int | None = field(default=None, metadata={"cli": False})
    long_interval_tokens: int | None = field(default=None, metadata={"cli": False})

    def __post_init__(self) -> None:
        timed_s = self.long_start_s is not None and self.long_interval_s is not None
        timed_tokens = self.long_start_tokens is not None and self.long_interval_tokens is not None
        if timed_s == timed_tokens:
            raise ValueError("interference: time the long prompts in seconds (long_start_s, long_interval_s) or in "
                             "stream tokens (long_start_tokens, long_interval_tokens, with the seconds None), not both")

    @classmethod
    def in_tokens(cls, start: int, interval: int, **kw: Any) -> InterferenceParams:
        """Long prompt k when every stream has received start + k * interval tokens."""
        return cls(long_start_s=None, long_interval_s=None, long_start_tokens=start, long_interval_tokens=interval,
                   **kw)

    @property
    def token_timed(self) -> bool:
        return self.long_start_tokens is not None

    def long_arrival_s(self, k: int) -> float:
        """Seconds from the start at which long prompt k arrives (seconds-timed only)."""
        assert self.long_start_s is not None and self.long_interval_s is not None, "token-timed workload"
        return self.long_start_s + k * self.long_interval_s

    def long_arrival_tokens(self, k: int) -> int:
        """Stream tokens after which long prompt k arrives (token-timed only)."""
        assert self.long_start_tokens is not None and self.long_interval_tokens is not None, "seconds-timed workload"
        return self.long_start_tokens + k * self.long_interval_tokens

    def to_json(self) -> dict[str, Any]:
        """The fields, without the unused unit's (so a seconds-timed workload reads as it always did)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> InterferenceParams:
        """Read to_json's output; also compare's summary.json of before this module (`first_at`, `every`:
        stream tokens)."""
        d = dict(d)
        if "first_at" in d or "every" in d:
            return cls.in_tokens(d.pop("first_at"), d.pop("every"), **d)
        if "long_start_tokens" in d:
            d.setdefault("long_start_s", None)
            d.setdefault("long_interval_s", None)
        return cls(**d)
