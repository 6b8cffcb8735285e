"""Whole models on each linear path (issue 18): a tiny GGUF of mixed formats, and the bundled model.

The reference is the dequantized fp32 path (`--weights dequantized`: gguf-py's dequantization,
torch's matmuls), which other tests hold to Hugging Face transformers.
"""

from __future__ import annotations

import os
import warnings

import gguf
import pytest
import torch

from phaselab.engine_args import EngineArgs
from phaselab.engine.engine import LLMEngine
from phaselab.model.kernels import qlinear
from phaselab.model.linear import PackedLinear
from phaselab.model.kernels.linear_timing import BATCHED_ROWS, CROSSOVER_ROWS
from phaselab.model.loader import load_checkpoint
from tests._loader_helpers import random_weights, tiny_hf_config, write_gguf
from tests._model_helpers import compare_greedy, make_prompts

pytestmark = pytest.mark.skipif(not qlinear.available(), reason=f"native kernel unavailable: {qlinear.unavailable_reason()}")
Q = gguf.GGMLQuantizationType


def _tiny_gguf(tmp_path, tie: bool) -> str:
    config = tiny_hf_config(tie=tie)
    weights = random_weights(config, seed=3)
    qtypes = {}
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            qtypes[name] = Q.Q4_0
        elif name.endswith(("v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            qtypes[name] = Q.Q4_1  # q/k Q4_0 with v Q4_1: the fused qkv falls back to dense rows
        elif name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight")):
            qtypes[name] = Q.Q8_0
        elif name == "lm_head.weight":
            qtypes[name] = Q.Q4_0
    return write_gguf(str(tmp_path / f"tiny-{tie}.gguf"), config, weights, qtypes)


def _engine(path: str, **options) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, kv_cache_memory="8MiB", max_model_len=200, **options))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("path", ["q", "bf16", "fp32", "torch"])
def test_each_forced_path_matches_dequantized_fp32(tmp_path, monkeypatch, tie, path):
    gguf_path = _tiny_gguf(tmp_path, tie)
    ref = _engine(gguf_path, dtype="float32", weights="dequantized")
    assert ref.linear.path == "torch"
    monkeypatch.setenv("PHASELAB_LINEAR", path)
    tokens = list(range(3, 3 + 150))
    want = ref.score(tokens)
    for dtype in ("float32", "bfloat16"):
        eng = _engine(gguf_path, dtype=dtype)
        assert eng.linear.path == path and "PHASELAB_LINEAR" in eng.linear.reason
        packed = [m for m in eng.executor.model.modules() if isinstance(m, PackedLinear)]
        assert (len(packed) > 0) == (path != "torch")
        for native_rows in (10**6, 0):  # every row through the kernel, then every row through the GEMM tile
            for m in packed:
                m.max_native_rows = native_rows
            got = eng.score(tokens)
            # fp32 end to end: summation order only; bf16 weights or activations: bf16 rounding
            exact = dtype == "float32" and path != "bf16"
            tol = 2e-4 if exact else 0.1
            err = (got - want).abs().max().item()
            assert err <= tol * want.abs().max().item(), f"{path}/{dtype}/native<={native_rows}: max logit error {err}"
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            assert agree >= (1.0 if exact else 0.9), f"{path}/{dtype}: top-1 agreement {agree}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_batched_gemm_matches_dequantized_fp32(tmp_path, monkeypatch, dtype):
    """PHASELAB_BATCHED=resident: the q path keeps a dense copy for its GEMM rows; the model
    still computes the dequantized checkpoint, and config.json says what the copy costs."""
    gguf_path = _tiny_gguf(tmp_path, tie=True)
    ref = _engine(gguf_path, dtype="float32", weights="dequantized")
    tokens = list(range(3, 3 + 150))
    want = ref.score(tokens)
    monkeypatch.setenv("PHASELAB_LINEAR", "q")
    monkeypatch.setenv("PHASELAB_BATCHED", "resident")
    eng = _engine(gguf_path, dtype=dtype)
    summary = eng.run_config()["linear"]
    assert summary["batched"] == "resident" and eng.linear.batched == "resident"
    assert summary["resident_bytes"] > 0 and summary["memory_bytes"] == summary["weight_bytes"] + summary["resident_bytes"]
    packed = [m for m in eng.executor.model.modules() if isinstance(m, PackedLinear)]
    assert all(m.direct is not None for m in packed)
    # beside a dense copy, layers keep Q4_1 (the fused gate/up here) re-laid for the kernel: Q4_1X
    # for vdpbf16ps with bf16 activations, Q4_1L in the AVX2 build, else as stored; and Q8_0 as
    # Q8_0L in the AVX2 build (independent of qlinear.native_format: from the build's features)
    feats = qlinear.features()
    layout = ("Q4_1X" if dtype == "bfloat16" and feats["avx512_bf16_dot"] else "Q4_1L" if feats["avx2"] else "Q4_1")
    layout8 = "Q8_0L" if feats["avx2"] else "Q8_0"
    q41 = sum(m.packed.fmt in ("Q4_1", "Q4_1X", "Q4_1L") for m in packed)
    q80 = sum(m.packed.fmt in ("Q8_0", "Q8_0L") for m in packed)
    assert q41 > 0 and sum(m.packed.fmt == layout for m in packed) == q41
    assert sum(m.packed.fmt == layout8 for m in packed) == q80
    want_layouts = {f: c for f, c in ((layout, q41), (layout8, q80)) if c and f not in ("Q4_1", "Q8_0")}
    assert summary["kernel_layouts"] == want_layouts
    for native_rows in (0, 10**6):  # every row through the GEMM on the resident copy, then the kernel
        for m in packed:
            m.max_native_rows = native_rows
        got = eng.score(tokens)
        tol = 2e-4 if dtype == "float32" else 0.1
        err = (got - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), f"resident/{dtype}/native<={native_rows}: max logit error {err}"
    monkeypatch.setenv("PHASELAB_BATCHED", "dense")
    with pytest.raises(Exception, match="PHASELAB_BATCHED"):
        _engine(gguf_path, dtype=dtype)


