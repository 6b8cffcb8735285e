"""Diagnosis on real engine runs built to have one known cause each (the bundled model, bf16 or
fp32 by the CPU (tests/_model_helpers.serving_dtype), small workloads driven with arrival timing by
phaselab.workload.driver.run_arrivals):

    queue-bound      arrivals far above capacity (max_num_seqs=2, a request every 50 ms)
    prefill-bound    long prompts, few requests, one at a time, two output tokens, all beginning with the
                     same 768 tokens and prefix caching off
    decode/KV-bound  long histories (a 5000-token shared prefix served by the prefix cache), batch 32;
                     truth: the same batch at short histories
    KV capacity      a 4 MiB cache for 10 growing requests; truth: the scheduler's preemption count
    healthy          a few spaced requests: no queue, stall or KV-capacity finding of weight
    stall            prefill-first, two 1024-token prompts arriving among four decoding streams

The slow-transfer-link scenario (1P1D, KV over a veth shaped with tc, through serve + bench) is in
tests/test_analysis_transfer.py; following each top suggestion with --verify in
tests/test_analysis_verify.py.

For each, the top-ranked cause must be the built-in one and its key figure within 15% of the ground
truth computed here from the run's own records (raw timestamps and iteration records, not through
the accounting). Wall-clock times are never asserted.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from phaselab.analysis.diagnose import diagnose, write_diagnosis
from phaselab.obs.rundir import read_run_dir
from phaselab.workload.driver import Arrival, random_prompt, run_arrivals
from tests._model_helpers import kv_memory, serving_checkpoint, serving_dtype

pytestmark = pytest.mark.slow
REL = 0.15
# the decode-kv scenario's cost per history token, diagnosis against the controlled experiment, judged
# per attempt at a fixed tolerance: seven attempts here (bf16 on the AMX Xeon, 2 cores, load average
# 0.4-1.8) missed by 10.8, 16.6, 6.7, 12.2, 0.3, 0.9 and 7.1% (the experiment's own 95% half-width
# 2-10%); the one at 16.6% was followed by one at 6.7%
KV_COST_REL = 0.15
ATTEMPTS = 3


@pytest.fixture(scope="module")
def checkpoint():
    return serving_checkpoint()


def _engine(checkpoint, **kw):
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine

    kw = {"kv_cache_memory": kv_memory(256), "max_model_len": 2048, **kw}
    return LLMEngine(EngineArgs(dtype=serving_dtype(), **kw),
                     checkpoint=checkpoint)


def _run(engine, arrivals, path):
    run_arrivals(engine, arrivals)
    engine.write_record(str(path))
    d = diagnose(path)
    write_diagnosis(d, path)
    return d, read_run_dir(path)


def _shares(d) -> str:
    top = sorted(d.account.shares.items(), key=lambda kv: -kv[1])[:3]
    return "; ranking " + ", ".join(f"{c} {v:.1%}" for c, v in top)


def _raw(path, name):
    return [json.loads(x) for x in (path / name).read_text().splitlines() if x.strip()]


def test_queue_bound(checkpoint, tmp_path):
    rng = np.random.default_rng(0)
    arrivals = [Arrival(f"q{i}", random_prompt(rng, 48), 8, at_s=i * 0.05) for i in range(12)]
    d, _ = _run(_engine(checkpoint, max_num_seqs=2), arrivals, tmp_path / "queue")
    assert d.top is not None and d.top.cause == "queue", d.account.shares
    reqs = _raw(tmp_path / "queue", "requests.jsonl")
    truth = sum(r["first_scheduled_ns"] - r["queued_ns"] for r in reqs) / sum(
        r["token_sent_ns"][0] - r["arrived_ns"] for r in reqs)
    print(f"queue share of TTFT: diagnosis {d.top.key.value:.4f}, records {truth:.4f}" + _shares(d))
    assert d.top.key.value == pytest.approx(truth, rel=REL)
    assert d.queue is not None and d.queue.growing
    assert d.queue.arrival_rate is not None and d.queue.service_rate is not None
    assert d.queue.arrival_rate > d.queue.service_rate


PREFIX = 768
PREFILL_LENGTHS = tuple(784 + 56 * k for k in range(9))  # 784 .. 1232 tokens
# cache off; chunks of 512, so the run itself computes chunks after computed tokens (the attention
# over a prefix that a prefix-cache hit leaves), and a prediction of the cache's effect is fitted on
# that path rather than extrapolated from cold chunks: CI runs measured the cache's gain 10-25% under
# such an extrapolation
PREFILL_ENGINE = {"enable_prefix_caching": False, "max_num_batched_tokens": 512}


def prefill_arrivals() -> list[Arrival]:
    """The prefill-bound workload: lone prompts one after another (each sent when the last one
    ended), every one beginning with the same 768 tokens (a system prompt's shape). Nine of them, so
    that TTFT p50 is not one request's (verify compares it across reruns); with the cache on, the
    median request computes 296 tokens after the 768 cached, and the first (cold) is the slowest."""
    rng = np.random.default_rng(1)
    prefix = random_prompt(rng, PREFIX)
    arrivals: list[Arrival] = []
    for n in PREFILL_LENGTHS:
        arrivals.append(Arrival(f"p{n}", prefix + random_prompt(rng, n - PREFIX), 2, at_s=None if arrivals else 0.0,
                                after_finished=arrivals[-1].request_id if arrivals else None))
    return arrivals


def test_prefill_bound(checkpoint, tmp_path):
    """Prefill-bound with prefix caching off: the top cause is prefill, its share of TTFT is the
    records' prefill compute over their TTFT, and the repeated beginnings (known by construction:
    every prompt after the first repeats the 768 shared tokens) are found and prefix caching is
    the change (its rerun: tests/test_analysis_verify.py)."""
    d, _ = _run(_engine(checkpoint, **PREFILL_ENGINE), prefill_arrivals(), tmp_path / "prefill")
    assert d.top is not None and d.top.cause == "prefill", d.account.shares
    reqs = _raw(tmp_path / "prefill", "requests.jsonl")
    compute = sum(c["end_ns"] - c["start_ns"] for r in reqs for c in r["prefill_chunks"])
    truth = compute / sum(r["token_sent_ns"][0] - r["arrived_ns"] for r in reqs)
    print(f"prefill share of TTFT: diagnosis {d.top.key.value:.4f}, records {truth:.4f}" + _shares(d))
    assert d.top.key.value == pytest.approx(truth, rel=REL)
    fit = d.prefill.fit
    assert fit is not None and fit.slope > 0 and fit.n == len(PREFILL_LENGTHS)
    # the slope against the records' own (tokens, chunk time) points
    xs = [r["num_prompt_tokens"] for r in reqs]
    ys = [sum(c["end_ns"] - c["start_ns"] for c in r["prefill_chunks"]) / 1e9 for r in reqs]
    assert fit.slope == pytest.approx(float(np.polyfit(xs, ys, 1)[0]), rel=REL)
    repeated = PREFIX * (len(PREFILL_LENGTHS) - 1) / sum(PREFILL_LENGTHS)
    assert d.prefill.repeat_missed_rate == pytest.approx(repeated) and d.prefill.prefix_caching is False
    assert d.top.prediction is not None and d.top.prediction.change.flags == "--enable-prefix-caching"


def _decode_steps_at(path, batch):
    return [(r["end_ns"] - r["start_ns"]) / 1e9 for r in _raw(path, "iterations.jsonl")
            if r["num_prefill_tokens"] == 0 and r["num_decode_tokens"] == batch]


def _per_history_token(engine, rng, prefix, rounds):
    """The controlled experiment: batch 32 decoding at short, then at long histories, each wave its
    own run, alternated `rounds` times. The waves are the run's own (24 and 48 tokens): a wave's
    steps slow as it goes on (measured 97 -> 139 ms over 48 steps), so shorter waves measured
    only their fast start. Returns the steps' times and histories per length."""
    steps: dict[str, list[float]] = {"short": [], "long": []}
    ctxs: dict[str, list[float]] = {"short": [], "long": []}
    for k in range(rounds):
        for name, pre, tokens in (("short", [], 24), ("long", prefix, 48)):
            tag = f"{name}{k}-{rng.integers(1 << 30)}"
            wave = [Arrival(f"{tag}-{i}", pre + random_prompt(rng, 16), tokens, at_s=0.0) for i in range(32)]
            if pre:
                wave = [Arrival(f"w{tag}", pre + random_prompt(rng, 16), 1, at_s=0.0)] + [
                    dataclasses.replace(a, at_s=None, after_finished=f"w{tag}") for a in wave]
            n = len(engine.iterations)
            run_arrivals(engine, wave)
            batch = [r for r in list(engine.iterations)[n:] if r.num_prefill_tokens == 0 and r.num_decode_tokens == 32]
            steps[name] += [r.duration_s for r in batch]
            ctxs[name] += [float(sum(c.context_len for c in r.chunks)) for r in batch]
    return steps, ctxs


