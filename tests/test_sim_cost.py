"""The simulator's cost model: a roofline that puts decode and prefill on the right side of it, tensor parallelism, and a calibration that recovers a
known truth."""

from __future__ import annotations

import random

import numpy as np
import pytest

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.timing import IterationRecord, ScheduledChunk
from phaselab.cost.formulas import plan_counts
from phaselab.cost.record_fit import fit_params, nnls
from phaselab.cost.catalog import get_hardware, get_link, get_model
from phaselab.cost.pricing import CostParams, RooflineCostModel
from phaselab.modelinfo.model_config import ModelConfig

SP = SamplingParams()


def plan_of(entries: list[tuple[int, int, bool]]) -> SchedulerOutput:
    """(start_position, num_tokens, sample) per request."""
    return SchedulerOutput(0, [ScheduledRequest(str(i), [0] * n, s, [], [], smp, n > 1, SP)
                               for i, (s, n, smp) in enumerate(entries)])


def test_decode_is_memory_bound_and_prefill_compute_bound_on_h100():
    cm = RooflineCostModel(get_model("llama-3-8b"), get_hardware("h100"))
    decode = cm.predict(plan_of([(1000, 1, True)] * 8))
    prefill = cm.predict(plan_of([(0, 2048, True)]))
    assert decode.linear_bound == "memory" and decode.attention_bound == "memory"
    assert prefill.linear_bound == "compute"
    # decode step ~ weights / (bandwidth x efficiency): 16 GB / 2.68 TB/s ~ 6 ms, plus overheads
    assert 5e-3 < decode.duration_ns / 1e9 < 10e-3
    # a 2048-token prefill ~ 2 x 8e9 x 2048 FLOPs / (989 TFLOP/s x ~0.7) ~ 48 ms
    assert 35e-3 < prefill.duration_ns / 1e9 < 70e-3


def test_chunking_a_prompt_costs_more_than_one_pass():
    cm = RooflineCostModel(get_model("yi-34b"), get_hardware("a100"), tp=2, tp_link=get_link("nvlink3"))
    whole = cm.predict(plan_of([(0, 2048, True)])).duration_ns
    chunks = sum(cm.predict(plan_of([(k * 512, 512, k == 3)])).duration_ns for k in range(4))
    assert chunks > whole  # per-iteration overheads, weights re-read, lower GEMM efficiency (Sarathi's ~+25%)
    assert chunks / whole < 1.6


def test_tensor_parallelism_splits_work_and_adds_all_reduces():
    m, hw = get_model("llama-3-70b"), get_hardware("h100")
    one = RooflineCostModel(m, hw, tp=1)
    four = RooflineCostModel(m, hw, tp=4, tp_link=get_link("nvlink4"))
    plan = plan_of([(0, 1024, True)])
    c1, c4 = one.predict(plan), four.predict(plan)
    assert c4.linear_s == pytest.approx(c1.linear_s / 4)
    assert c4.allreduce_s > 0 and c1.allreduce_s == 0
    # all-reduce over 4 GPUs: 2 per layer of 1024 x 8192 x 2 bytes, ring 2 x 3/4 of it over 450 GB/s at the
    # fitted bus efficiency, plus the fitted latency
    per_layer_bytes = 1024 * 8192 * 2 * 2 * 3 / 4
    p = four.params
    expected = 2 * 80 * (per_layer_bytes / (450e9 * p.allreduce_efficiency) + p.allreduce_latency_s)
    assert c4.allreduce_s == pytest.approx(expected, rel=1e-6)
    assert c4.modeled == c1.modeled  # modeled counts are the whole instance's


def test_nnls_matches_brute_force():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 4))
    b = a @ np.array([1.0, -2.0, 0.5, 0.0]) + rng.normal(scale=0.1, size=40)
    x = nnls(a, b)
    assert (x >= 0).all()
    def residual(cols: tuple[int, ...]) -> float:
        sub = a[:, list(cols)]
        return float(np.linalg.norm(sub @ np.clip(np.linalg.lstsq(sub, b, rcond=None)[0], 0, None) - b))

    best = min(residual(s) for s in [(0,), (2,), (0, 2), (0, 2, 3), (0, 3), (2, 3)])
    assert np.linalg.norm(a @ x - b) <= best + 1e-9


