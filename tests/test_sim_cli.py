"""`phaselab simulate` subcommands (through add_simulate_parser / run_simulate, in process)."""

from __future__ import annotations

import argparse
import json

import pytest

from phaselab.obs.rundir import read_run_dir
from phaselab.sim.simulate_cli import add_simulate_parser, main, run_simulate
from tests.test_sim_replay import TINY, _as_real_run


def test_parser_plugs_into_a_subparsers_object():
    parser = argparse.ArgumentParser(prog="phaselab")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["simulate", "run", "--model", "opt-66b", "--hardware", "a100", "--tp", "4"])
    assert ns.command == "simulate" and ns.sim_command == "run" and ns.tp == 4
    assert callable(run_simulate)


def test_run_writes_a_simulated_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["simulate", "run", "--model", "llama-3-70b", "--hardware", "h100", "--mode", "disagg",
               "--prefill-workers", "1", "--decode-workers", "1", "--tp-prefill", "4", "--tp-decode", "4",
               "--transfer-link", "25gbe", "--first-token-from", "decode", "--num-prompts", "30",
               "--input-len", "1024", "--output-len", "16", "--request-rate", "2", "--out", str(out),
               "--result-json", str(tmp_path / "summary.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "transfer share of TTFT" in text and "TTFT" in text
    data = read_run_dir(str(out))
    assert data.config["simulated"] and data.config["deployment"]["num_gpus"] == 8
    assert len(data.requests) == 30 and {r.role for r in data.iterations} == {"prefill", "decode"}
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert summary["transfer_share_of_ttft"]["p50"] > 0.5


def test_friendly_errors(capsys):
    assert main(["simulate", "run", "--model", "llama-3-70b", "--hardware", "h100", "--num-prompts", "2"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["simulate", "run", "--model", "nope", "--num-prompts", "2"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_calibrate_and_replay_a_run(tmp_path, capsys):
    from phaselab.cost.catalog import get_hardware
    from phaselab.sim.deployment import Deployment, RoleConfig
    from phaselab.sim.loop import simulate
    from phaselab.sim.workload import random_requests
    from phaselab.workload.arrivals import ArrivalPlan

    d = Deployment(TINY, get_hardware("cpu"),
                   colocated=RoleConfig(max_num_batched_tokens=64, num_blocks=64), max_model_len=512)
    simulate(d, random_requests(30, "uniform:8:200", "uniform:2:20", seed=0, arrivals=ArrivalPlan(request_rate=5))
             ).write(str(tmp_path / "run"))
    _as_real_run(tmp_path / "run", TINY)
    params = tmp_path / "params.json"
    assert main(["simulate", "calibrate", str(tmp_path / "run"), "--out", str(params)]) == 0
    text = capsys.readouterr().out
    assert "fit error per iteration" in text
    fitted = json.loads(params.read_text())
    assert fitted["hardware"] == "cpu" and fitted["fit"]["relative_error_abs_p99"] < 0.02
    assert "fitted on run" in fitted["sources"]["iteration_overhead_s"]
    assert main(["simulate", "replay", str(tmp_path / "run")]) == 0
    assert "identical" in capsys.readouterr().out
    # the fitted parameters drive a new simulation of this CPU
    assert main(["simulate", "run", "--model", "smollm2-135m", "--hardware", "cpu", "--params", str(params),
                 "--num-prompts", "5", "--input-len", "64", "--output-len", "4"]) == 0


def test_search_and_catalog(capsys):
    assert main(["simulate", "search", "--model", "llama-3-8b", "--hardware", "h100", "--max-gpus", "2",
                 "--tps", "1", "--budgets", "2048", "--policies", "chunked", "--max-pool", "1", "--num-prompts", "40",
                 "--bisections", "2", "--objective", "capacity", "--tbt-slo", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "capacity (Sarathi-Serve's definition)" in out and "best:" in out
    assert main(["simulate", "catalog"]) == 0
    out = capsys.readouterr().out
    assert "datasheet" in out and "opt-66b" in out and "320 KiB/token" in out


@pytest.mark.slow
def test_exact_prompts_are_the_benchs_own():
    """With a tokenizer the simulator takes the bench's requests for the same options and seed:
    same ids and lengths, and real shared prefixes that hit the prefix cache."""
    import numpy as np

    from phaselab.workload.prompts import PromptBuilder, build_specs, load_bench_tokenizer
    from phaselab.cost.catalog import get_hardware, get_model
    from phaselab.sim.simulate_cli import build_workload
    from phaselab.sim.deployment import Deployment
    from phaselab.sim.loop import simulate

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["simulate", "run", "--tokenizer", "bundled", "--endpoint", "completions", "--workload",
                            "shared-prefix", "--num-prompts", "12", "--num-prefix-groups", "2", "--prefix-len", "64",
                            "--request-rate", "4", "--seed", "3"])
    reqs, arrivals, info = build_workload(ns)
    builder = PromptBuilder(load_bench_tokenizer(None), "completions")
    specs, _ = build_specs(argparse.Namespace(**{**vars(ns), "num_warmups": 0}), builder,
                              np.random.default_rng(np.random.SeedSequence(3).spawn(2)[0]))
    assert [r.request_id for r in reqs] == [s.request_id for s in specs]
    assert [r.num_prompt_tokens for r in reqs] == [s.num_prompt_tokens for s in specs]
    result = simulate(Deployment(get_model("smollm2-135m"), get_hardware("cpu")), reqs, arrivals)
    assert max(m.num_cached_tokens for m in result.requests) >= 48  # a group's 64-token prefix: 4 blocks