def test_weights_option_and_record(tmp_path, monkeypatch):
    monkeypatch.delenv("PHASELAB_LINEAR", raising=False)
    gguf_path = _tiny_gguf(tmp_path, tie=True)
    q = _engine(gguf_path, dtype="float32", weights="quantized")
    assert q.linear.path == "q"
    summary = q.run_config()["linear"]
    assert summary["path"] == "q" and summary["formats"]["Q4_1"] == 2 and summary["tied_head"].startswith("embedding")
    assert summary["cpu"]["isa"] and "probe" in summary
    auto = _engine(gguf_path, dtype="float32")
    assert auto.linear.path in ("q", "fp32", "torch") and "measured" in auto.linear.reason
    assert auto.linear.batched in ("tile", "resident")
    # the probe's table behind max_native_rows and the batched choice: every path, every row count
    rows = auto.run_config()["linear"]["probe"]["rows"]
    assert set(rows) == {"Q4_1", "BF16", "F32"}
    assert all(set(rows[f]) == {str(r) for r in CROSSOVER_ROWS} for f in rows)
    # the four-weight-row pass: timed against one row at a time per format, and the kernel set from the
    # probe's choice (the timings recorded beside it); where it starts, it is the faster at every
    # larger probed count, and one row below it was not
    from phaselab.model.kernels import qlinear
    from phaselab.model.kernels.linear_timing import ROWS4_ROWS

    probe = auto.run_config()["linear"]["probe"]
    chosen = auto.linear.rows4_min
    assert chosen == probe["rows4_min"] and set(chosen) == set(probe["rows4"])
    if qlinear.features()["avx512"]:
        assert "Q8_0" in chosen  # the head's format of most GGUF files always has the pass
    for fmt, start in chosen.items():
        assert qlinear.rows4_min(fmt) == start
        table = probe["rows4"][fmt]
        assert set(table) == {str(r) for r in ROWS4_ROWS}
        assert all(table[str(r)]["four"] < table[str(r)]["one"] for r in ROWS4_ROWS if r >= start)
        below = [r for r in ROWS4_ROWS if r < start]
        assert not below or table[str(below[-1])]["four"] >= table[str(below[-1])]["one"]
    monkeypatch.setenv("PHASELAB_ROWS4_MIN", "off")
    off = _engine(gguf_path, dtype="float32")
    assert set(off.linear.rows4_min.values()) == {qlinear.ROWS4_OFF} and qlinear.rows4_min("Q8_0") == qlinear.ROWS4_OFF
    assert "Q8_0 never" in off.linear.summary()
    monkeypatch.setenv("PHASELAB_ROWS4_MIN", "0")
    with pytest.raises(Exception, match="PHASELAB_ROWS4_MIN"):
        _engine(gguf_path, dtype="float32")
    monkeypatch.delenv("PHASELAB_ROWS4_MIN")
    auto = _engine(gguf_path, dtype="float32")  # the probe's choice again, for the tests after this one
    assert all(qlinear.rows4_min(f) == r for f, r in auto.linear.rows4_min.items())
    # dtype auto: chosen on decode's linear cost at one row and at a batched row count, both recorded
    picked = _engine(gguf_path)
    assert "at 1 row" in picked.linear.dtype_reason and f"at {BATCHED_ROWS} rows" in picked.linear.dtype_reason
    with pytest.raises(Exception, match="weights"):
        EngineArgs(weights="int4")
    monkeypatch.setenv("PHASELAB_LINEAR", "int4")
    with pytest.raises(Exception, match="PHASELAB_LINEAR"):
        _engine(gguf_path)


