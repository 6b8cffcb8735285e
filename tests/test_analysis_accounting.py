"""The time accounting and the diagnosis on synthetic runs: records built by a tiny deterministic
engine model (below), so every number is known exactly. Real engine runs are in
test_analysis_causes.py.

The model stamps like the engine: an iteration spans [start, end]; the chunks it carries start and
end with it; tokens are sampled and sent at its end; a request arrives, is tokenized and queued at
once (token-id prompts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from phaselab.analysis.accounting import CAUSES, account_run
from phaselab.analysis.diagnose import diagnose, diagnosis_text, write_diagnosis
from phaselab.cost.formulas import ModeledCost
from phaselab.core.timing import IterationRecord, PrefillChunk, RequestMetrics, ScheduledChunk
from phaselab.obs.rundir import RunData, read_run_dir, write_run_dir

MS = 1_000_000
KV_BYTES_PER_TOKEN = 23_040  # SmolLM2-135M, bf16
WEIGHT_BYTES = 269_000_000


@dataclass
class Req:
    request_id: str
    arrive_ms: float
    prompt: int
    output: int


@dataclass
class _State:
    req: Req
    m: RequestMetrics
    computed: int = 0
    produced: int = 0
    context: int = 0


@dataclass
class SynthEngine:
    """A deterministic stand-in for the engine: costs in ms, a FIFO scheduler with the two policies."""

    policy: str = "chunked"  # | "prefill-first"
    budget: int = 512
    max_num_seqs: int = 64
    step_ms: float = 10.0  # fixed cost of an iteration
    prefill_ms_per_token: float = 1.0
    decode_ms_per_token: float = 0.5  # per decode token in the batch
    decode_ms_per_kv_token: float = 0.0  # per context token read by a decode
    worker: str = "engine-0"
    role: str = "colocated"
    iterations: list[IterationRecord] = field(default_factory=list)

    def run(self, reqs: list[Req]) -> list[RequestMetrics]:
        pending = sorted(reqs, key=lambda r: r.arrive_ms)
        waiting: list[_State] = []
        running: list[_State] = []
        done: list[RequestMetrics] = []
        t = 0
        it_id = 0
        while pending or waiting or running:
            while pending and pending[0].arrive_ms * MS <= t:
                r = pending.pop(0)
                a = int(r.arrive_ms * MS)
                m = RequestMetrics(arrived_ns=a, tokenized_ns=a, queued_ns=a, request_id=r.request_id,
                                   num_prompt_tokens=r.prompt, worker=self.worker)
                waiting.append(_State(r, m))
            plan: list[tuple[_State, int, bool]] = []
            decodes = [s for s in running if s.computed >= s.req.prompt]
            if self.policy == "prefill-first" and waiting:
                while waiting and len(running) < self.max_num_seqs:
                    s = waiting.pop(0)
                    running.append(s)
                    plan.append((s, s.req.prompt, True))
            else:
                plan = [(s, 1, False) for s in decodes]
                left = self.budget - len(plan)
                partial = [s for s in running if s.computed < s.req.prompt]
                for s in partial:
                    n = min(left, s.req.prompt - s.computed)
                    if n > 0:
                        plan.append((s, n, True))
                        left -= n
                while waiting and left > 0 and len(running) < self.max_num_seqs:
                    s = waiting.pop(0)
                    running.append(s)
                    n = min(left, s.req.prompt)
                    plan.append((s, n, True))
                    left -= n
            if not plan:
                t = int(pending[0].arrive_ms * MS)
                continue
            pf = sum(n for _, n, p in plan if p)
            dc = sum(n for _, n, p in plan if not p)
            kv_read = sum(s.context + 1 for s, n, p in plan if not p)
            dur = self.step_ms + self.prefill_ms_per_token * pf + self.decode_ms_per_token * dc \
                + self.decode_ms_per_kv_token * kv_read
            start, end = t, t + int(dur * MS)
            chunks = []
            for s, n, p in plan:
                if s.m.first_scheduled_ns is None:
                    s.m.first_scheduled_ns = start
                if p:
                    s.m.prefill_chunks.append(PrefillChunk(it_id, start, end, n))
                    s.computed += n
                s.context += n
                chunks.append(ScheduledChunk(s.req.request_id, n, p, s.context))
                if s.computed >= s.req.prompt:  # samples a token
                    s.produced += 1
                    if s.m.first_token_sampled_ns is None:
                        s.m.first_token_sampled_ns = end
                    s.m.token_sampled_ns.append(end)
                    s.m.token_sent_ns.append(end)
                    s.m.token_iteration_ids.append(it_id)
            self.iterations.append(IterationRecord(
                iteration_id=it_id, worker=self.worker, role=self.role, start_ns=start, end_ns=end,
                forward_ns=end - start, num_prefill_tokens=pf, num_decode_tokens=dc, chunks=chunks,
                num_blocks_used=sum(s.context for s in running) // 16, num_blocks_free=1000,
                num_running=len(running), num_waiting=len(waiting),
                modeled=ModeledCost(WEIGHT_BYTES, kv_read * KV_BYTES_PER_TOKEN, (pf + dc) * KV_BYTES_PER_TOKEN,
                                    (pf + dc) * 270_000_000, 0)))
            for s in list(running):
                if s.produced >= s.req.output:
                    s.m.finished_ns = end
                    s.m.finish_reason = "length"
                    s.m.num_output_tokens = s.produced
                    running.remove(s)
                    done.append(s.m)
            t = end
            it_id += 1
        return done

    def run_data(self, reqs: list[Req]) -> RunData:
        done = self.run(reqs)
        config = {"scheduler": {"policy": self.policy, "max_num_batched_tokens": self.budget,
                                "max_num_seqs": self.max_num_seqs}, "dtype": "bfloat16"}
        return RunData(done, self.iterations, config)


def stall_run() -> RunData:
    reqs = [Req(f"stream-{i}", 0, 32, 40) for i in range(4)] + [Req("long-0", 100, 800, 2)]
    return SynthEngine(policy="prefill-first", budget=4096).run_data(reqs)


def disagg_run(bandwidth: float = 50e6, num: int = 3) -> RunData:
    """Sequential requests over a prefill worker p0 and a decode worker d0 with a KV transfer of
    known bandwidth between them."""
    reqs, its = [], []
    t = 0
    pid = did = 0
    for i in range(num):
        prompt, out = 256, 5
        m = RequestMetrics(arrived_ns=t, tokenized_ns=t, queued_ns=t, first_scheduled_ns=t, request_id=f"r{i}",
                           num_prompt_tokens=prompt, num_output_tokens=out, worker="p0", decode_worker="d0")
        end = t + 200 * MS
        m.prefill_chunks = [PrefillChunk(pid, t, end, prompt)]
        its.append(IterationRecord(pid, "p0", "prefill", t, end, num_prefill_tokens=prompt,
                                   chunks=[ScheduledChunk(m.request_id, prompt, True, prompt)],
                                   modeled=ModeledCost(WEIGHT_BYTES, 0, prompt * KV_BYTES_PER_TOKEN)))
        m.first_token_sampled_ns = end
        m.token_sampled_ns, m.token_sent_ns, m.token_iteration_ids = [end], [end + MS], [pid]
        pid += 1
        nbytes = 16 * 16 * KV_BYTES_PER_TOKEN
        m.kv_transfer_queued_ns = end + 2 * MS
        m.kv_transfer_start_ns = end + 5 * MS
        m.kv_transfer_end_ns = m.kv_transfer_start_ns + int(nbytes / bandwidth * 1e9)
        m.kv_transfer_bytes = nbytes
        m.decode_admitted_ns = m.kv_transfer_end_ns + 3 * MS
        t2 = m.decode_admitted_ns
        for k in range(1, out):
            e = t2 + 20 * MS
            its.append(IterationRecord(did, "d0", "decode", t2, e, num_decode_tokens=1,
                                       chunks=[ScheduledChunk(m.request_id, 1, False, prompt + k)],
                                       modeled=ModeledCost(WEIGHT_BYTES, (prompt + k) * KV_BYTES_PER_TOKEN,
                                                           KV_BYTES_PER_TOKEN)))
            m.token_sampled_ns.append(e)
            m.token_sent_ns.append(e + MS)
            m.token_iteration_ids.append(did)
            did += 1
            t2 = e
        m.finished_ns = m.token_sent_ns[-1]
        m.finish_reason = "length"
        reqs.append(m)
        t = m.finished_ns + 10 * MS
    return RunData(reqs, its, {"mode": "disagg", "dtype": "bfloat16"})


# -- the partition ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [stall_run, disagg_run,
                                  lambda: SynthEngine(max_num_seqs=2).run_data(
                                      [Req(f"q{i}", i * 5, 64, 6) for i in range(10)])])
def test_causes_tile_every_request_e2e(make) -> None:
    run = make()
    acc = account_run(run.requests, run.iterations)
    for a in acc.requests:
        assert set(a.parts) == set(CAUSES)
        assert all(v >= -1e-12 for v in a.parts.values()), a.parts
        assert sum(a.parts.values()) == pytest.approx(a.e2e_s, abs=1e-9)
    assert sum(acc.shares.values()) == pytest.approx(1.0)


def test_stall_is_the_prefill_iteration_and_names_it() -> None:
    run = stall_run()
    d = diagnose(run)
    assert d.top is not None and d.top.cause == "stall"
    long_it = next(r for r in run.iterations if any(c.request_id == "long-0" for c in r.chunks))
    after = next(r for r in run.iterations if r.iteration_id == long_it.iteration_id + 1)
    # each stream waited the long prefill's iteration, then its own next decode step
    assert d.top.key.value == pytest.approx(long_it.duration_s + after.duration_s, rel=1e-6)
    for g in d.stalls.gaps:
        assert g.culprits == {"long-0": 800}
        assert g.excess_s == pytest.approx(long_it.duration_s, rel=1e-6)
    assert d.stalls.culprits[0].iteration_id == long_it.iteration_id
    assert len(d.stalls.culprits[0].streams) == 4
    assert f"iteration {long_it.iteration_id}" in " ".join(d.top.evidence)
    assert "--policy chunked" in d.top.change


def test_chunked_interference_is_smaller_than_prefill_first() -> None:
    reqs = [Req(f"stream-{i}", 0, 32, 60) for i in range(4)] + [Req("long-0", 100, 800, 2)]
    pf = diagnose(SynthEngine(policy="prefill-first", budget=4096).run_data(reqs))
    ch = diagnose(SynthEngine(policy="chunked", budget=128).run_data(reqs))
    assert ch.summary.max_stall_s < pf.summary.max_stall_s / 3
    assert ch.prefill.mean_chunks is not None and ch.prefill.mean_chunks > 1  # the long prompt was chunked


def test_transfer_bound_synthetic_run() -> None:
    run = disagg_run(bandwidth=20e6)
    d = diagnose(run)
    assert d.top is not None and d.top.cause == "transfer"
    truth = sum(m.kv_transfer_bytes for m in run.requests) / sum(
        (m.kv_transfer_end_ns - m.kv_transfer_start_ns) / 1e9 for m in run.requests)
    assert d.top.key.value == pytest.approx(truth, rel=0.15)
    assert d.top.key.value == pytest.approx(20e6, rel=0.01)  # the bandwidth the records were built with
    assert d.disagg is not None and {p.role for p in d.disagg.pools} == {"prefill", "decode"}
    assert d.disagg.share_of_first_gap is not None and d.disagg.share_of_first_gap > 0.5


def test_queue_bound_synthetic_run_is_growing() -> None:
    run = SynthEngine(max_num_seqs=2, prefill_ms_per_token=0.5).run_data(
        [Req(f"q{i}", i * 20, 64, 12) for i in range(16)])
    d = diagnose(run)
    assert d.top is not None and d.top.cause == "queue"
    truth = sum((m.first_scheduled_ns - m.queued_ns) for m in run.requests) / sum(
        (m.token_sent_ns[0] - m.arrived_ns) for m in run.requests)
    assert d.top.key.value == pytest.approx(truth, rel=0.15)
    assert d.queue is not None and d.queue.growing
    assert "max-num-seqs" in d.top.change


def test_decode_kv_synthetic_run() -> None:
    reqs = [Req(f"d{i}", 0, 600, 40) for i in range(24)]
    engine = SynthEngine(budget=16384, prefill_ms_per_token=0.05, decode_ms_per_kv_token=0.02)
    run = engine.run_data(reqs)
    d = diagnose(run)
    assert d.top is not None and d.top.cause == "decode-kv"
    # truth: the time the engine model spent on K/V reads (its per-history-token cost), not bytes
    steps = [r for r in run.iterations if r.num_prefill_tokens == 0]
    kv_ms = sum(engine.decode_ms_per_kv_token * sum(c.context_len for c in r.chunks) for r in steps)
    truth = kv_ms * MS / 1e9 / sum(r.duration_s for r in steps)
    assert d.top.key.value == pytest.approx(truth, rel=0.15)
    att = d.account.attribution["engine-0"]
    assert att.per_kv_token_s == pytest.approx(engine.decode_ms_per_kv_token / 1e3, rel=0.05)
    # the batch never changed: the per-sequence cost is folded into the per-step one
    assert att.per_step_s == pytest.approx((engine.step_ms + 24 * engine.decode_ms_per_token) / 1e3, rel=0.05)


def test_decode_attribution_separates_batch_and_history_and_says_when_it_cannot() -> None:
    """Requests of different lengths and arrival times: batch and history vary independently, so
    the fit recovers the engine model's three costs; a run with one fixed batch and history cannot
    be split and says so."""
    reqs = [Req(f"v{i}", i * 150, 100 + 300 * (i % 5), 10 + 9 * (i % 4)) for i in range(30)]
    engine = SynthEngine(budget=16384, prefill_ms_per_token=0.05, decode_ms_per_kv_token=0.004)
    d = diagnose(engine.run_data(reqs))
    att = d.account.attribution["engine-0"]
    assert att.separable, att.reason
    assert att.per_step_s == pytest.approx(engine.step_ms / 1e3, rel=0.05)
    assert att.per_seq_s == pytest.approx(engine.decode_ms_per_token / 1e3, rel=0.05)
    assert att.per_kv_token_s == pytest.approx(engine.decode_ms_per_kv_token / 1e3, rel=0.05)
    flat = SynthEngine(decode_ms_per_kv_token=0.004).run_data([Req("one", 0, 8, 4)])
    d = diagnose(flat)
    assert not d.account.decode_split and d.account.totals["decode-kv"] == 0 and d.account.totals["decode"] > 0
    assert any("not separable" in e for f in d.findings for e in f.evidence)


# -- TTFT shares ------------------------------------------------------------------------------------------------
def test_ttft_shares_sum_to_100_and_match_the_phase_record() -> None:
    for run in (stall_run(), disagg_run()):
        d = diagnose(run)
        t = d.ttft
        assert t is not None
        assert sum(t.share(k) for k in t.components) == pytest.approx(1.0, abs=1e-9)
        by_id = {m.request_id: m for m in run.requests}
        for p, (rid, ttft, parts) in t.at.items():
            m = by_id[rid]
            assert ttft == pytest.approx(m.ttft_s)
            assert parts == pytest.approx(m.ttft_components())
            assert sum(t.shares_at(p).values()) == pytest.approx(1.0, abs=1e-9)
        # the aggregate is the sum of every request's phases
        for k in t.components:
            assert t.total_s[k] == pytest.approx(sum(m.ttft_components()[k] for m in run.requests))


# -- outputs ----------------------------------------------------------------------------------------------------
def test_diagnosis_files_and_text(tmp_path) -> None:
    run = stall_run()
    write_run_dir(tmp_path / "run", run.requests, run.iterations, run.config)
    d = diagnose(tmp_path / "run")
    files = write_diagnosis(d, tmp_path / "run")
    text = diagnosis_text(d)
    assert "Ranked causes" in text and "stall" in text and "worked if" in text
    md = files["md"].read_text()
    assert "| # | cause |" in md and "**Change:**" in md and "**Worked if:**" in md
    page = files["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and "<table" in page and "http" not in page.split("<body>")[0]
    data = json.loads(files["json"].read_text())
    assert data["ranking"][0]["cause"] == "stall"
    assert sum(data["time_shares"].values()) == pytest.approx(1.0)


def test_diagnose_cli_on_a_run_directory(tmp_path) -> None:
    run = disagg_run()
    write_run_dir(tmp_path / "run", run.requests, run.iterations, run.config)
    from phaselab.analysis.diagnose_cli import main

    assert main(["diagnose", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "diagnosis.html").is_file() and (tmp_path / "run" / "diagnosis.md").is_file()
    assert main(["diagnose", str(tmp_path / "nothing-here")]) == 2


def test_roofline_of_another_cpu_is_labeled_and_bounds_nothing(tmp_path, monkeypatch) -> None:
    """A roofline file names the CPU it was measured on; a run made on another CPU is judged with it
    only for scale, labeled "another CPU's", and its bandwidth is no floor on the run's fit."""
    import phaselab.analysis.diagnose as diagnose_module

    floors = []  # the bandwidth each diagnosis bounds its decode fit with (None: unbounded)
    real = diagnose_module.account_run
    monkeypatch.setattr(diagnose_module, "account_run", lambda *a: floors.append(a[3]) or real(*a))
    f = tmp_path / "roofline.json"
    isa = ["avx2", "avx512f"]
    f.write_text(json.dumps({"bandwidth": {"read_bytes_per_s": 12.5e9}, "machine": {"cpu_model": "CPU A", "isa": isa},
                             "bfloat16": {"gemm_flops_per_s": {"layer_mix": {"512": 3e11}}}}))
    same, other = stall_run(), stall_run()
    same.config["machine"] = {"cpu_model": "CPU A", "isa": list(reversed(isa))}
    other.config["machine"] = {"cpu_model": "CPU B", "isa": isa}
    d = diagnose(same, roofline=str(f))
    assert d.ceilings.kind == "measured" and d.ceilings.measured and floors == [12.5e9]
    d = diagnose(other, roofline=str(f))
    assert d.ceilings.kind == "foreign" and not d.ceilings.measured and floors == [12.5e9, None]
    assert d.ceilings.bandwidth_bytes_per_s == 12.5e9  # still the scale of the figures
    note = next(n for n in d.notes if n.startswith("machine ceilings"))
    assert "another CPU's" in note and "CPU A" in note and "CPU B" in note and "benchmarks/roofline.py" in note
    assert "another CPU's" in diagnosis_text(d)