def _experiment_half_width(steps, ctxs) -> float:
    """Half the 95% interval of the experiment's cost per history token (medians of resampled
    steps, 2000 draws): the truth is measured on a noisy machine too."""
    rng = np.random.default_rng(7)
    short, long = np.array(steps["short"]), np.array(steps["long"])
    span = float(np.mean(ctxs["long"]) - np.mean(ctxs["short"]))
    draws = [(np.median(rng.choice(long, long.size)) - np.median(rng.choice(short, short.size))) / span
             for _ in range(2000)]
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(hi - lo) / 2


def kv_bound_prefix() -> int:
    """The shared history's length that makes batch 32's decode K/V-bound on this host: each
    sequence's K/V read per step must clearly outweigh its share of the weights and the
    per-sequence compute. Serving bf16 (a CPU with AVX512-BF16 or AMX), 5000 tokens: at 1600 the two
    were even, and at 3000 again once the decode attention got faster (decode-kv 42.7% against
    decode-step 41.5% of the run). Serving fp32 (an AVX2-only EPYC) on the quantized blocks
    (tests/_model_helpers.serving_checkpoint), 5000 too: decode-kv 46.1% against decode-step 24.0%
    (steps of 133 ms at short histories, 448 ms at 5000). On weights widened to dense fp32, whose
    32-row steps took 200-330 ms at short histories, decode-step had led in 4 of 5 attempts at 5000."""
    return 5000