def test_native_rows_follow_the_probe_past_a_near_tie_at_one_row(tmp_path, monkeypatch):
    """max_native_rows against the probe's own table, for a GGUF (q path) and a dense checkpoint (the
    engine dtype's native path): at every probed row count up to it the kernel was within the tie
    factor of the GEMM it hands over to, at it the kernel was the faster, and at the next probed
    count it lost (or none is left). The table an AVX2-only EPYC measured for F32 (the kernel 278 us
    against the GEMM's 261 at one row, 1.3-4.2x faster from 2 to 64 rows) keeps every decode size
    on the kernel; a clear loss at one row keeps none."""
    from phaselab.model.kernels.linear_probe import TIE, _crossover, crossover_table

    monkeypatch.delenv("PHASELAB_LINEAR", raising=False)
    gguf_path = _tiny_gguf(tmp_path, tie=True)
    dense = load_checkpoint(gguf_path, torch.float32)
    for engine in (_engine(gguf_path, dtype="float32"), LLMEngine(EngineArgs(dtype="float32"), checkpoint=dense)):
        lin = engine.linear
        if lin.path == "torch":
            continue
        table, gemm = crossover_table(lin.path, lin.batched, lin.probe)
        upto = [r for r in CROSSOVER_ROWS if r <= lin.max_native_rows]
        assert all(table[str(r)]["native"] <= table[str(r)][gemm] * TIE for r in upto), (lin.max_native_rows, table)
        if upto:
            assert table[str(upto[-1])]["native"] <= table[str(upto[-1])][gemm]
        above = [r for r in CROSSOVER_ROWS if r > lin.max_native_rows]
        if above:
            nxt = table[str(above[0])]
            assert nxt["native"] > nxt[gemm], (lin.max_native_rows, table)
    measured = {"1": (278e-6, 261e-6), "2": (304e-6, 544e-6), "4": (419e-6, 1276e-6), "8": (726e-6, 3038e-6),
                "16": (1404e-6, 2902e-6), "32": (2889e-6, 5707e-6), "64": (5063e-6, 6374e-6)}
    table = {r: {"native": n, "resident": g} for r, (n, g) in measured.items()}
    assert _crossover(table, "resident") == 64
    table["1"]["native"] = 261e-6 * TIE * 1.01
    assert _crossover(table, "resident") == 0