def test_roofline_file_is_used_when_given(tmp_path, monkeypatch) -> None:
    f = tmp_path / "roofline.json"
    f.write_text(json.dumps({"bandwidth": {"read_bytes_per_s": 12.5e9},
                             "bfloat16": {"gemm_flops_per_s": {"layer_mix": {"512": 3e11}}}}))
    d = diagnose(stall_run(), roofline=str(f))
    assert d.ceilings.bandwidth_bytes_per_s == 12.5e9 and d.ceilings.measured
    assert any("measured" in n for n in d.notes)
    # without a path: $PHASELAB_ROOFLINE first, then ./benchmarks/results, then the source checkout's
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PHASELAB_ROOFLINE", str(f))
    d = diagnose(stall_run(), roofline=None)
    assert (d.ceilings.source, d.ceilings.gemm_flops_per_s) == (str(f), 3e11)
    monkeypatch.delenv("PHASELAB_ROOFLINE")
    from phaselab.analysis import machine
    checkout = Path(machine.__file__).resolve().parents[2] / machine.ROOFLINE_RELATIVE
    d = diagnose(stall_run(), roofline=None)
    assert d.ceilings.measured == checkout.is_file()
    assert d.ceilings.source == (str(checkout) if checkout.is_file() else "assumed default")
    with pytest.raises(FileNotFoundError, match="benchmarks/roofline.py"):
        diagnose(stall_run(), roofline=str(tmp_path / "missing.json"))


