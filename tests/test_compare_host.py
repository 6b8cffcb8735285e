"""Issue 35 item 5: `phaselab compare` on this machine is priced against this machine's own ceilings, and
runs the weight path `phaselab serve` runs.

One `phaselab compare --quick --no-disagg` in a subprocess, as a user runs it, with a fresh ceilings cache
(PHASELAB_CEILINGS_DIR): it measures this host's ceilings once, caches them under a key of this CPU, and
every floor and efficiency it prints, on the terminal and in each run's diagnosis, is that cached
measurement's, with no warning that they are another CPU's. (--no-disagg: the workers' ceilings are the
same code at one thread, and Ray's start-up is not the subject; tests/test_analysis_report.py runs the
whole compare.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phaselab.analysis import fmt

ROOT = Path(__file__).parents[1]
UNITS = {"kB": 1e3, "MB": 1e6, "GB": 1e9}


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare-host")
    cache, out = root / "ceilings", root / "quick"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT), "PHASELAB_CEILINGS_DIR": str(cache)}
    env.pop("PHASELAB_ROOFLINE", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "phaselab", "compare", "--quick", "--no-disagg", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=env)
    wall = time.monotonic() - t0
    assert r.returncode == 0, f"compare --quick failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    print(f"compare --quick --no-disagg: {wall:.0f} s")
    return out, cache, r.stdout, r.stderr


def _flat(text: str) -> str:
    """The text with its wrapping undone (runs of whitespace as one space) and markdown's code marks dropped."""
    return " ".join(text.split()).replace("`", "")


def _cpuinfo() -> tuple[str, set[str]]:
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines() if ln.startswith("flags")), set())
    return model, flags


def _cached(cache: Path) -> tuple[Path, dict]:
    files = sorted(cache.glob("ceilings-*.json"))
    assert len(files) == 1, files  # one key: this CPU, the engines' threads, the dtype, the bundled model
    return files[0], json.loads(files[0].read_text())


def _run_dirs(out: Path) -> list[Path]:
    runs = sorted(p for p in out.iterdir() if (p / "config.json").is_file())
    assert len(runs) == 8, runs  # 4 configurations x 2 workloads
    return runs


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="names this CPU from /proc/cpuinfo")
def test_the_ceilings_are_this_machines_and_cached_under_its_key(compare_run):
    out, cache, stdout, stderr = compare_run
    path, cached = _cached(cache)
    model, flags = _cpuinfo()
    host = cached["host"]
    assert host["cpu_model"] == model and set(host["isa"]) <= flags and host["cache_key"]["cpu_model"] == model
    assert path.name.startswith("ceilings-") and f"-{host['threads']}t-{host['dtype']}-" in path.name
    assert cached["peak_flops"] > 0 and cached["mem_bandwidth"] == host["read_bytes_per_s"] > 0
    for run in _run_dirs(out):
        cfg = json.loads((run / "config.json").read_text())
        # every run recorded them, measured on the CPU it ran on, with its threads and dtype
        assert cfg["machine"]["cpu_model"] == model
        assert cfg["machine"]["torch_num_threads"] == host["threads"] and cfg["dtype"] == host["dtype"]
        rec = cfg["ceilings"]
        assert (rec["peak_flops"], rec["mem_bandwidth"]) == (cached["peak_flops"], cached["mem_bandwidth"])
        assert rec["host"]["cache_file"] == str(path)
        diag = json.loads((run / "diagnosis.json").read_text())["ceilings"]
        assert diag["kind"] == "measured" and "this machine's" in diag["source"], diag
        # the cached measurement, or above it where the run itself beat it (said so: measured under load)
        assert diag["bandwidth_bytes_per_s"] == cached["mem_bandwidth"] or "bandwidth raised" in diag["source"]
        assert diag["gemm_flops_per_s"] == cached["peak_flops"] or "GEMM rate raised" in diag["source"]
    # measured once, in the compare's own process, before the engines
    assert stderr.count("measuring this host's ceilings") == 1 and str(path) in stderr


@pytest.mark.slow
def test_no_warning_and_every_printed_ceiling_is_the_cached_one(compare_run):
    out, cache, stdout, stderr = compare_run
    path, cached = _cached(cache)
    assert not re.search(r"warning", stdout + stderr, re.I), [
        ln for ln in (stdout + stderr).splitlines() if re.search("warning", ln, re.I)]
    # the header names where the ceilings come from (the text is wrapped: compared with spaces collapsed)
    flat = _flat(stdout)
    assert f"ceilings (every floor and efficiency below): {fmt.rate(cached['mem_bandwidth'])} read" in flat or \
        "raised" in flat
    assert "measured (this machine's" in flat and str(path) in flat
    allowed: set[tuple[float, float]] = set()
    checked = 0
    for run in _run_dirs(out):
        c = json.loads((run / "diagnosis.json").read_text())["ceilings"]
        bw, peak = c["bandwidth_bytes_per_s"], c["gemm_flops_per_s"]
        # the cached measurement, or (said so) a rate the run itself beat it by: measured under load
        assert bw == cached["mem_bandwidth"] or (bw > cached["mem_bandwidth"] and "bandwidth raised" in c["source"])
        assert peak == cached["peak_flops"] or (peak > cached["peak_flops"] and "GEMM rate raised" in c["source"])
        allowed.add((bw, peak))
        checked += _check_figures(run.name, _flat((run / "diagnosis.md").read_text()), {(bw, peak)})
    checked += _check_figures("stdout", flat, allowed)
    assert checked >= 8, checked  # the diagnoses do print figures against the ceilings