# -- the bundled model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(bundled_path):
    import os

    saved = os.environ.pop("PHASELAB_LINEAR", None)
    try:
        packed = load_checkpoint(bundled_path, torch.float32, keep_packed=True)
        q = LLMEngine(EngineArgs(dtype="float32", weights="quantized", kv_cache_memory="512MiB", max_model_len=2048),
                      checkpoint=packed)
        ref = LLMEngine(EngineArgs(dtype="float32", weights="dequantized", kv_cache_memory="512MiB",
                                   max_model_len=2048))
    finally:
        if saved is not None:
            os.environ["PHASELAB_LINEAR"] = saved
    return q, ref


def test_bundled_weight_memory(engines, bundled_path):
    q, ref = engines
    assert q.linear.path == "q" and ref.linear.path == "torch"
    reader = gguf.GGUFReader(bundled_path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    # every tensor as stored in the file (the tied head reuses the Q8_0 embedding rows), norms in fp32
    assert q.linear_summary["weight_bytes"] == file_bytes
    assert q.linear_summary["weight_bytes"] < 0.2 * ref.linear_summary["weight_bytes"]  # vs 538 MB fp32


def test_records_price_the_weights_as_the_engine_keeps_them(engines, bundled_path):
    """The iteration records' modeled weight bytes (cost/formulas.py: what one pass reads) are the file's
    own tensors on the quantized path, counted by the GGUF reader outside the engine, and parameters x 4
    on the dequantized fp32 path, at a decode step and at a prefill alike (the GEMM above
    max_native_rows widens the same blocks into a cache-sized tile)."""
    from phaselab.core.sampling_params import SamplingParams

    q, ref = engines
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(bundled_path).tensors)
    for engine, want in ((q, file_bytes), (ref, 4 * ref.model_config.num_parameters())):
        first = len(engine.recorder.iterations)
        engine.add_request(engine.tokenizer.encode("the weights as stored " * 8), SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        its = engine.recorder.iterations[first:]
        assert {it.num_prefill_tokens > 0 for it in its} == {True, False}
        assert {it.modeled.weight_bytes for it in its} == {want}, engine.linear.path


def test_bundled_greedy_token_identical_to_dequantized(engines):
    from phaselab.core.sampling_params import SamplingParams

    q, ref = engines
    prompts = make_prompts(q.tokenizer)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def run(engine):
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[i] for i in ids]

    ours, want = run(q), run(ref)
    # compare_greedy raises on a real divergence; a near-tie (docs/design.md) is reported, not failed
    ties = [t for o, w, p in zip(ours, want, prompts) if (t := compare_greedy(o, w, p, ref.score))]
    if ties:
        warnings.warn("; ".join(ties))


def test_bundled_teacher_forced_top1(engines):
    q, ref = engines
    prompts = make_prompts(q.tokenizer)
    seq = prompts[-1][:1200]  # a long document, teacher-forced
    for m in q.executor.model.modules():
        if isinstance(m, PackedLinear):
            m.max_native_rows = 10**6  # every position through the quantized kernel
    try:
        got, want = q.score(seq), ref.score(seq)
    finally:
        for m in q.executor.model.modules():
            if isinstance(m, PackedLinear):
                m.max_native_rows = q.linear.max_native_rows
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.995, f"teacher-forced top-1 agreement {agree:.4f}"
    assert (got - want).abs().max().item() < 1e-2