# -- a client run against another server, with vLLM's metric names ----------------------------------------------
VLLM_BEFORE = """# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{model_name="m"} 0.0
vllm:request_queue_time_seconds_count{model_name="m"} 0.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_sum{model_name="m"} 0.0
vllm:request_prefill_time_seconds_count{model_name="m"} 0.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 0.0
"""


def _vllm_after(queue_sum: float, prefill_sum: float, n: int) -> str:
    return (VLLM_BEFORE.replace('_sum{model_name="m"} 0.0\nvllm:request_queue_time_seconds_count{model_name="m"} 0.0',
                                f'_sum{{model_name="m"}} {queue_sum}\nvllm:request_queue_time_seconds_count'
                                f'{{model_name="m"}} {n}')
            .replace('vllm:request_prefill_time_seconds_sum{model_name="m"} 0.0\n'
                     'vllm:request_prefill_time_seconds_count{model_name="m"} 0.0',
                     f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {prefill_sum}\n'
                     f'vllm:request_prefill_time_seconds_count{{model_name="m"}} {n}')
            + "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 7.0\n")


def test_client_run_with_vllm_metrics(tmp_path) -> None:
    """A bench client run directory against a server that exports only vLLM's names: the queue is 80%
    of the client's TTFT there, so queue ranks first, and the diagnosis names the metrics it used."""
    root = tmp_path / "client"
    n = 8
    lines = []
    for i in range(n):
        sent = i * 100 * MS
        first = sent + 1000 * MS
        toks = [first + k * 20 * MS for k in range(10)]
        m = {"record": "request", "request_id": f"c{i}", "arrived_ns": sent, "token_sent_ns": toks,
             "finished_ns": toks[-1], "finish_reason": "length", "num_prompt_tokens": 100 + 50 * i,
             "num_output_tokens": 10, "worker": "client", "source": "client", "status": "ok", "warmup": False}
        lines.append(json.dumps(m))
    root.mkdir()
    (root / "requests.jsonl").write_text("\n".join(lines) + "\n")
    (root / "iterations.jsonl").write_text("")
    (root / "config.json").write_text(json.dumps({"format": "phaselab-run", "version": 1, "source": "client",
                                                  "target": {"base_url": "http://vllm:8000"}}))
    (root / "server_metrics_before.prom").write_text(VLLM_BEFORE)
    (root / "server_metrics_after.prom").write_text(_vllm_after(0.8 * n, 0.15 * n, n))
    d = diagnose(root)
    assert d.source == "client"
    assert d.top is not None and d.top.cause == "queue"
    assert d.top.key.value == pytest.approx(0.8, rel=0.02)  # 0.8 s of each 1.0 s TTFT
    assert d.external["metrics"]["queue"]["metric"] == "vllm:request_queue_time_seconds"
    assert d.external["metrics"]["prefill"]["metric"] == "vllm:request_prefill_time_seconds"
    text = diagnosis_text(d)
    assert "vllm:request_queue_time_seconds" in text
    acc = d.account
    assert sum(acc.totals.values()) == pytest.approx(acc.total_s)


