"""The parameters of the text workloads, light to import (no tokenizer, no numpy): the bench's,
the simulator's and compare's command lines take their defaults and flags from these fields
(cliargs.add_fields), and workload/prompts.py builds the requests from them. The interference
workload's parameters are workload/interference.py's InterferenceParams."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RandomParams:
    num_prompts: int = 100
    input_len: str = "256"
    output_len: str = "128"


@dataclass(frozen=True)
class SharedPrefixParams:
    # num_groups, prefix_len and suffix_len are also the bench's and the simulator's flags (cliargs.add_fields)
    num_prompts: int = 100
    num_groups: int = field(default=4, metadata={"flag": "--num-prefix-groups", "help": "distinct shared prefixes"})
    prefix_len: int = field(default=512, metadata={
        "help": "tokens shared by every request of a group (template included)"})
    suffix_len: str = field(default="64", metadata={"help": "tokens after the prefix, per request (a length spec)"})
    output_len: str = "64"