@pytest.mark.skipif(not qlinear.features()["avx512_bf16_dot"], reason="this CPU lacks AVX512-BF16: no Q4_1X kernel")
def test_bundled_q4_1x_matches_dequantized_references(bundled_path, monkeypatch):
    """The bundled model in bf16 with its Q4_1 blocks re-laid as Q4_1X (beside a resident dense
    copy for the GEMM), every position through the kernel, teacher-forced on a long document.
    Against the dequantized fp32 model, bf16 activations alone cost top-1 agreement (torch's
    dequantized bf16 model measured 99.33% here, as did Q4_1X and the Q4_1 kernel 99.25%): Q4_1X
    must agree with fp32 as well as torch's bf16 model does, within 0.3 points, and with torch's
    bf16 model at >= 99%. (Greedy runs are not compared: two bf16 models round differently, here
    the exact Q4_1 weights against their bf16 roundings, and part at a bf16 logit step, 0.25.)"""
    monkeypatch.delenv("PHASELAB_LINEAR", raising=False)
    monkeypatch.setenv("PHASELAB_BATCHED", "resident")
    args = {"kv_cache_memory": "256MiB", "max_model_len": 2048}
    q = LLMEngine(EngineArgs(dtype="bfloat16", weights="quantized", **args))
    bf16 = LLMEngine(EngineArgs(dtype="bfloat16", weights="dequantized", **args))
    fp32 = LLMEngine(EngineArgs(dtype="float32", weights="dequantized", **args))
    assert q.linear_summary["kernel_layouts"].get("Q4_1X", 0) > 0, q.linear_summary
    prompts = make_prompts(q.tokenizer)
    seq = prompts[-1][:1200]
    layers = [m for m in q.executor.model.modules() if isinstance(m, PackedLinear)]
    for m in layers:
        m.max_native_rows = 10**6
    got = q.score(seq).argmax(-1)
    for m in layers:
        m.max_native_rows = q.linear.max_native_rows
    want32, want16 = fp32.score(seq).argmax(-1), bf16.score(seq).argmax(-1)
    agree32 = (got == want32).float().mean().item()
    torch_bf16 = (want16 == want32).float().mean().item()
    agree16 = (got == want16).float().mean().item()
    assert agree32 >= torch_bf16 - 0.003 and agree16 >= 0.99, (agree32, torch_bf16, agree16)


def test_a_rerun_runs_the_recorded_row_counts(tmp_path, monkeypatch):
    """verify's reruns are built on the linear decision the run recorded, down to the row count up to
    which the kernel runs and the four-row pass per format: a forced path alone runs no probe and took
    the default row count (16) where the run's probe had chosen 64, and the rerun's batch-32 steps ran
    another GEMM (phaselab/experiments/diagnose_verify.py). The run here is made with unusual values (5 rows, the four-row
    pass per format) so that no default can pass for them; the rerun's engine is read back, layer by
    layer, and the kernel's own per-format setting."""
    from phaselab.experiments.diagnose_verify import _recorded_linear_path
    from phaselab.errors import ConfigError
    from phaselab import envs
    from phaselab.model.kernels.linear_probe import parse_rows4

    gguf_path = _tiny_gguf(tmp_path, tie=False)
    monkeypatch.setenv(envs.NATIVE_ROWS.name, "5")
    monkeypatch.setenv(envs.ROWS4_MIN.name, "Q4_0=8,Q8_0=off")
    monkeypatch.setenv(envs.PREFETCH_BYTES.name, "3072")  # no candidate of the start-up choice
    run = _engine(gguf_path, dtype="float32", weights="quantized")
    config = run.run_config()
    assert config["linear"]["max_native_rows"] == 5 and "PHASELAB_NATIVE_ROWS" in config["linear"]["reason"]
    assert config["linear"]["rows4_min"] == {"Q4_0": 8, "Q8_0": qlinear.ROWS4_OFF}
    assert config["linear"]["prefetch_bytes"] == 3072 and qlinear.prefetch() == 3072
    for var in (envs.NATIVE_ROWS.name, envs.ROWS4_MIN.name, envs.PREFETCH_BYTES.name):
        monkeypatch.delenv(var)
    qlinear.set_prefetch(0)  # as another engine in between would leave it
    with _recorded_linear_path(config, {}):
        rerun = _engine(gguf_path, dtype="float32")
    layers = [m for m in rerun.executor.model.modules() if isinstance(m, PackedLinear)]
    assert layers and {m.max_native_rows for m in layers} == {5}
    assert rerun.linear.path == "q" and qlinear.rows4_min("Q4_0") == 8 and qlinear.rows4_min("Q8_0") == qlinear.ROWS4_OFF
    assert rerun.linear.prefetch_bytes == 3072 and qlinear.prefetch() == 3072
    # the pins end with the rerun's engine
    assert envs.NATIVE_ROWS.name not in os.environ and envs.PREFETCH_BYTES.name not in os.environ
    # a change of weights or dtype measures again: nothing pinned
    with _recorded_linear_path(config, {"dtype": "bfloat16"}):
        assert envs.NATIVE_ROWS.name not in os.environ
    for bad, env in (("-1", envs.NATIVE_ROWS), ("many", envs.NATIVE_ROWS), ("Q9_9=4", envs.ROWS4_MIN),
                     ("Q4_0=0", envs.ROWS4_MIN), ("near", envs.PREFETCH_BYTES), ("8", envs.PREFETCH_BYTES)):
        var = env.name
        monkeypatch.setenv(var, bad)
        with pytest.raises(ConfigError, match=var):
            _engine(gguf_path, dtype="float32", weights="quantized")
        monkeypatch.delenv(var)
    assert parse_rows4("off") == {f: qlinear.ROWS4_OFF for f in qlinear.FORMAT_IDS}
    _engine(gguf_path, dtype="float32")  # the probe's own choice again, for the tests after this one