def test_calibration_recovers_a_known_cost_model():
    """Iterations whose 'measured' times come from known parameters: the fit reproduces every
    time (the parameters themselves are identifiable only up to the fixed per-iteration terms)."""
    config = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    spec, hw = config, get_hardware("cpu")
    truth = CostParams(compute_efficiency=0.8, rows_half=12.0, attention_efficiency=0.25, memory_efficiency=0.6,
                       iteration_overhead_s=4e-3, layer_overhead_s=0.0, request_overhead_s=3e-4, token_overhead_s=2e-5,
                       **FLAT)
    cm = RooflineCostModel(spec, hw, truth)
    rng = random.Random(1)
    records, measured = [], []
    for k in range(300):
        entries = [(rng.randrange(16, 600), 1, True) for _ in range(rng.randrange(0, 24))]
        if rng.random() < 0.4:
            entries.append((rng.randrange(0, 256), rng.randrange(16, 512), True))
        if not entries:
            continue
        plan = plan_of(entries)
        cost = cm.predict(plan)
        records.append(IterationRecord(k, "w", "colocated", 0, cost.duration_ns,
                                       num_prefill_tokens=sum(n for _, n, _ in entries if n > 1),
                                       num_decode_tokens=sum(1 for _, n, _ in entries if n == 1),
                                       chunks=[ScheduledChunk(str(i), n, n > 1, s + n)
                                               for i, (s, n, _) in enumerate(entries)],
                                       modeled=cost.modeled))
        measured.append(cost.duration_ns)
    fit = fit_params(records, measured, spec, hw, 2, "synthetic")
    s = fit.summary()
    assert s["relative_error_abs_p99"] < 0.01 and abs(s["total_time_error"]) < 0.005
    assert fit.params.attention_efficiency == pytest.approx(0.25, rel=0.05)
    assert "fitted on run synthetic" in fit.params.source("iteration_overhead_s")
    refit = RooflineCostModel(spec, hw, fit.params)
    for rec, t in zip(records[:20], measured[:20]):
        entries = [(c.context_len - c.num_tokens, c.num_tokens, True) for c in rec.chunks]
        assert refit.predict(plan_of(entries)).duration_ns == pytest.approx(t, rel=0.01)


FLAT = dict(attention_q_half=0.0, attention_k_half=0.0, kv_context_half=0.0)  # calibrate's shape: one efficiency
# per operator class


def _synthetic_run(truth: CostParams, n: int = 300, seed: int = 2):
    config = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    spec, hw = config, get_hardware("cpu")
    cm = RooflineCostModel(spec, hw, truth)
    rng = random.Random(seed)
    records, measured = [], []
    for k in range(n):
        entries = [(rng.randrange(16, 900), 1, True) for _ in range(rng.randrange(0, 16))]
        for _ in range(rng.choice([0, 0, 1, 2])):
            entries.append((rng.randrange(0, 256), rng.randrange(16, 256), True))
        if not entries:
            continue
        cost = cm.predict(plan_of(entries))
        records.append(IterationRecord(k, "w", "colocated", 0, cost.duration_ns,
                                       num_prefill_tokens=sum(n for _, n, _ in entries if n > 1),
                                       num_decode_tokens=sum(1 for _, n, _ in entries if n == 1),
                                       chunks=[ScheduledChunk(str(i), n, n > 1, s + n)
                                               for i, (s, n, _) in enumerate(entries)],
                                       modeled=cost.modeled))
        measured.append(cost.duration_ns)
    return spec, hw, records, measured