def _check_figures(name: str, text: str, ceilings: set[tuple[float, float]]) -> int:
    """Every figure `text` prints against the machine's ceilings is one of `ceilings`' (bandwidth, GEMM
    rate), labeled measured; returns how many were checked."""
    rates = {fmt.rate(bw) for bw, _ in ceilings}
    gemms = {fmt.rate(peak, "FLOP/s") for _, peak in ceilings}
    for bad in ("another CPU", "assumed", "foreign"):
        assert bad not in text, (name, bad)
    checked = 0
    for m in re.finditer(r"of the machine's ([\d.]+ [kMGT]?B/s) \(([^)]*)\)", text):
        assert m.group(1) in rates and m.group(2) == "measured", (name, m.group(0))
        checked += 1
    for m in re.finditer(r"the machine's GEMM rate \((\w+) ([\d.]+ [kMGT]?FLOP/s)\)", text):
        assert m.group(1) == "measured" and m.group(2) in gemms, (name, m.group(0))
        checked += 1
    for m in re.finditer(r"[Mm]achine (?:memory )?bandwidth ([\d.]+ [kMGT]?B/s)", text):
        assert m.group(1) in rates, (name, m.group(0))
        checked += 1
    for m in re.finditer(r"weights ([\d.]+) (kB|MB|GB) per step \(floor at the machine's (\w+) bandwidth "
                         r"([^)]+)\)", text):
        w, half = float(m.group(1)) * UNITS[m.group(2)], 0.005 * UNITS[m.group(2)]
        assert m.group(3) == "measured"
        floors = {fmt.s(x / bw) for bw, _ in ceilings for x in (w - half, w, w + half)}
        assert m.group(4) in floors, (name, m.group(0))
        checked += 1
    return checked


@pytest.mark.slow
def test_compare_runs_the_weight_path_serve_runs(compare_run):
    from phaselab.engine.engine import resolve_dtype
    from phaselab.model.kernels import linear_probe

    out, _, stdout, _ = compare_run
    dtype, _ = resolve_dtype("auto", True, "auto")  # serve's defaults: --dtype auto --weights auto
    path = linear_probe.decide("auto", dtype, True).path
    for run in _run_dirs(out):
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["dtype"] == str(dtype).removeprefix("torch.") and cfg["linear"]["path"] == path, run
        if path == "q":  # the bundled model's Q4_1 blocks as stored, not a dense copy
            assert any(f.startswith("Q4_1") for f in cfg["linear"]["formats"]), cfg["linear"]["formats"]
            assert cfg["linear"]["weight_bytes"] < 150e6
    flat = _flat(stdout)
    assert f"weights: path {path}: " in flat and "as phaselab serve --weights auto chooses it" in flat


def test_a_warning_is_shown_once_however_often_it_is_raised():
    """compare's runs each calibrate (twice, with a catch_warnings between): a warning about the ceilings
    would repeat per run and per prediction; within warnings_once it is shown once."""
    import warnings

    from phaselab.experiments.compare import warnings_once

    def note(text: str) -> None:
        warnings.warn(text, UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")  # no registry: what is left out, warnings_once left out
        with warnings_once():
            for _ in range(3):
                note("the ceilings are another CPU's")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    note("the ceilings are another CPU's")
                warnings.warn("the ceilings are another CPU's", UserWarning, stacklevel=1)  # another line
                note("a second note")
        note("a second note")  # after the block: shown again
    assert [str(w.message) for w in shown] == ["the ceilings are another CPU's", "a second note", "a second note"]


def test_a_ceiling_below_what_the_run_achieved_is_raised_and_says_so():
    """A ceiling measured on a busy machine is below the true one: a floor from it would be above the run's
    own steps. The diagnosis raises it to what the run achieved, and its source says so."""
    from types import SimpleNamespace

    from phaselab.analysis.machine import Ceilings, at_least_achieved

    def it(prefill: int, decode: int, s: float, weights: float, kv: float = 0.0, flops: float = 0.0):
        modeled = SimpleNamespace(weight_bytes=weights, kv_read_bytes=kv, kv_repeat_read_bytes=0.0, matmul_flops=flops)
        return SimpleNamespace(num_prefill_tokens=prefill, num_decode_tokens=decode, duration_s=s, modeled=modeled)

    measured = Ceilings(10e9, 100e9, "this machine's", "measured", host=True)
    slow = [it(0, 4, 0.02, 96e6, 4e6), it(512, 0, 0.5, 96e6, flops=20e9)]  # 5 GB/s, 40 GFLOP/s: below
    assert at_least_achieved(measured, slow) is measured
    fast = [it(0, 4, 0.005, 96e6, 4e6), it(512, 0, 0.1, 96e6, flops=20e9)]  # 20 GB/s, 200 GFLOP/s: above
    c = at_least_achieved(measured, fast)
    assert (c.bandwidth_bytes_per_s, c.gemm_flops_per_s) == (pytest.approx(20e9), pytest.approx(200e9))
    assert "bandwidth raised" in c.source and "GEMM rate raised" in c.source and c.kind == "measured"
    foreign = Ceilings(10e9, 100e9, "another CPU's", "foreign")
    assert at_least_achieved(foreign, fast) is foreign  # another CPU's bound nothing anyway
    given = Ceilings(10e9, 100e9, "roofline.json", "measured")
    assert at_least_achieved(given, fast) is given  # a roofline file is taken as it is
