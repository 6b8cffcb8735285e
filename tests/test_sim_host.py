"""Issue 15, item 4: a CPU calibration is bounded by the ceilings of the host that made the run (recorded
in the run directory), not by the catalog's `cpu` entry (another host's), and says when they differ.

The ground truth is a controlled experiment: a run made by the simulator with known efficiencies on a
host twice as fast as the catalog entry (as the AMD EPYC of these sessions is faster than the Xeon
behind the entry), relabelled as an engine's run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from phaselab.errors import ConfigError
from phaselab.obs.rundir import read_run_dir
from phaselab.sim.calibrate import calibrate
from phaselab.cost.catalog import get_hardware, get_model
from phaselab.sim.simulate_cli import main
from phaselab.cost.pricing import CostParams
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.fidelity import by_kind, simulate_like
from phaselab.cost.host import hardware_to_dict, host_mismatch, run_hardware
from phaselab.sim.loop import simulate
from phaselab.sim.replay import replay_inputs
from phaselab.sim.workload import random_requests
from phaselab.workload.arrivals import ArrivalPlan

CPU = {"cpu_model": "Test CPU 9000", "isa": ["avx2", "fma", "avx512f", "avx512_bf16"]}
FAST = dataclasses.replace(
    get_hardware("cpu"), name="measured-cpu", peak_flops=2 * 180e9, mem_bandwidth=2 * 27.7e9,
    sources={"peak_flops": "test: twice the catalog's cpu"},
    host={**CPU, "threads": 2, "dtype": "bfloat16", "measured_at": "2026-12-01T00:00:00", "hostname": "test"})
# the fitted model's own shape (flat curves, no elementwise term), GEMMs at 80% of FAST's peak: 1.6x the catalog's
TRUTH = CostParams(compute_efficiency=0.8, rows_half=0.0, attention_efficiency=0.6, decode_attention_efficiency=0.1,
                   memory_efficiency=0.9, kv_memory_efficiency=0.5, iteration_overhead_s=4e-3, layer_overhead_s=0.0,
                   request_overhead_s=2e-4, chunk_overhead_s=1e-3, token_overhead_s=0.0,
                   attention_q_half=0.0, attention_k_half=0.0, kv_context_half=0.0)
REQUESTS = dict(num=40, input_len="uniform:32:384", output_len="uniform:8:48")


def _engine_like_run(path, record_ceilings: bool = True, machine: dict | None = None) -> list:
    """A run on FAST with TRUTH's costs, its config.json made an engine's: the CPU named, the threads and
    dtype, and (record_ceilings) the host's ceilings as the engine records them."""
    model = get_model("smollm2-135m")
    d = Deployment(model, FAST, colocated=RoleConfig(max_num_batched_tokens=256, max_num_seqs=16, num_blocks=512),
                   max_model_len=1024, enable_prefix_caching=False, params=TRUTH)
    reqs = random_requests(REQUESTS["num"], REQUESTS["input_len"], REQUESTS["output_len"], seed=1,
                           arrivals=ArrivalPlan(request_rate=4.0))
    simulate(d, reqs).write(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("simulated")
    cfg["model"] = {"config": dataclasses.asdict(model)}
    cfg["dtype"] = "bfloat16"
    cfg["machine"] = machine if machine is not None else {**CPU, "torch_num_threads": 2}
    if record_ceilings:
        cfg["ceilings"] = hardware_to_dict(FAST)
    (path / "config.json").write_text(json.dumps(cfg))
    return reqs


def test_calibration_is_bounded_by_the_ceilings_recorded_in_the_run(tmp_path):
    reqs = _engine_like_run(tmp_path)
    fit, hw = calibrate(tmp_path)
    assert hw.name == "measured-cpu" and hw.peak_flops == FAST.peak_flops and hw.host["cpu_model"] == CPU["cpu_model"]
    assert fit.notes == []
    p = fit.params
    # relative to the host's own ceilings nothing needs capping: the known efficiencies come back
    assert p.compute_efficiency == pytest.approx(TRUTH.compute_efficiency, rel=0.03)
    assert "capped" not in p.source("compute_efficiency")
    assert abs(fit.summary()["total_time_error"]) < 0.01
    # the run's hardware is what replay, the fidelity helpers and the simulator price against by default
    assert replay_inputs(read_run_dir(tmp_path))[0].hardware.peak_flops == FAST.peak_flops
    assert by_kind(str(tmp_path), p)["all"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert simulate_like(str(tmp_path), reqs, p) == simulate_like(str(tmp_path), reqs, p, hardware=hw)


def test_against_another_hosts_ceilings_the_fit_is_capped_and_warns(tmp_path):
    _engine_like_run(tmp_path)
    with pytest.warns(UserWarning, match="Test CPU 9000") as caught:
        fit, hw = calibrate(tmp_path, "cpu")
    assert hw.name == "cpu" and any("Intel Xeon" in str(w.message) for w in caught)
    # the run's GEMMs went at 1.6x the catalog entry's peak: capped at 1, the excess goes elsewhere
    assert fit.params.compute_efficiency == 1.0 and "capped at 1" in fit.params.source("compute_efficiency")
    assert fit.notes and "python -m phaselab.engine.ceilings" in fit.notes[0]


def test_a_run_without_recorded_ceilings_falls_back_to_the_catalog_and_says_so(tmp_path):
    _engine_like_run(tmp_path, record_ceilings=False)
    assert run_hardware(read_run_dir(tmp_path).config).name == "cpu"
    with pytest.warns(UserWarning, match="measured on Intel Xeon"):
        _, hw = calibrate(tmp_path)
    assert hw.name == "cpu"


def test_mismatches_are_named():
    run = {"dtype": "bfloat16", "machine": {**CPU, "torch_num_threads": 2}}
    assert host_mismatch(run, FAST) == []
    assert "does not name its CPU" in host_mismatch({"machine": {}}, FAST)[0]
    other_isa = {**run, "machine": {**run["machine"], "isa": ["avx2", "fma", "amx_bf16"]}}
    assert "amx_bf16" in host_mismatch(other_isa, FAST)[0]
    (threads,) = host_mismatch({**run, "machine": {**run["machine"], "torch_num_threads": 4}}, FAST)
    assert "4 torch threads" in threads
    (dtype,) = host_mismatch({**run, "dtype": "float32"}, FAST)
    assert "float32" in dtype
    assert "names no measured CPU" in host_mismatch(run, get_hardware("h100"))[0]


def test_cli_writes_the_hardware_it_calibrated_against_and_simulates_with_it(tmp_path, capsys):
    _engine_like_run(tmp_path / "run")
    out = tmp_path / "cpu.json"
    assert main(["simulate", "calibrate", str(tmp_path / "run"), "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "measured on Test CPU 9000" in text.out and "warning" not in text.err
    hw_file = tmp_path / "cpu.hardware.json"
    assert get_hardware(str(hw_file)).peak_flops == FAST.peak_flops
    assert f"--hardware {hw_file}" in text.out
    assert main(["simulate", "run", "--model", "smollm2-135m", "--hardware", str(hw_file), "--params", str(out),
                 "--num-prompts", "5", "--input-len", "64", "--output-len", "4"]) == 0
    # --hardware and --measure-host are exclusive
    assert main(["simulate", "calibrate", str(tmp_path / "run"), "--hardware", "cpu",
                 "--measure-host", str(tmp_path / "h.json")]) == 2


def test_a_hardware_file_carries_its_host(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(json.dumps(hardware_to_dict(FAST)))
    hw = get_hardware(str(f))
    assert hw.host == FAST.host and hw.peak_flops == FAST.peak_flops and hw.sources["peak_flops"].startswith("test")
    f.write_text(json.dumps({**hardware_to_dict(FAST), "host": "AMD"}))
    with pytest.raises(ConfigError, match="host must be an object"):
        get_hardware(str(f))