def test_decode_kv_bound(checkpoint, tmp_path):
    """The run: a short wave (32 requests, 16-token prompts, 24 tokens) then a long one (the same
    batch over a long shared prefix (kv_bound_prefix) from the prefix cache, 48 tokens: decoding,
    not the one long prefill, is most of the run), so the history varies within the run. Truth by a controlled experiment outside it: the same batch of 32 decoding at
    short and at long histories in separate runs gives the cost per history token,
    (long step - short step) / (long history - short history); the K/V share of the run's decode
    time is that cost times each step's history over the steps' measured time.

    The experiment's rounds sandwich the diagnosed run (one before, one after), so a drift of the
    shared machine's load during the test moves both alike. A disagreement (in the top cause or the
    cost) is measured again from scratch, twice, before it fails: load on a 2-core CI machine can
    shift by more than the tolerance within a minute (steps of one wave measured 100 to 155 ms),
    a wrong attribution is wrong every time. Each attempt is judged alone, at the fixed KV_COST_REL.
    The K/V floor counts a shared prefix's blocks once per step: the experiment measured 0.66 us per
    history token where a floor per reader said 0.83."""
    rng = np.random.default_rng(2)
    prefix = random_prompt(rng, kv_bound_prefix())
    outcomes = []
    for attempt in range(ATTEMPTS):
        engine = _engine(checkpoint, max_model_len=8192, kv_cache_memory=kv_memory(512))
        steps, ctxs = _per_history_token(engine, rng, prefix, rounds=1)
        arrivals = [Arrival(f"s{i}", random_prompt(rng, 16), 24, at_s=0.0) for i in range(32)]
        arrivals += [Arrival("warm", prefix + random_prompt(rng, 16), 1, after_finished="s31")]
        arrivals += [Arrival(f"d{i}", prefix + random_prompt(rng, 16), 48, after_finished="warm") for i in range(32)]
        path = tmp_path / f"decode{attempt}"
        d, run = _run(_engine(checkpoint, max_model_len=8192, kv_cache_memory=kv_memory(512)), arrivals, path)
        # the long histories came from the cache
        assert sum(m.num_cached_tokens for m in run.requests) >= 32 * (len(prefix) - 16)
        after_steps, after_ctxs = _per_history_token(engine, rng, prefix, rounds=1)
        for name in steps:
            steps[name] += after_steps[name]
            ctxs[name] += after_ctxs[name]
        short_s, long_s = float(np.median(steps["short"])), float(np.median(steps["long"]))
        short_ctx, long_ctx = float(np.mean(ctxs["short"])), float(np.mean(ctxs["long"]))
        per_token = (long_s - short_s) / (long_ctx - short_ctx)
        its = [r for r in _raw(path, "iterations.jsonl")
               if r["num_prefill_tokens"] == 0 and r["num_decode_tokens"] > 0]
        truth = per_token * sum(sum(c["context_len"] for c in r["chunks"]) for r in its) / sum(
            (r["end_ns"] - r["start_ns"]) / 1e9 for r in its)
        att = d.account.attribution["engine-0"]
        assert att.separable, att.reason
        print(f"attempt {attempt + 1}: K/V share of decode time: diagnosis {att.shares['kv']:.4f}, controlled "
              f"experiment {truth:.4f}; per history token {att.per_kv_token_s * 1e6:.3f} +- {att.ci[2] * 1e6:.3f} vs "
              f"{per_token * 1e6:.3f} +- {_experiment_half_width(steps, ctxs) * 1e6:.3f} us "
              f"({short_s * 1e3:.1f} ms at {short_ctx:.0f} vs {long_s * 1e3:.1f} ms at {long_ctx:.0f} tokens)"
              + _shares(d))
        # the top cause is the K/V reads, and the measured cost per history token agrees with the
        # controlled experiment within a fixed KV_COST_REL (the intervals above are printed to read a
        # failure by, never added to the tolerance)
        top = d.top.cause if d.top is not None else None
        miss = abs(att.per_kv_token_s - per_token) / per_token
        outcomes.append(f"attempt {attempt + 1}: top cause {top}, per history token diagnosis "
                        f"{att.per_kv_token_s * 1e6:.3f} us vs experiment {per_token * 1e6:.3f} us ({miss:.1%} apart)")
        if top == "decode-kv" and miss <= KV_COST_REL:
            return
    pytest.fail(f"the top cause is not decode-kv, or its cost per history token is more than {KV_COST_REL:.0%} "
                "from the controlled experiment's, in every attempt:\n" + "\n".join(outcomes))


