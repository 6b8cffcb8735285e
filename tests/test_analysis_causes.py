"""Diagnosis on real engine runs built to have one known cause each (the bundled model, bf16 or
fp32 by the CPU (tests/_model_helpers.serving_dtype), small workloads driven with arrival timing by
phaselab.workload.driver.run_arrivals). Causes are ranked by avoidable time (analysis/accounting.py:
each cause's seconds over a stated baseline), and each truth comes from a controlled experiment or
the run's raw records, never from the diagnosis' own formulas:

    queue-bound      arrivals far above capacity (max_num_seqs=2, a request every 50 ms)
    prefill-bound    long prompts, few requests, one at a time, two output tokens, all beginning with the
                     same 768 tokens and prefix caching off
    decode/KV-bound  24 requests over one cached 2400-token prefix decoding together: one batch, one
                     history; truth: the same batch rerun at 64-token contexts
    KV capacity      a 4 MiB cache for 10 growing requests; truth: the scheduler's preemption count
    healthy          a few spaced requests: no cause with avoidable time over 10% of the users' time
    stall            prefill-first, three 2000-token prompts arriving among six decoding streams, alone
                     and beside a CPU-bound job; truth: the streams' time in reruns without the prompts
    queue and stall  both at once: both in the top two

The slow-transfer-link scenario (1P1D, KV over a veth shaped with tc, through serve + bench) is in
tests/test_analysis_transfer.py; following each top suggestion with --verify in
tests/test_analysis_verify.py. Wall-clock times are never asserted: a figure is judged against a
second run made beside it, or against the run's own records.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import numpy as np
import pytest

from phaselab.analysis.diagnose import diagnose, write_diagnosis
from phaselab.obs.rundir import read_run_dir
from phaselab.workload.driver import Arrival, random_prompt, run_arrivals
from tests._model_helpers import kv_memory, serving_checkpoint, serving_dtype

pytestmark = pytest.mark.slow
REL = 0.15
ATTEMPTS = 3  # each judged alone at REL


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
    """The avoidable ranking's first three and the raw shares' first three, to read a result by."""
    raw = sorted(d.account.shares.items(), key=lambda kv: -kv[1])[:3]
    return ("; ranking (avoidable) " + ", ".join(f"{f.cause} {f.avoidable_share:.1%}" for f in d.findings[:3])
            + "; raw shares " + ", ".join(f"{c} {v:.1%}" for c, v in raw))


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


def kv_bound_prefix() -> int:
    """The shared history's length that makes batch 32's decode K/V-bound on this host (the verify
    scenario's, tests/test_analysis_verify.py): each sequence's K/V read per step must clearly
    outweigh its share of the weights and the per-sequence compute. Serving bf16 (a CPU with
    AVX512-BF16 or AMX), 5000 tokens: at 1600 the two were even, and at 3000 again once the decode
    attention got faster (decode-kv 42.7% against decode-step 41.5% of the run). Serving fp32 (an
    AVX2-only EPYC) on the quantized blocks (tests/_model_helpers.serving_checkpoint), 5000 too:
    decode-kv 46.1% against decode-step 24.0% (steps of 133 ms at short histories, 448 ms at 5000)."""
    return 5000


KV_PREFIX, KV_BATCH, KV_TOKENS = 2400, 24, 128  # issue 38's KV-bound run: one prefix, one batch, one history
SHORT_PROMPT, SHORT_TOKENS = 48, 32  # the controlled rerun: the same batch at 48-80-token contexts (64 on average)


def _steps_at(engine, arrivals, batch) -> list[float]:
    """Drive `arrivals` through `engine`; the durations of its decode-only steps at `batch`."""
    n = len(engine.iterations)
    run_arrivals(engine, arrivals)
    return [r.duration_s for r in list(engine.iterations)[n:]
            if r.num_prefill_tokens == 0 and r.num_decode_tokens == batch]


def test_decode_kv_bound(checkpoint, tmp_path):
    """Issue 38 (a): a KV-bound run with one shared prefix, one batch size and one context length, which
    no regression over batch and history can split (nothing varies): 24 requests over a cached
    2400-token prefix decoding 128 tokens each, together. The diagnosis splits decode time by the
    engine's own kernel timers (iterations.jsonl attention_ns / linear_ns) and must rank decode-kv
    first, with its K/V share of decode time within 15% of the controlled experiment's: the same
    batch of 24 rerun at 64-token contexts (48-token prompts, 32 tokens each), before and after the
    diagnosed run on the same engine, gives the step without the history; the K/V share is
    1 - short step / long step (medians). Each attempt is judged alone at the fixed REL."""
    from phaselab.analysis.findings import measured_kv_share

    rng = np.random.default_rng(2)
    prefix = random_prompt(rng, KV_PREFIX)
    outcomes = []
    for attempt in range(ATTEMPTS):
        engine = _engine(checkpoint, max_model_len=4096, kv_cache_memory=kv_memory(512))

        def short_wave(tag):
            return _steps_at(engine, [Arrival(f"{tag}-{i}", random_prompt(rng, SHORT_PROMPT), SHORT_TOKENS, at_s=0.0)
                                      for i in range(KV_BATCH)], KV_BATCH)

        short = short_wave(f"short-before-{attempt}")
        arrivals = [Arrival("warm", prefix + random_prompt(rng, 16), 1, at_s=0.0)]
        arrivals += [Arrival(f"d{i}", prefix + random_prompt(rng, 16), KV_TOKENS, after_finished="warm")
                     for i in range(KV_BATCH)]
        path = tmp_path / f"decode{attempt}"
        n = len(engine.iterations)
        run_arrivals(engine, arrivals)
        run_iters = list(engine.iterations)[n:]
        engine.write_record(str(path))
        short += short_wave(f"short-after-{attempt}")
        d = diagnose(path)
        write_diagnosis(d, path)
        run = read_run_dir(path)
        assert sum(m.num_cached_tokens for m in run.requests) >= KV_BATCH * (KV_PREFIX - 16)  # from the cache
        long_steps = [r.duration_s for r in run_iters if r.num_prefill_tokens == 0 and r.num_decode_tokens == KV_BATCH]
        truth = 1 - float(np.median(short)) / float(np.median(long_steps))
        att = d.account.attribution["engine-0"]
        assert att.separable and att.method == "timers", (att.method, att.reason)
        share = measured_kv_share(d)
        top = d.top.cause if d.top is not None else None
        outcomes.append(f"attempt {attempt + 1}: top cause {top}; K/V share of decode time: diagnosis {share:.3f}, "
                        f"controlled experiment {truth:.3f} (steps {np.median(short) * 1e3:.1f} ms at 64-token "
                        f"contexts, {np.median(long_steps) * 1e3:.1f} ms at {KV_PREFIX}+)" + _shares(d))
        print(outcomes[-1])
        if top == "decode-kv" and share is not None and abs(share - truth) <= REL * truth:
            return
    pytest.fail("the top cause is not decode-kv, or its K/V share is more than 15% from the controlled "
                "experiment's, in every attempt:\n" + "\n".join(outcomes))


STALL_STREAMS, STALL_TOKENS, STALL_PROMPT = 6, 40, 2000  # issue 38 (b): six streams, three 2000-token prompts


def _stall_arrivals(rng, with_long: bool) -> list[Arrival]:
    arrivals = [Arrival(f"stream-{i}", random_prompt(rng, 64), STALL_TOKENS, "stream", at_s=0.0)
                for i in range(STALL_STREAMS)]
    if with_long:
        arrivals += [Arrival(f"long-{k}", random_prompt(rng, STALL_PROMPT), 2, "long",
                             after_group_tokens=("stream", 6 + 10 * k)) for k in range(3)]
    return arrivals


def _streams_time(engine, arrivals) -> float:
    """The streams' summed E2E in this run, from the engine's own records."""
    n = len(engine.finished_requests)
    run_arrivals(engine, arrivals)
    return sum(m.e2e_s for m in list(engine.finished_requests)[n:] if m.request_id.startswith("stream"))


@contextlib.contextmanager
def _busy_neighbour():
    """A CPU-bound job sharing the two cores for as long as the block runs (a shared production host)."""
    job = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize("neighbour", [False, True], ids=["alone", "busy-neighbour"])
def test_stall(checkpoint, tmp_path, neighbour):
    """Issue 38 (b): an unchunked stall (prefill-first) with steady streams, alone and with a CPU-bound
    job sharing the cores. Top cause stall in both (steady decoding at the engine's pace is not a
    cause, however slow the busy machine makes it), and its avoidable time within 15% of the truth
    from a controlled rerun: the streams' summed E2E minus the same streams' in runs without the long
    prompts, before and after (their mean), on the same engine. The longest stall is checked against
    the raw records. Each attempt is judged alone at the fixed REL."""
    outcomes = []
    for attempt in range(ATTEMPTS):
        rng = np.random.default_rng(3 + attempt)
        reference = _engine(checkpoint, policy="prefill-first")  # the runs without the long prompts
        engine = _engine(checkpoint, policy="prefill-first")  # the diagnosed run, alone in its record
        path = tmp_path / f"stall{attempt}"
        with _busy_neighbour() if neighbour else contextlib.nullcontext():
            before = _streams_time(reference, _stall_arrivals(rng, False))
            with_long = _streams_time(engine, _stall_arrivals(rng, True))
            after = _streams_time(reference, _stall_arrivals(rng, False))
        engine.write_record(str(path))
        d = diagnose(path)
        avoidable = sum(a.avoidable["stall"] for a in d.account.requests if a.request_id.startswith("stream"))
        truth = with_long - (before + after) / 2
        top = d.top.cause if d.top is not None else None
        outcomes.append(f"attempt {attempt + 1}: top cause {top}; stall avoidable {avoidable:.2f} s, rerun truth "
                        f"{truth:.2f} s (streams {with_long:.2f} s with the long prompts, {before:.2f} / {after:.2f} s "
                        f"without)" + _shares(d))
        print(outcomes[-1])
        if top == "stall" and abs(avoidable - truth) <= REL * truth:
            break
    else:
        pytest.fail("the top cause is not stall, or its avoidable time is more than 15% from the rerun's, in every "
                    "attempt:\n" + "\n".join(outcomes))
    reqs = _raw(path, "requests.jsonl")
    longest_gap = max(b - a for r in reqs if r["request_id"].startswith("stream")
                      for a, b in zip(r["token_sent_ns"], r["token_sent_ns"][1:])) / 1e9
    print(f"longest stall: diagnosis {d.stalls.max_stall_s:.3f} s, records: longest stream gap {longest_gap:.3f} s")
    assert d.stalls.max_stall_s == pytest.approx(longest_gap, rel=REL)
    culprit = d.stalls.culprits[0]
    assert set(culprit.requests) <= {f"long-{k}" for k in range(3)} and len(culprit.streams) == STALL_STREAMS
    assert "--policy chunked" in d.finding("stall").change


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


def test_queue_and_stalls_both_rank_in_the_top_two(checkpoint, tmp_path):
    """Issue 38 (c): prefill-first with four seats, three streams decoding while three 1500-token
    prompts arrive among them (stalls) and a burst of eight short requests arrives mid-way (it
    waits for seats: a queue). Both causes must be in the top two of the avoidable ranking."""
    rng = np.random.default_rng(11)
    arrivals = [Arrival(f"stream-{i}", random_prompt(rng, 64), 48, "stream", at_s=0.0) for i in range(3)]
    arrivals += [Arrival(f"long-{k}", random_prompt(rng, 1500), 2, "long", after_group_tokens=("stream", 6 + 12 * k))
                 for k in range(3)]
    arrivals += [Arrival(f"burst-{i}", random_prompt(rng, 32), 16, "burst", after_group_tokens=("stream", 12))
                 for i in range(8)]
    d, _ = _run(_engine(checkpoint, policy="prefill-first", max_num_seqs=4), arrivals, tmp_path / "both")
    top2 = [f.cause for f in d.findings[:2]]
    print(_shares(d))
    assert set(top2) == {"queue", "stall"}, [(f.cause, f.avoidable_share) for f in d.findings]


def test_healthy_control_raises_no_false_alarm(checkpoint, tmp_path):
    """Issue 38 (d): four short requests, one at a time with room to spare: the time is the decode work
    itself at the engine's pace, so no cause may have avoidable time over 10% of the users' time, and
    the diagnosis says the run is healthy. Each arrives when the one before finished (spaced by 1.5 s,
    a request outlasted its gap on a loaded 2-core machine and the next one queued: 18% queue in a
    "healthy" run)."""
    from phaselab.analysis.findings import HEALTHY_SHARE

    rng = np.random.default_rng(5)
    arrivals: list[Arrival] = []
    for i in range(4):
        arrivals.append(Arrival(f"h{i}", random_prompt(rng, 32), 16, at_s=None if arrivals else 0.0,
                                after_finished=arrivals[-1].request_id if arrivals else None))
    d, _ = _run(_engine(checkpoint), arrivals, tmp_path / "healthy")
    print(_shares(d))
    assert all(f.avoidable_share <= HEALTHY_SHARE for f in d.findings), [(f.cause, f.avoidable_share)
                                                                          for f in d.findings]
    assert d.healthy and "Healthy" in (tmp_path / "healthy" / "diagnosis.md").read_text()
    # the raw time is the decode work, and it is kept beside the ranking
    assert max(d.account.shares, key=d.account.shares.get) in ("decode-step", "decode", "decode-kv")
    assert d.account.num_preemptions == 0
