"""phaselab/workload: the interference workload's one definition (its units, its JSON, the old
compare summaries), and the arrivals every consumer builds from it."""

from __future__ import annotations

import json

import pytest

from phaselab.sim.workload import interference_requests
from phaselab.workload.driver import interference_arrivals
from phaselab.workload.interference import InterferenceParams


def test_seconds_timed_json_is_what_the_bench_and_simulator_always_wrote() -> None:
    p = InterferenceParams(num_streams=2, long_start_s=1.5, long_interval_s=0.5)
    assert p.to_json() == {"num_streams": 2, "stream_input_len": 64, "stream_output_len": 256, "num_long_prompts": 3,
                           "long_input_len": 1024, "long_output_len": 8, "long_start_s": 1.5, "long_interval_s": 0.5}
    assert InterferenceParams.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_token_time_and_compare_summaries_written_before() -> None:
    p = InterferenceParams.in_tokens(8, 24, stream_output_len=96)
    assert [p.long_arrival_tokens(k) for k in range(3)] == [8, 32, 56]
    assert InterferenceParams.from_json(p.to_json()) == p
    old = {"num_streams": 4, "stream_input_len": 64, "stream_output_len": 96, "num_long_prompts": 3,
           "long_input_len": 1024, "long_output_len": 8, "first_at": 8, "every": 24}  # compare's InterferenceSpec
    assert InterferenceParams.from_json(old) == p


def test_one_unit_only() -> None:
    with pytest.raises(ValueError, match="not both"):
        InterferenceParams(long_start_tokens=4, long_interval_tokens=4)
    with pytest.raises(ValueError):
        InterferenceParams(long_start_s=None, long_interval_s=None)


def test_every_consumer_times_the_long_prompts_alike() -> None:
    p = InterferenceParams(num_streams=3, num_long_prompts=2, long_input_len=100, long_start_s=0.7,
                           long_interval_s=1.1)
    sim = {r.request_id.removeprefix("req-"): r.arrival_s for r in interference_requests(p)}
    real = {a.request_id: a.at_s for a in interference_arrivals(p)}
    assert sim == real == {"stream-0": 0.0, "stream-1": 0.0, "stream-2": 0.0, "long-0": 0.7, "long-1": 0.7 + 1.1}
    tok = interference_arrivals(InterferenceParams.in_tokens(5, 10, num_long_prompts=2))
    assert [a.after_group_tokens for a in tok if a.group == "long"] == [("stream", 5), ("stream", 15)]
