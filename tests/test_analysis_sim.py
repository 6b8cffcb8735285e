"""Analysis of simulated runs: `phaselab compare --simulate` and diagnose against the simulated hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phaselab.analysis.diagnose import diagnose
from phaselab.obs.rundir import read_run_dir
from phaselab.obs.perfetto import validate_trace


def _check_run_dir(path: Path) -> None:
    data = read_run_dir(path)
    assert data.config["simulated"] is True
    assert data.requests and data.iterations
    assert all(m.finish_reason in ("stop", "length") for m in data.requests)
    assert validate_trace(json.loads((path / "trace.json").read_text())) == []
    assert json.loads((path / "diagnosis.json").read_text())["ranking"]


def test_compare_simulate_puts_the_deployments_side_by_side(tmp_path, capsys):
    from phaselab.cli import main

    out = tmp_path / "cmp"
    rc = main(["compare", "--simulate", "--hardware", "h100", "--model", "llama-3-70b", "--gpus", "8", "--tp", "4",
               "--prefill-decode", "1:1", "--link", "ib-ndr", "--budgets", "1024", "--num-prompts", "12",
               "--request-rate", "6", "--input-len", "uniform:256:1024", "--output-len", "uniform:8:32",
               "--seed", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "llama-3-70b on 8 x h100" in text
    for label in ("prefill-first (unchunked), 2 x TP4", "chunked, budget 1024, 2 x TP4",
                  "disaggregated 1P:1D (TP4), KV over ib-ndr"):
        assert label in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["simulation"]["hardware"] == "h100"
    names = [c["name"] for c in summary["configs"]]
    assert names == ["prefill-first", "chunked-1024", "adaptive-50ms", "disagg-1p1d"]
    adaptive = read_run_dir(out / "interference-adaptive-50ms")  # the adaptive column: budget over time, target
    assert adaptive.config["scheduler"]["slo_tbt_ms"] == 50.0
    assert all(r.prefill_budget is not None and r.slo_tbt_s == 0.05 for r in adaptive.iterations)
    assert "chunked, adaptive budget, TBT target 50 ms, 2 x TP4" in text
    for c in summary["configs"]:
        assert set(c["workloads"]) == {"load", "interference", "sweep"}
        for w in c["workloads"].values():
            _check_run_dir(Path(w["run_dir"]))
    load = read_run_dir(out / "load-disagg-1p1d")
    assert len(load.requests) == 12 and {r.role for r in load.iterations} == {"prefill", "decode"}
    assert load.config["deployment"]["num_gpus"] == 8 and load.config["transfer"]["link"]["name"] == "ib-ndr"
    # the same requests in every deployment
    colocated = read_run_dir(out / "load-chunked-1024")
    assert sorted((m.request_id, m.num_prompt_tokens, m.num_output_tokens) for m in colocated.requests) == \
        sorted((m.request_id, m.num_prompt_tokens, m.num_output_tokens) for m in load.requests)
    assert (out / "report.html").is_file() and (out / "timeline.png").is_file()
    # --from re-renders it without simulating again
    assert main(["compare", "--from", str(out), "--no-progress"]) == 0
    assert "disaggregated 1P:1D" in capsys.readouterr().out


def test_compare_simulate_options_and_errors(capsys):
    from phaselab.experiments.compare_sim import auto_tp, parse_split, sim_spec
    from phaselab.cli import main
    from phaselab.cost.catalog import get_hardware, get_model

    h100 = get_hardware("h100")
    assert auto_tp(get_model("llama-3-70b"), h100, 8, 2) == 4  # 141 GB of weights: 35 GB per GPU of 72 usable
    assert auto_tp(get_model("llama-3-8b"), h100, 8, 2) == 1
    assert parse_split(None, 4) == (2, 2) and parse_split("1:3", 8) == (2, 6) and parse_split("3:1", 4) == (3, 1)
    spec = sim_spec("llama-3-70b", "h100", num_gpus=16)
    assert (spec.tp, spec.num_prefill, spec.num_decode, spec.link) == (4, 2, 2, "nvlink4")

    assert main(["compare", "--hardware", "h100"]) == 2
    assert "add --simulate" in capsys.readouterr().err
    assert main(["compare", "--simulate", "--gpus", "8", "--tp", "4", "--prefill-decode", "2:1"]) == 2
    assert "change --gpus, --tp or the split" in capsys.readouterr().err
    assert main(["compare", "--simulate", "--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["compare", "--simulate", "--input-len", "banana"]) == 2
    assert "--input-len" in capsys.readouterr().err


@pytest.fixture()
def fake_roofline(tmp_path, monkeypatch):
    """A roofline file of this 'machine' far from any GPU: 1 GB/s, 1 GFLOP/s."""
    path = tmp_path / "roofline.json"
    path.write_text(json.dumps({"bandwidth": {"read_bytes_per_s": 1e9},
                                "bfloat16": {"gemm_flops_per_s": {"layer_mix": {"512": 1e9}}}}))
    monkeypatch.setenv("PHASELAB_ROOFLINE", str(path))
    return path


def test_diagnose_judges_a_simulated_run_against_the_simulated_hardware(tmp_path, fake_roofline):
    from phaselab.cost.catalog import get_hardware, get_model
    from phaselab.sim.deployment import Deployment, RoleConfig
    from phaselab.sim.loop import simulate
    from phaselab.sim.workload import random_requests
    from phaselab.workload.arrivals import ArrivalPlan

    h100 = get_hardware("h100")
    d = Deployment(get_model("llama-3-8b"), h100, "disagg", prefill=RoleConfig(tp=2), decode=RoleConfig(tp=1),
                   transfer_link="25gbe")
    run = tmp_path / "sim"
    simulate(d, random_requests(24, "uniform:512:2048", "uniform:16:64", seed=1, arrivals=ArrivalPlan(request_rate=8))
             ).write(str(run))

    diag = diagnose(run, roofline=str(fake_roofline))
    c = diag.ceilings
    assert c.kind == "simulated"
    assert c.gemm_flops_per_s == pytest.approx(2 * h100.peak_flops)  # a prefill engine: TP2
    assert c.bandwidth_bytes_per_s == pytest.approx(h100.mem_bandwidth)  # a decode engine: TP1
    assert c.link_name == "25gbe" and c.link_bandwidth_bytes_per_s == pytest.approx(3.125e9)
    by_cause = {f.cause: f for f in diag.findings}
    text = json.dumps(diag.to_json(), default=str)
    assert "simulated h100 x TP2 (prefill) / TP1 (decode)" in text
    assert "1.00 GB/s" not in text and "1.00 GFLOP/s" not in text  # nothing from this machine's roofline
    prefill_ev = " ".join(by_cause["prefill"].evidence)
    assert "of the simulated h100" in prefill_ev and "GEMM rate" in prefill_ev
    assert "link 25gbe: 3.12 GB/s" in " ".join(by_cause["transfer"].evidence)
    assert any("--roofline" in n and "not used" in n for n in diag.notes)

    # the same records without the mark are judged against this machine's roofline
    cfg = json.loads((run / "config.json").read_text())
    cfg["simulated"] = False
    (run / "config.json").write_text(json.dumps(cfg))
    real = diagnose(run).ceilings
    assert real.kind == "measured" and real.bandwidth_bytes_per_s == 1e9 and real.gemm_flops_per_s == 1e9
