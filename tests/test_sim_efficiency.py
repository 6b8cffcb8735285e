"""The bounded cost terms (issue 15): every efficiency a fraction of a ceiling, attention that pays for
the prefix a chunk re-reads, tensor parallelism that never beats physics, and a fit that recovers the
parameters a profile table was made from."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
from phaselab.core.sampling_params import SamplingParams
from phaselab.errors import ConfigError
from phaselab.cost.catalog import get_hardware, get_link, get_model
from phaselab.cost.pricing import CostParams, RooflineCostModel, default_params
from phaselab.cost.efficiency import attention_efficiency, gemm_efficiency, kv_read_efficiency
from phaselab.cost.profile_fit import fit_device, gemm_time
from phaselab.cost.profiles import ELEMENTWISE_OPS, GEMM_OPS, read_compute_table

SP = SamplingParams()


def plan_of(entries: list[tuple[int, int, bool]]) -> SchedulerOutput:
    """(start_position, num_tokens, sample) per request."""
    return SchedulerOutput(0, [ScheduledRequest(str(i), [0] * n, s, [], [], smp, n > 1, SP)
                               for i, (s, n, smp) in enumerate(entries)])


@pytest.mark.parametrize("hw", ["a100", "h100", "h200", "cpu"])
def test_every_efficiency_is_in_zero_one(hw):
    p = default_params(get_hardware(hw))
    values = [p.compute_efficiency, p.attention_efficiency, p.decode_attention, p.memory_efficiency,
              p.kv_efficiency, p.allreduce_efficiency]
    values += [p.elementwise_efficiency] if p.elementwise_efficiency else []
    assert all(0 < v <= 1 for v in values), values
    # and every curve built on them, over shapes from 1 to 1M
    for x in [1, 2, 7, 64, 500, 4096, 10**6]:
        assert 0 < gemm_efficiency(x, p.compute_efficiency, p.rows_half) <= 1
        assert 0 < kv_read_efficiency(x, p.kv_efficiency, p.kv_context_half) <= 1
        for k in [1, 100, 10**5]:
            assert 0 < attention_efficiency(x, k, p.attention_efficiency, p.attention_q_half,
                                            p.attention_k_half) <= 1


def test_curves_are_monotone():
    xs = np.arange(1, 5000)
    g = [gemm_efficiency(x, 0.8, 90) for x in xs]
    a = [attention_efficiency(x, x, 0.73) for x in xs]
    assert np.all(np.diff(g) > 0) and np.all(np.diff(a) > 0)


@pytest.mark.parametrize("field", ["compute_efficiency", "memory_efficiency", "attention_efficiency",
                                   "allreduce_efficiency", "kv_memory_efficiency", "elementwise_efficiency"])
def test_an_efficiency_above_one_is_refused(field):
    with pytest.raises(ConfigError, match=r"not in \(0, 1\]"):
        CostParams(**{field: 1.5})


@pytest.mark.parametrize("hw", ["a100", "h100"])
def test_attention_of_a_chunk_grows_with_its_prefix(hw):
    cm = RooflineCostModel(get_model("llama-2-70b"), get_hardware(hw), tp=4, tp_link=get_link("nvlink4"))
    times = [cm.predict(plan_of([(prefix, 512, False)])).attention_s for prefix in (0, 512, 2048, 8192, 32768)]
    assert all(b > a for a, b in zip(times, times[1:])), times


def test_small_chunks_run_attention_at_lower_efficiency():
    """Sarathi-Serve 5.4: the same 4096-token prompt in chunks of 256 costs more attention than in
    chunks of 2048 (each chunk re-reads its prefix, and short query blocks fill their tiles less)."""
    cm = RooflineCostModel(get_model("yi-34b"), get_hardware("a100"), tp=2, tp_link=get_link("nvlink3"))

    def attention(chunk: int) -> float:
        return sum(cm.predict(plan_of([(s, chunk, False)])).attention_s for s in range(0, 4096, chunk))

    assert attention(256) > attention(512) > attention(2048)


@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("hw,link", [("a100", "nvlink3"), ("h100", "nvlink4")])
def test_a_tp2_gemm_is_not_faster_than_half_tp1_plus_its_all_reduce(tokens, hw, link):
    m = get_model("llama-2-70b")
    one = RooflineCostModel(m, get_hardware(hw), tp=1)
    two = RooflineCostModel(m, get_hardware(hw), tp=2, tp_link=get_link(link))
    plan = plan_of([(0, tokens, True)])
    c1, c2 = one.predict(plan), two.predict(plan)
    assert c2.allreduce_s > 0
    assert c2.linear_s + c2.allreduce_s >= c1.linear_s / 2 + c2.allreduce_s * (1 - 1e-9)
    # and the all-reduce is priced from the link: twice per layer, T x hidden x 2 bytes, ring 2 (n-1)/n
    p = two.params
    one_ar = p.allreduce_latency_s + tokens * m.hidden_size * 2 / (get_link(link).bandwidth * p.allreduce_efficiency)
    assert c2.allreduce_s == pytest.approx(2 * m.num_hidden_layers * one_ar, rel=1e-9)


# -- fitting from a table ------------------------------------------------------------------------------------
SHAPES = [  # n_head, n_kv_head, n_embd, n_expanded_embd, gated (Llama-2-7B, a 34B and a 70B shape)
    (32, 32, 4096, 11008, True), (64, 8, 8192, 22016, True), (64, 8, 8192, 28672, True)]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096]


def _write_synthetic_table(path, truth: dict[str, float], peak: float, bw: float) -> None:
    """A Vidur-format mlp.csv whose times come from known GEMM and elementwise parameters."""
    ops = list(GEMM_OPS) + list(ELEMENTWISE_OPS)
    header = [f"time_stats.{op}.median" for op in ops] + [
        "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
        "num_tensor_parallel_workers"]
    rows = []
    for heads, kv, h, i, gated in SHAPES:
        for tp in (1, 2, 4, 8):
            for t in TOKENS:
                rows.append({"n_head": heads, "n_kv_head": kv, "n_embd": h, "n_expanded_embd": i, "vocab_size": 32000,
                             "use_gated_mlp": gated, "num_tokens": t, "num_tensor_parallel_workers": tp,
                             **{c: 1.0 for c in header if c.startswith("time_stats")}})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)
    gemms, elems = read_compute_table(path)  # the loader's FLOPs and bytes; times from the truth
    x = np.array([truth["e_max"], truth["rows_half"], truth["e_mem"], truth["o_gemm"]])
    times: dict[tuple, float] = {}
    for s in gemms:
        times[(s.op, s.tp, s.num_tokens, s.flops)] = float(gemm_time(
            x, np.array([s.flops]), np.array([s.num_bytes]), np.array([float(s.num_tokens)]), peak, bw)[0])
    it_g, it_e = iter(gemms), iter(elems)
    for row in rows:
        for op in GEMM_OPS:
            s = next(it_g)
            row[f"time_stats.{op}.median"] = times[(s.op, s.tp, s.num_tokens, s.flops)] * 1e3
        for op in ELEMENTWISE_OPS:
            s = next(it_e)
            row[f"time_stats.{op}.median"] = (truth["o_elem"] + s.num_bytes / (bw * truth["e_elem"])) * 1e3
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)


def _write_allreduce_table(path, e: float, latency: float, link_bw: float) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["", "time_stats.all_reduce.median", "num_workers", "size", "collective", "devices_per_node"])
        k = 0
        for n in (2, 4, 8):
            for size in [2**p for p in range(11, 27)]:
                t = latency + 2 * (n - 1) / n * size / (link_bw * e)
                w.writerow([k, t * 1e3, n, size, "all_reduce", n])
                k += 1


def test_fitting_recovers_known_parameters_from_a_synthetic_table(tmp_path):
    hw, link = get_hardware("a100"), get_link("nvlink3")
    truth = {"e_max": 0.78, "rows_half": 60.0, "e_mem": 0.83, "o_gemm": 7e-6, "e_elem": 0.55, "o_elem": 4e-6}
    _write_synthetic_table(tmp_path / "mlp.csv", truth, hw.peak_flops, hw.mem_bandwidth)
    _write_allreduce_table(tmp_path / "all_reduce.csv", 0.61, 2.5e-5, link.bandwidth)
    fit = fit_device(hw, link, [tmp_path / "mlp.csv"], [tmp_path / "all_reduce.csv"], [])
    g, e, ar = fit.terms["gemm"].values, fit.terms["elementwise"].values, fit.terms["all_reduce"].values
    for got, want in [(g["compute_efficiency"], 0.78), (g["rows_half"], 60.0), (g["memory_efficiency"], 0.83),
                      (g["gemm_fixed_s"], 7e-6), (e["elementwise_efficiency"], 0.55),
                      (e["fixed_s.input_layernorm"], 4e-6), (ar["efficiency"], 0.61), (ar["latency_s"], 2.5e-5)]:
        assert got == pytest.approx(want, rel=0.02)
    p = fit.params
    assert p.compute_efficiency == pytest.approx(0.78, rel=0.02)
    assert "fitted on" in p.source("compute_efficiency") and "assumed" in p.source("attention_efficiency")
    assert max(abs(fit.terms["gemm"].rel_errors)) < 0.01


@pytest.mark.parametrize("hw", ["a100", "h100"])
def test_shipped_gpu_fits_come_from_the_profiles_and_say_so(hw):
    p = default_params(get_hardware(hw))
    assert "fitted on" in p.source("compute_efficiency") and "mlp.csv" in p.source("compute_efficiency")
    assert "fitted on" in p.source("allreduce_efficiency")
    assert "assumed" in p.source("attention_efficiency")
    assert not math.isnan(p.rows_half) and p.layer_overhead_s > 0


def test_the_shipped_a100_fit_is_what_simulate_fit_makes_from_the_packaged_tables(tmp_path):
    """phaselab/cost/data/fits/a100.json is reproducible: `simulate fit --vidur a100` on the copied
    Vidur tables gives the same parameters."""
    import json

    from phaselab.sim.simulate_cli import main
    from phaselab.cost.profile_fit import load_fit_json

    out = tmp_path / "a100.json"
    assert main(["simulate", "fit", "--vidur", "a100", "--out", str(out)]) == 0
    made, shipped = json.loads(out.read_text()), load_fit_json("a100")
    for name in ("compute_efficiency", "rows_half", "memory_efficiency", "elementwise_efficiency",
                 "layer_overhead_s", "allreduce_efficiency", "allreduce_latency_s"):
        assert made[name] == pytest.approx(shipped[name], rel=1e-3), name
    assert made["link"]["efficiency"] == pytest.approx(shipped["link"]["efficiency"], rel=1e-3)