def test_stall(checkpoint, tmp_path):
    rng = np.random.default_rng(3)
    arrivals = [Arrival(f"stream-{i}", random_prompt(rng, 64), 32, "stream", at_s=0.0) for i in range(4)]
    arrivals += [Arrival(f"long-{k}", random_prompt(rng, 1024), 2, "long", after_group_tokens=("stream", 6 + 10 * k))
                 for k in range(2)]
    d, _ = _run(_engine(checkpoint, policy="prefill-first"), arrivals, tmp_path / "stall")
    assert d.top is not None and d.top.cause == "stall", d.account.shares
    reqs = _raw(tmp_path / "stall", "requests.jsonl")
    its = _raw(tmp_path / "stall", "iterations.jsonl")
    longest_gap = max(b - a for r in reqs if r["request_id"].startswith("stream")
                      for a, b in zip(r["token_sent_ns"], r["token_sent_ns"][1:])) / 1e9
    decode_steps = sorted(r["duration_s"] for r in its if r["num_prefill_tokens"] == 0)
    longest_prefill = max(r["duration_s"] for r in its if any(c["request_id"].startswith("long") for c in r["chunks"]))
    physical = longest_prefill + decode_steps[len(decode_steps) // 2]
    print(f"longest stall: diagnosis {d.top.key.value:.3f} s, records: longest stream gap {longest_gap:.3f} s, "
          f"longest prefill iteration + a decode step {physical:.3f} s" + _shares(d))
    assert d.top.key.value == pytest.approx(longest_gap, rel=REL)
    assert d.top.key.value == pytest.approx(physical, rel=REL)
    culprit = d.stalls.culprits[0]
    assert set(culprit.requests) <= {"long-0", "long-1"} and len(culprit.streams) == 4
    assert "--policy chunked" in d.top.change


def test_ttft_shares_of_a_real_run_sum_to_100_and_match_the_record(checkpoint, tmp_path):
    rng = np.random.default_rng(5)
    arrivals = [Arrival(f"r{i}", random_prompt(rng, 32 + 40 * i), 3, at_s=0.02 * i) for i in range(6)]
    d, run = _run(_engine(checkpoint, max_num_batched_tokens=96), arrivals, tmp_path / "shares")
    t = d.ttft
    assert t is not None
    assert sum(t.share(k) for k in t.components) == pytest.approx(1.0, abs=1e-9)
    raw = {r["request_id"]: r for r in _raw(tmp_path / "shares", "requests.jsonl")}
    for p in t.at:
        rid, ttft, parts = t.at[p]
        assert sum(t.shares_at(p).values()) == pytest.approx(1.0, abs=1e-9)
        assert ttft == pytest.approx(raw[rid]["ttft_s"])
        assert parts == pytest.approx(raw[rid]["ttft_components_s"])  # as the phase record wrote them
    for a in d.account.requests:
        assert sum(a.parts.values()) == pytest.approx(a.e2e_s, abs=1e-9)


def test_kv_capacity_with_preemption(checkpoint, tmp_path):
    """A cache of 4 MiB (11 blocks of 16 tokens) for 10 requests that grow to 6 blocks each: the
    scheduler preempts
    and admissions wait for blocks. Truth: its own preemption counter, and the recompute iterations read from
    the raw iteration records."""
    rng = np.random.default_rng(3)
    arrivals = [Arrival(f"k{i}", random_prompt(rng, 48), 48, at_s=0.0) for i in range(10)]
    engine = _engine(checkpoint, kv_cache_memory=kv_memory(4), max_num_seqs=10, max_model_len=112)
    d, _ = _run(engine, arrivals, tmp_path / "kv")
    truth = engine.scheduler.num_preemptions_total
    assert truth > 0, "the workload no longer preempts: shrink the cache"
    assert d.top is not None and d.top.cause == "kv-capacity", d.account.shares
    print(f"preemptions: diagnosis {d.top.key.value:g}, scheduler {truth}" + _shares(d))
    assert d.top.key.value == truth
    # recompute = the iterations that prefilled a request after it had sampled a token
    reqs = {r["request_id"]: r for r in _raw(tmp_path / "kv", "requests.jsonl")}
    recompute = 0.0
    for it in _raw(tmp_path / "kv", "iterations.jsonl"):
        for c in it["chunks"]:
            first = reqs[c["request_id"]]["first_token_sampled_ns"]
            if c["is_prefill"] and first is not None and it["start_ns"] > first:
                recompute += (it["end_ns"] - it["start_ns"]) / 1e9
    assert d.account.kv_seconds()["recompute"] == pytest.approx(recompute, rel=REL)
    assert "--kv-cache-memory" in d.top.change


def test_healthy_control_raises_no_false_alarm(checkpoint, tmp_path):
    """Four short requests, one at a time with room to spare: the time is the decode work itself;
    no queue, stall, KV-capacity or transfer cause may carry weight. Each arrives when the one before
    finished (spaced by 1.5 s, a request outlasted its gap on a loaded 2-core machine and the
    next one queued: 18% queue in a "healthy" run)."""
    rng = np.random.default_rng(5)
    arrivals: list[Arrival] = []
    for i in range(4):
        arrivals.append(Arrival(f"h{i}", random_prompt(rng, 32), 16, at_s=None if arrivals else 0.0,
                                after_finished=arrivals[-1].request_id if arrivals else None))
    d, _ = _run(_engine(checkpoint), arrivals, tmp_path / "healthy")
    assert d.top is not None and d.top.cause in ("decode-step", "decode", "decode-kv"), d.account.shares
    shares = d.account.shares
    for cause in ("queue", "stall", "kv-capacity", "transfer"):
        assert shares[cause] < 0.05, (cause, shares)
    assert d.account.num_preemptions == 0
