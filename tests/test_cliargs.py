"""One source per knob (issue 14): the engine's and the simulator's flags are generated from their
config dataclasses, and the chunk budget's default is decided in SchedulerConfig only."""

from __future__ import annotations

import dataclasses

import pytest

from phaselab.cli import _engine_args, build_parser
from phaselab.engine_args import EngineArgs
from phaselab.core.config import CHUNKED_BUDGET_DEFAULT, SchedulerConfig
from phaselab.errors import ConfigError
from phaselab.cost.catalog import get_hardware, get_model
from phaselab.sim.simulate_cli import build_deployment
from phaselab.sim.deployment import Deployment, RoleConfig


def test_no_engine_flag_given_is_the_dataclass_defaults() -> None:
    for command in ("generate", "serve"):
        ns = build_parser().parse_args([command] if command == "serve" else [command, "hi"])
        assert _engine_args(ns) == EngineArgs()


def test_every_engine_field_is_a_flag_with_its_type_and_choices() -> None:
    parser = build_parser()
    for f in dataclasses.fields(EngineArgs):
        if "choices" in f.metadata:
            bad = "no-such-" + f.name
            with pytest.raises(SystemExit):
                parser.parse_args(["generate", "hi", "--" + f.name.replace("_", "-"), bad])
            ok = f.metadata["choices"][-1]
            ns = parser.parse_args(["generate", "hi", "--" + f.name.replace("_", "-"), ok])
            assert getattr(ns, f.name) == ok
    ns = parser.parse_args(["generate", "hi", "--max-num-batched-tokens", "96", "--no-enable-prefix-caching",
                            "--kv-cache-memory", "64MiB"])
    args = _engine_args(ns)
    assert args.max_num_batched_tokens == 96 and args.enable_prefix_caching is False
    assert args.kv_cache_memory == "64MiB"


def _sim_ns(*flags: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["simulate", "run", "--model", "llama-3-8b", "--hardware", "h100", *flags])


def test_simulator_flags_build_the_dataclass_defaults() -> None:
    assert build_deployment(_sim_ns()) == Deployment(get_model("llama-3-8b"), get_hardware("h100"))


def test_simulator_flags_reach_their_fields() -> None:
    d = build_deployment(_sim_ns("--mode", "disagg", "--prefill-workers", "3", "--decode-workers", "2",
                                 "--tp-prefill", "2", "--tp-decode", "4", "--max-num-batched-tokens", "512",
                                 "--max-num-seqs", "64", "--no-enable-prefix-caching", "--routing-policy", "round-robin"))
    assert (d.mode, d.num_prefill, d.num_decode, d.enable_prefix_caching, d.routing_policy) == \
        ("disagg", 3, 2, False, "round-robin")
    assert d.prefill == RoleConfig(tp=2, max_num_batched_tokens=512, max_num_seqs=64)
    assert d.decode == RoleConfig(tp=4, max_num_seqs=64)


def test_budget_default_is_decided_once() -> None:
    assert SchedulerConfig.resolve(max_model_len=4096).max_num_batched_tokens == CHUNKED_BUDGET_DEFAULT
    assert SchedulerConfig.resolve(policy="prefill-first", max_model_len=4096).max_num_batched_tokens == 4096
    assert SchedulerConfig.resolve(max_model_len=4096, max_num_batched_tokens=96).max_num_batched_tokens == 96
    with pytest.raises(ConfigError):
        SchedulerConfig.resolve(policy="prefill-first", max_model_len=4096, max_num_batched_tokens=96)
    # the simulator resolves its roles through it: a prefill-first engine's budget is its max_model_len
    d = Deployment(get_model("llama-3-8b"), get_hardware("h100"), colocated=RoleConfig(policy="prefill-first"))
    sc = d.scheduler_config(d.colocated)
    assert sc.max_num_batched_tokens == sc.max_model_len == d.resolved_max_model_len()