@pytest.mark.parametrize("decode_attention", [None, 0.05])
def test_calibration_finds_the_decodes_attention_from_a_compute_bound_start(decode_attention):
    """This CPU's shape: GEMMs compute-bound, a cost per prefill chunk, and the decodes' attention
    (its own kernel) bound by its K/V reads at their own efficiency (None) or by its compute at
    15% of peak. The default start assigns attention to its compute branch everywhere; the fit
    must still find the decodes' term and the chunk cost, and the simulator must predict with the
    fitted parameters what the fit did (terms that bound no iteration are set so that they still
    bind none)."""
    truth = CostParams(compute_efficiency=0.45, rows_half=0.0, attention_efficiency=0.7, memory_efficiency=1.0,
                       decode_attention_efficiency=decode_attention, kv_memory_efficiency=0.2,
                       iteration_overhead_s=0.045, layer_overhead_s=0.0, request_overhead_s=1e-3,
                       chunk_overhead_s=0.02, token_overhead_s=0.0, **FLAT)
    spec, hw, records, measured = _synthetic_run(truth)
    fit = fit_params(records, measured, spec, hw, 2, "synthetic")
    s = fit.summary()
    assert s["relative_error_abs_p99"] < 0.01
    if decode_attention is None:  # decodes bound by their K/V reads
        assert fit.params.kv_memory_efficiency == pytest.approx(0.2, rel=0.05)
    else:
        assert fit.params.decode_attention_efficiency == pytest.approx(0.05, rel=0.05)
    assert fit.params.chunk_overhead_s == pytest.approx(0.02, rel=0.05)
    assert fit.params.request_overhead_s == pytest.approx(1e-3, rel=0.1)
    for name in ("compute_efficiency", "memory_efficiency", "attention_efficiency", "kv_memory_efficiency"):
        assert 0 < getattr(fit.params, name) <= 1
    refit = RooflineCostModel(spec, hw, fit.params)
    for rec, t in zip(records, measured):
        entries = [(c.context_len - c.num_tokens, c.num_tokens, True) for c in rec.chunks]
        assert refit.predict(plan_of(entries)).duration_ns == pytest.approx(t, rel=0.01)


def test_calibration_caps_efficiencies_at_the_measured_ceiling():
    """Issue 15, item 4: a run faster than the hardware entry's ceiling (here: the entry's peak halved,
    so the GEMMs ran at 1.8x of it) is fitted with compute_efficiency capped at 1, the excess absorbed
    by the other terms, and the source says so; the simulator predicts what the bounded fit did."""
    from dataclasses import replace

    truth = CostParams(compute_efficiency=0.9, rows_half=0.0, attention_efficiency=0.7, memory_efficiency=1.0,
                       kv_memory_efficiency=0.5, iteration_overhead_s=0.02, layer_overhead_s=0.0,
                       request_overhead_s=5e-4, chunk_overhead_s=0.0, token_overhead_s=0.0, **FLAT)
    spec, hw, records, measured = _synthetic_run(truth)
    slow = replace(hw, peak_flops=hw.peak_flops / 2)
    fit = fit_params(records, measured, spec, slow, 2, "synthetic")
    p = fit.params
    assert p.compute_efficiency == 1.0 and "capped at 1" in p.source("compute_efficiency")
    for name in ("memory_efficiency", "attention_efficiency", "kv_memory_efficiency", "decode_attention_efficiency"):
        assert 0 < getattr(p, name) <= 1
    refit = RooflineCostModel(spec, slow, p)
    pred = [refit.predict(plan_of([(c.context_len - c.num_tokens, c.num_tokens, True) for c in rec.chunks]))
            .duration_ns for rec in records]
    assert sum(pred) / 1e9 == pytest.approx(fit.predicted_total_s, rel=1e-3)


def test_cost_params_without_the_newer_fields_keep_their_meaning():
    """A parameters file written before kv_memory_efficiency / chunk_overhead_s existed: K/V reads
    at memory_efficiency, no per-chunk cost (and the sources say so)."""
    p = CostParams.from_json({"memory_efficiency": 0.5, "request_overhead_s": 1e-4})
    assert p.kv_efficiency == 0.5 and p.chunk_overhead_s == 0.0
    assert "memory_efficiency's value" in p.source("kv_memory_efficiency")
    assert CostParams.from_json(p.to_json()) == p


def test_plan_counts():
    c = plan_counts(plan_of([(4, 3, False), (7, 1, True), (2, 1, True)]))
    assert (c.num_entries, c.num_tokens, c.num_sampled) == (3, 5, 2)
    assert c.kv_tokens_read == 4 + 8 + 3 and c.keys_attended == 18 + 8 + 3  # docs/metrics.md's worked example
    # the chunk's shape (tokens, start) for the attention efficiency curve; decodes are counted, not listed
    assert c.chunks == ((3, 4),) and (c.num_chunks, c.num_decodes, c.decode_keys) == (1, 2, 8 + 3)