# -- the no-torch rule ------------------------------------------------------------------------------------------
def test_analysis_imports_no_torch() -> None:
    code = ("import sys\n"
            "import phaselab.analysis, phaselab.analysis.diagnose, phaselab.analysis.accounting, "
            "phaselab.analysis.timeline, phaselab.experiments.compare_report, phaselab.analysis.external, "
            "phaselab.analysis.diagnose_cli, phaselab.analysis.advice, phaselab.analysis.predict, phaselab.experiments.diagnose_verify, "
            "phaselab.analysis.attribution, phaselab.analysis.kvcapacity, phaselab.sim.replay, phaselab.sim.loop, "
            "phaselab.experiments.compare, phaselab.experiments.compare_sim, "
            "phaselab.experiments.compare_cli, phaselab.workload.driver\n"
            "from phaselab.analysis.diagnose_cli import main\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or m == 'ray')\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_diagnose_reads_the_run_directory_round_trip(tmp_path) -> None:
    run = stall_run()
    write_run_dir(tmp_path / "r", run.requests, run.iterations, run.config)
    a = diagnose(run)
    b = diagnose(read_run_dir(tmp_path / "r"))
    assert [f.cause for f in a.findings] == [f.cause for f in b.findings]
    assert a.top.key.value == pytest.approx(b.top.key.value)
