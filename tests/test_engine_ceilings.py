"""This host's ceilings (phaselab/engine/ceilings.py): a hardware file that names the CPU it was measured
on, recorded by the engine in its run directory, where calibration finds it and finds it is the run's CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phaselab.engine.ceilings import layer_shapes, main, measure_ceilings
from phaselab.cost.catalog_files import hardware_from_dict
from phaselab.modelinfo.model_config import ModelConfig

TINY = ModelConfig("llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, name="tiny")
QUICK = dict(rows=(8, 64), trials=2, trial_s=0.002, bandwidth_bytes=8 * 2**20)


def _proc_cpuinfo() -> tuple[str, set[str]]:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines() if ln.startswith("flags")), set())
    return model, flags


def test_the_ceilings_are_a_hardware_file_that_names_the_host():
    d = measure_ceilings(TINY, torch.float32, **QUICK)
    hw = hardware_from_dict(d, "test")  # the documented schema, every required field
    rates = d["host"]["gemm_flops_per_s"]
    assert set(rates) == set(layer_shapes(TINY)) and all(set(r) == {"8", "64"} for r in rates.values())
    assert hw.peak_flops == max(v for r in rates.values() for v in r.values()) > 0
    assert hw.mem_bandwidth == d["host"]["read_bytes_per_s"] > 0
    host = d["host"]
    assert host["dtype"] == "float32" and host["threads"] == torch.get_num_threads() and host["model"] == "tiny"
    assert len(host["load_average_before"]) == 3 and host["measured_at"]
    if Path("/proc/cpuinfo").exists():
        model, flags = _proc_cpuinfo()
        assert host["cpu_model"] == model and set(host["isa"]) <= flags
        assert ("avx512_bf16" in host["isa"]) == ("avx512_bf16" in flags)
    for field in ("peak_flops", "mem_bandwidth"):
        assert host["cpu_model"] in hw.sources[field] and "load average" in hw.sources[field]


def test_cli_writes_a_file_calibrate_accepts(tmp_path, tiny_model):
    out = tmp_path / "host.json"
    assert main(["--model", tiny_model, "--dtype", "float32", "--out", str(out)]) == 0
    from phaselab.cost.catalog import get_hardware

    hw = get_hardware(str(out))
    assert hw.host["dtype"] == "float32" and hw.peak_flops > 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    cfg = tiny_hf_config()
    return write_hf_dir(str(tmp_path_factory.mktemp("tiny")), cfg, random_weights(cfg))


def test_the_engine_records_its_hosts_ceilings_and_calibration_uses_them(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PHASELAB_CEILINGS_DIR", str(tmp_path / "cache"))
    from phaselab.engine_args import EngineArgs
    from phaselab.core.sampling_params import SamplingParams
    from phaselab.serving_engine import make_engine
    from phaselab.sim.calibrate import calibrate

    engine = make_engine(EngineArgs(model=tiny_model, dtype="float32", kv_cache_memory="2MiB",
                                    max_num_batched_tokens=16, enable_prefix_caching=False, measure_ceilings=True))
    for k, n in enumerate((21, 7, 33)):
        engine.add_request([5 + (k + j) % 50 for j in range(n)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id=f"r{k}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.write_record(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["ceilings"]["host"]["cpu_model"] == cfg["machine"]["cpu_model"]
    assert cfg["ceilings"]["host"]["dtype"] == cfg["dtype"] == "float32"
    fit, hw = calibrate(tmp_path)
    assert hw.name == "measured-cpu" and hw.peak_flops == cfg["ceilings"]["peak_flops"]
    assert fit.notes == []  # the same CPU, threads and dtype
    for name in ("compute_efficiency", "memory_efficiency", "attention_efficiency", "kv_memory_efficiency"):
        assert 0 < getattr(fit.params, name) <= 1
    # calibrate --measure-host: this host measured now (a subprocess), with the run's model, dtype and threads
    from phaselab.sim.simulate_cli import main as sim_main

    host = tmp_path / "host.json"
    assert sim_main(["simulate", "calibrate", str(tmp_path), "--measure-host", str(host)]) == 0
    measured = json.loads(host.read_text())
    assert measured["host"]["dtype"] == "float32" and measured["host"]["model"] == cfg["model"]["config"]["name"]
    assert measured["host"]["threads"] == cfg["machine"]["torch_num_threads"]


def test_host_ceilings_are_measured_once_per_key_and_never_another_cpus(tmp_path, monkeypatch):
    """The cache (phaselab/cost/host.py): one file per CPU, threads, dtype and model shapes; a second call
    reads it; a file at the key's path that names another CPU is measured over; a run of this CPU without
    recorded ceilings is priced (calibrate) and floored (diagnose) against the cached ones, a run of
    another CPU never is."""
    import dataclasses

    import phaselab.engine.ceilings as ce
    from phaselab.analysis.machine import load_ceilings
    from phaselab.cost.host import run_hardware

    monkeypatch.setenv("PHASELAB_CEILINGS_DIR", str(tmp_path))
    calls = []
    real = ce.measure_ceilings
    monkeypatch.setattr(ce, "measure_ceilings", lambda *a, **k: calls.append(1) or real(*a, **{**k, **QUICK}))
    first = ce.host_ceilings(TINY, torch.float32)
    second = ce.host_ceilings(TINY, torch.float32)
    assert len(calls) == 1 and second["peak_flops"] == first["peak_flops"]
    (f,) = tmp_path.glob("ceilings-*.json")
    assert second["host"]["cache_file"] == str(f) and f"-{torch.get_num_threads()}t-float32-" in f.name
    forged = json.loads(f.read_text())
    forged["host"]["cpu_model"], forged["peak_flops"] = "Other CPU 1", 1.0
    f.write_text(json.dumps(forged))
    third = ce.host_ceilings(TINY, torch.float32)
    assert len(calls) == 2 and third["peak_flops"] != 1.0
    ce.host_ceilings(TINY, torch.bfloat16)  # another key, its own file
    assert len(calls) == 3 and len(list(tmp_path.glob("ceilings-*.json"))) == 2
    # measured under load: an engine takes it as it is; compare (improve) measures again and keeps the best
    loaded = json.loads(f.read_text())
    loaded["host"]["load_average_before"] = [100.0, 100.0, 100.0]
    loaded["mem_bandwidth"] = 1e15  # "better" than any measurement: kept
    f.write_text(json.dumps(loaded))
    assert ce.host_ceilings(TINY, torch.float32)["mem_bandwidth"] == 1e15 and len(calls) == 3
    best = ce.host_ceilings(TINY, torch.float32, improve=True)
    assert len(calls) == 4 and best["mem_bandwidth"] == 1e15 and best["peak_flops"] >= third["peak_flops"]
    assert len(best["host"]["measurements"]) == 2
    assert json.loads(f.read_text())["mem_bandwidth"] == 1e15
    forged = json.loads(f.read_text())  # three measurements made, all under load: the best of them stands
    forged["host"]["load_average_before"] = [100.0] * 3
    forged["host"]["measurements"] = [{}] * 3
    f.write_text(json.dumps(forged))
    ce.host_ceilings(TINY, torch.float32, improve=True)
    assert len(calls) == 4
    third = best

    ident = ce.cpu_identity()
    run = {"dtype": "float32", "model": {"config": dataclasses.asdict(TINY)},
           "machine": {**ident, "torch_num_threads": torch.get_num_threads()}}
    assert run_hardware(run).peak_flops == third["peak_flops"]
    c = load_ceilings(config=run)
    assert c.kind == "measured" and c.bandwidth_bytes_per_s == third["mem_bandwidth"] and str(f) in c.source
    other = {**run, "machine": {**run["machine"], "cpu_model": "Other CPU 1"}}
    assert run_hardware(other).name == "cpu"
    assert load_ceilings(config=other).kind in ("foreign", "assumed")
    threads = {**run, "machine": {**run["machine"], "torch_num_threads": torch.get_num_threads() + 1}}
    assert run_hardware(threads).name == "cpu"