def test_prefetch_distance_is_measured_on_the_models_own_layers(monkeypatch):
    """A bf16 engine with Q4_1X layers times one decode step's layers at each candidate distance and
    runs the faster (by more than 1%; else the kernel's default), recorded in config.json; a model
    without Q4_1X layers (float32 activations) measures nothing and keeps the default. The rule is
    checked on the engine's own timings, and again on given ones (a near-tie keeps the default)."""
    from phaselab.model.kernels import prefetch_probe

    for dtype in ("bfloat16", "float32"):
        engine = LLMEngine(EngineArgs(dtype=dtype, kv_cache_memory="32MiB", max_model_len=200))
        lin = engine.run_config()["linear"]
        q41x = engine.linear.layouts.get("Q4_1X", 0) > 0
        assert q41x == (dtype == "bfloat16" and qlinear.features()["avx512_bf16_dot"] and qlinear.native_format("Q4_1", torch.bfloat16) == "Q4_1X")
        if not q41x:
            assert lin["prefetch_probe"] == {} and lin["prefetch_bytes"] == 0
            continue
        times = lin["prefetch_probe"]
        assert set(times) == {str(b) for b in prefetch_probe.PREFETCH_CANDIDATES} and min(times.values()) > 0
        best = min(prefetch_probe.PREFETCH_CANDIDATES, key=lambda b: times[str(b)])
        default = prefetch_probe.PREFETCH_CANDIDATES[0]
        chosen = best if times[str(best)] * 1.01 < times[str(default)] else 0
        assert lin["prefetch_bytes"] == chosen and qlinear.prefetch() == (chosen or default)
        model = engine.executor.model
        for given, expect in (({"2048": 3.0, "4096": 2.5}, 4096), ({"2048": 3.0, "4096": 2.99}, 0),
                              ({"2048": 2.5, "4096": 3.0}, 0)):
            monkeypatch.setattr(prefetch_probe, "_prefetch_times", lambda *a, g=given: dict(g))
            prefetch_probe.choose(engine.linear, model)
            assert engine.linear.prefetch_bytes == expect and qlinear.prefetch() == (expect or default)
        monkeypatch.undo()
