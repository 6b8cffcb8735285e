"""Disaggregated serving: bookkeeping (pure), then prefill/decode workers on a two-node Ray cluster.

The Ray tests share one module-wide cluster of two nodes on this machine (ray.cluster_utils):
prefill workers are pinned to one node and decode workers to the other by custom resources, so
every KV transfer in this file crosses nodes. One fp32 deployment (2 prefill + 2 decode workers,
the checkpoint loaded once here and shared through the object store) serves the equivalence tests
first (routing policies pin 1P1D and 1P2D), then the failure tests kill its workers one by one;
they run in file order. References come from a colocated engine over the same checkpoint.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest

from phaselab.core.config import CacheConfig, SchedulerConfig
from phaselab.core.request import Request, RequestStatus
from phaselab.core.routing import (
    LeastOutstandingWork,
    RoundRobin,
    RoutingPolicy,
    WorkerLoad,
    make_routing_policy,
)
from phaselab.core.sampling_params import SamplingParams
from phaselab.core.scheduler import Scheduler
from phaselab.disagg.connector import KVLayout, KVLayoutMismatchError, handshake
from phaselab.errors import ConfigError
from tests._model_helpers import compare_greedy, long_text


# -- pure bookkeeping ------------------------------------------------------------------------------------
def _sched(num_blocks: int = 8, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32, max_num_seqs=max_num_seqs),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks))


def _step(sched: Scheduler, token: int = 7):
    from phaselab.core.outputs import StepResult

    plan = sched.schedule()
    result = StepResult(plan.iteration_id, {s.request_id: token for s in plan.scheduled if s.sample})
    deltas = sched.update(plan, result)
    sched.check_invariants()
    return plan, deltas


def test_prefill_only_request_parks_with_its_blocks_until_freed():
    sched = _sched()
    sched.add_request(Request("a", list(range(1, 7)), SamplingParams(max_tokens=5), prefill_only=True))
    sched.add_request(Request("b", list(range(1, 4)), SamplingParams(max_tokens=2)))
    plan, deltas = _step(sched)
    assert {d.request_id for d in deltas} == {"a", "b"}
    assert list(sched.parked) == ["a"] and [r.request_id for r in sched.running] == ["b"]
    a = sched.parked["a"]
    assert a.num_computed_tokens == 6 and a.num_tokens == 7  # the sampled token's K/V is not computed
    assert len(sched.kv_cache_manager.req_to_blocks["a"]) == 2
    for _ in range(3):  # parked: never scheduled again, never preempted
        plan, _ = _step(sched)
        assert "a" not in {s.request_id for s in plan.scheduled}
    assert sched.has_unfinished_requests() and not sched.has_schedulable_requests()
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    sched.check_invariants()
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0 and not sched.parked


def test_prefill_only_request_that_finishes_on_its_first_token_is_not_parked():
    sched = _sched()
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=1), prefill_only=True))
    _, deltas = _step(sched)
    assert deltas[0].finish_reason == "length" and not sched.parked
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0


def test_prefilled_request_is_admitted_in_decode_or_waits_for_blocks():
    sched = _sched(num_blocks=4, block_size=4)
    r = Request("d", list(range(1, 9)), SamplingParams(max_tokens=4))
    r.append_output_token(5)
    blocks = sched.add_prefilled_request(r)
    assert blocks is not None and len(blocks) == 2  # K/V of 8 tokens, 4 per block
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 8 and not r.is_prefill
    assert sched.prefix_cache_stats.num_queries == 0  # it did not look the cache up
    sched.check_invariants()
    # a second one needs 3 blocks (8 tokens + one of headroom... 9 tokens -> 3 blocks): only 2 are free
    r2 = Request("e", list(range(1, 9)), SamplingParams(max_tokens=4))
    r2.append_output_token(5)
    assert sched.add_prefilled_request(r2) is None
    assert r2.status == RequestStatus.WAITING and "e" not in sched.requests
    plan, deltas = _step(sched)  # the admitted one decodes: one token at position 8
    (s,) = plan.scheduled
    assert (s.request_id, s.start_position, s.token_ids, s.is_prefill) == ("d", 8, [5], False)
    assert deltas[0].new_token_ids == [7]
    while sched.has_unfinished_requests():
        _step(sched)
    assert sched.add_prefilled_request(r2) is not None  # blocks freed: admitted now
    sched.check_invariants()


def test_prefilled_request_preempted_on_the_decode_side_recomputes_and_continues():
    sched = _sched(num_blocks=5, block_size=4)
    for rid in ("a", "b"):
        r = Request(rid, list(range(1, 8)), SamplingParams(max_tokens=8))
        r.append_output_token(9)
        assert sched.add_prefilled_request(r) is not None  # 2 blocks each (7 tokens), 1 block left
    preempted, finished = [], {}
    while sched.has_unfinished_requests():
        plan, deltas = _step(sched)
        preempted += plan.preempted_request_ids
        finished |= {d.request_id: d.finish_reason for d in deltas if d.finish_reason}
    # b (admitted last) gave its blocks to a, recomputed prompt + outputs on resume, then went on
    assert preempted and set(preempted) == {"b"} and finished == {"a": "length", "b": "length"}
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0


def test_in_process_workers_move_kv_and_record_backpressure(tmp_path):
    """Two workers driven directly (no Ray), KV inline: the decode worker's cache holds one
    request at a time, so the second waits for blocks and its decode admission wait shows it."""
    import dataclasses

    from phaselab.engine_args import EngineArgs
    from phaselab.disagg import DisaggConfig
    from phaselab.disagg.messages import (
        AdmittedEvent,
        WorkerRequest,
        TokenEvent,
        TransferEvent,
        TransferSpec,
    )
    from phaselab.disagg.worker import DisaggWorker
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    config = tiny_hf_config()
    path = write_hf_dir(str(tmp_path / "tiny"), config, random_weights(config))
    args = EngineArgs(model=path, dtype="float32", kv_cache_memory="64KiB", kv_transport="inline", num_threads=1)
    cfg = DisaggConfig(poll_interval_s=0.01)
    prefill = DisaggWorker("prefill-0", "prefill", args, cfg)
    decode = DisaggWorker("decode-0", "decode", dataclasses.replace(args, kv_cache_memory="48KiB"), cfg)  # 6 blocks
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {"r0": list(range(10, 70)), "r1": list(range(80, 140))}  # 60 (+1) tokens: 4 of the 6 blocks each
    for rid, ids in prompts.items():
        prefill.add_request(WorkerRequest(rid, ids, params, time.monotonic_ns()))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    records, admitted, transfers = {}, {}, {}
    deadline = time.monotonic() + 60
    while len(records) < 2:
        assert time.monotonic() < deadline
        for worker in (prefill, decode):
            for ev in worker.poll(0.01).events:
                if isinstance(ev, TokenEvent):
                    tokens[ev.request_id] += ev.new_token_ids
                    if ev.kv is not None:
                        decode.admit(TransferSpec(ev.request_id, prompts[ev.request_id], list(tokens[ev.request_id]),
                                                  params, ev.kv, time.monotonic_ns()))
                    elif ev.finish_reason is not None:
                        records[ev.request_id] = ev.record
                elif isinstance(ev, AdmittedEvent):
                    admitted[ev.request_id] = ev.admitted_ns
                elif isinstance(ev, TransferEvent):
                    transfers[ev.request_id] = ev
    assert all(len(t) == 20 for t in tokens.values())
    first, second = sorted(prompts, key=lambda r: admitted[r])
    # the second waited for the first to finish and free its blocks: that wait is its admission wait
    assert admitted[second] > records[first].token_sampled_ns[-1] > transfers[second].end_ns
    # and waited longer than the first, which was admitted at the decode worker's next poll (up to a
    # 10 ms poll interval: a 10x ratio to it failed whenever that poll came late and the first's 20
    # tokens decoded fast, 20.7 against 7.9 ms)
    assert admitted[second] - transfers[second].end_ns > admitted[first] - transfers[first].end_ns
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    assert all(t.num_bytes == 4 * 16 * bytes_per_token for t in transfers.values())  # ceil(60 / 16) blocks
    for w in (prefill, decode):
        s = w.stats()
        assert (s.num_blocks_used, s.num_parked, s.num_staged) == (0, 0, 0)
        w.check_invariants()
        w.shutdown()
    # the same tokens as one engine alone
    from phaselab.engine.engine import LLMEngine
    from phaselab.llm import LLM

    ref = LLM.from_engine(LLMEngine(dataclasses.replace(args, kv_transport="ray-object-store")))
    outs = ref.generate(list(prompts.values()), params)
    assert [o.token_ids for o in outs] == [tokens["r0"], tokens["r1"]]


def test_in_process_workers_forget_every_request(tmp_path):
    """A worker holds per-request state only while the request is on it: after finished, sampled,
    one-token, aborted-in-prefill, aborted-mid-decode and aborted-before-transfer requests, neither
    worker holds an entry of any (its own counts, and the objects gc finds on the heap). A server
    soak grew one entry per dropped stream in the decode worker's attempt map before."""
    import dataclasses
    import gc

    from phaselab.engine_args import EngineArgs
    from phaselab.disagg import DisaggConfig
    from phaselab.disagg.messages import FailureEvent, WorkerRequest, TokenEvent, TransferSpec
    from phaselab.disagg.kv_handoff import KVLease, StagedKV
    from phaselab.disagg.worker import DisaggWorker, _Progress
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    config = tiny_hf_config()
    path = write_hf_dir(str(tmp_path / "tiny"), config, random_weights(config))
    args = EngineArgs(model=path, dtype="float32", kv_cache_memory="256KiB", kv_transport="inline", num_threads=1)
    cfg = DisaggConfig(poll_interval_s=0.01)
    prefill = DisaggWorker("prefill-0", "prefill", args, cfg)
    decode = DisaggWorker("decode-0", "decode", args, cfg)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plans = {  # request -> (params, what the "router" does to it)
        "done-greedy": (greedy, None), "done-sampled": (SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                                                                       ignore_eos=True), None),
        "one-token": (dataclasses.replace(greedy, max_tokens=1), None),
        "abort-prefill": (greedy, "prefill"), "abort-decode": (SamplingParams(temperature=0.8, max_tokens=200,
                                                                              ignore_eos=True), "decode"),
        "abort-transfer": (greedy, "transfer"),
    }
    prompts = {rid: list(range(10 + 3 * i, 30 + 3 * i)) for i, rid in enumerate(plans)}
    tokens: dict[str, list[int]] = {rid: [] for rid in plans}
    done: set[str] = set()

    def run(rids: list[str]) -> None:
        for rid in rids:
            prefill.add_request(WorkerRequest(rid, prompts[rid], plans[rid][0], time.monotonic_ns()))
            if plans[rid][1] == "prefill":
                prefill.abort([rid], 0)  # queued behind its add: aborted before it parks
                done.add(rid)
        deadline = time.monotonic() + 60
        while not done.issuperset(rids):
            assert time.monotonic() < deadline, (done, tokens)
            for worker in (prefill, decode):
                for ev in worker.poll(0.01).events:
                    assert not isinstance(ev, FailureEvent), ev
                    if not isinstance(ev, TokenEvent) or ev.request_id in done:
                        continue
                    rid = ev.request_id
                    tokens[rid] += ev.new_token_ids
                    if ev.kv is not None:
                        decode.admit(TransferSpec(rid, prompts[rid], list(tokens[rid]), plans[rid][0], ev.kv,
                                                  time.monotonic_ns(), sampler_state=ev.sampler_state))
                        if plans[rid][1] == "transfer":  # the router's abort: the decode side and the lease
                            decode.abort([rid], 0)
                            prefill.release_kv(rid, "aborted", 0)
                            done.add(rid)
                    elif ev.finish_reason is not None:
                        done.add(rid)
                    elif plans[rid][1] == "decode" and ev.worker == "decode-0":  # a dropped stream
                        decode.abort([rid], 0)
                        done.add(rid)

    run(list(plans))
    assert len(tokens["done-greedy"]) == len(tokens["done-sampled"]) == 8 and len(tokens["one-token"]) == 1
    # one more greedy request through both: the engines free a finished request's executor state
    # (its random generator) at their next step
    plans["flush"], prompts["flush"], tokens["flush"] = (greedy, None), list(range(5, 25)), []
    run(["flush"])
    deadline = time.monotonic() + 30
    while any(prefill.held().values()) or any(decode.held().values()):  # aborts land at the loops' next turn
        assert time.monotonic() < deadline, (prefill.held(), decode.held())
        time.sleep(0.02)
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, (_Progress, KVLease, StagedKV))] == []
    for w in (prefill, decode):
        assert w.stats().num_blocks_used == 0
        w.check_invariants()
        w.shutdown()


def test_routing_policies_are_pure_and_deterministic():
    loads = [WorkerLoad("p0", "prefill", 2, 900), WorkerLoad("p1", "prefill", 3, 100), WorkerLoad("p2", "prefill")]
    assert LeastOutstandingWork().pick(loads, 50) == "p2"
    loads[2].alive = False
    assert LeastOutstandingWork().pick(loads, 50) == "p1"
    rr = RoundRobin()
    assert [rr.pick(loads, 1) for _ in range(3)] == ["p0", "p1", "p0"]
    assert LeastOutstandingWork().pick([WorkerLoad("x", "decode", alive=False)], 1) is None
    with pytest.raises(ConfigError, match="least-outstanding"):
        make_routing_policy("random")


def test_handshake_refuses_a_layout_mismatch_naming_each_field():
    a = KVLayout("bfloat16", 16, 30, 3, 64)
    handshake(a, KVLayout("bfloat16", 16, 30, 3, 64))
    with pytest.raises(KVLayoutMismatchError, match=r"block_size: 16 on p vs 32 on d.*dtype|dtype.*block_size"):
        handshake(a, KVLayout("float32", 32, 30, 3, 64), "p", "d")
    assert a.bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_merged_prometheus_text_has_one_family_per_name():
    from prometheus_client.parser import text_string_to_metric_families

    from phaselab.disagg.disagg_metrics import merge_exposition
    from phaselab.obs.prometheus import EngineMetrics

    texts = [EngineMetrics(labels={"worker": w, "role": "decode"}).render() for w in ("d0", "d1")]
    merged = merge_exposition(texts).decode()
    assert merged.count("# TYPE phaselab_iterations_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    workers = {s.labels["worker"] for s in families["phaselab_iterations"].samples}
    assert workers == {"d0", "d1"}


# -- on Ray ------------------------------------------------------------------------------------------------
LENGTHS = [5, 9, 16, 17, 32, 33, 48, 60, 64, 100, 150, 200, 300, 420, 555, 700]  # block multiples included
FAULT_CONFIG = {"worker_timeout_s": 20.0, "transfer_timeout_s": 20.0, "kv_lease_timeout_s": 60.0,
                "request_timeout_s": 120.0, "decode_admission_timeout_s": 60.0}


class Prefer(RoutingPolicy):
    """Test policy: the least loaded live worker among `names`, else among all live ones."""

    name = "prefer"

    def __init__(self, *names: str) -> None:
        self.names = set(names)

    def pick(self, candidates, num_tokens):
        live = [w for w in candidates if w.alive]
        preferred = [w for w in live if w.name in self.names] or live
        return LeastOutstandingWork().pick(preferred, num_tokens)


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"prefill_node": 100}, "object_store_memory": 768 * 2**20,
        "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"decode_node": 100}, object_store_memory=768 * 2**20)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def checkpoint(bundled_path):
    import torch

    from phaselab.model.loader import load_checkpoint

    return load_checkpoint(bundled_path, torch.float32)


@pytest.fixture(scope="module")
def llm_fp32(checkpoint):
    """The colocated reference (shadows conftest's: same model and dtype, built from the shared checkpoint)."""
    from tests._model_helpers import make_llm

    return make_llm(checkpoint, dtype="float32", kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def disagg(cluster, checkpoint):
    from phaselab.engine_args import EngineArgs
    from phaselab.disagg import DisaggConfig
    from phaselab.disagg.router import DisaggEngine

    args = EngineArgs(dtype="float32", kv_cache_memory="256MiB", mode="disagg", prefill_workers=2, decode_workers=2,
                      prefill_threads=1, decode_threads=1)
    config = DisaggConfig(prefill_resources={"prefill_node": 1}, decode_resources={"decode_node": 1}, **FAULT_CONFIG)
    eng = DisaggEngine(args, config, checkpoint=checkpoint)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def mixed_prompts(checkpoint) -> list[list[int]]:
    ids = checkpoint.tokenizer.encode(long_text(30))
    return [ids[11 * i: 11 * i + n] for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def colocated_outputs(llm_fp32, mixed_prompts):
    return llm_fp32.generate(mixed_prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))


def _generate(eng, prompts, params):
    from phaselab.llm import LLM

    return LLM.from_engine(eng).generate(prompts, params)


def _assert_clean(eng, within_s: float = 10.0) -> None:
    """Every live worker, once the releases in flight have landed (router -> worker calls are
    asynchronous): nothing running, parked or staged, 0 blocks in use, invariants hold."""
    import ray

    deadline = time.monotonic() + within_s
    while True:
        stats = eng.worker_stats()
        busy = {n: s for n, s in stats.items()
                if (s.num_blocks_used, s.num_running, s.num_waiting, s.num_parked, s.num_staged) != (0, 0, 0, 0, 0)}
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not busy, busy
    for name in stats:
        ray.get(eng.workers[name].actor.check_invariants.remote(), timeout=30)


def _compare(outs, refs, prompts, llm_fp32) -> None:
    ties = []
    for out, ref, p in zip(outs, refs, prompts):
        assert out.finish_reason == ref.finish_reason, (out.request_id, out.outputs[0].error)
        tie = compare_greedy(out.token_ids, ref.token_ids, p, llm_fp32.engine.score)
        if tie:
            ties.append(tie)
        else:
            assert out.text == ref.text
    if ties:
        warnings.warn("; ".join(ties))


@pytest.mark.slow
def test_workers_span_two_nodes(disagg):
    nodes = {w.name: w.info.node_id for w in disagg.workers.values()}
    prefill_nodes = {nodes[n] for n in nodes if n.startswith("prefill")}
    decode_nodes = {nodes[n] for n in nodes if n.startswith("decode")}
    assert len(prefill_nodes) == 1 and len(decode_nodes) == 1 and prefill_nodes != decode_nodes
    assert all(w.clock_offset_ns == 0 for w in disagg.workers.values())  # one host, one monotonic clock
    settings = disagg.workers["decode-0"].info.run_config["machine"]
    assert settings["OMP_WAIT_POLICY"] == "PASSIVE" and settings["torch_num_threads"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("decode_workers, transport", [(("decode-0",), "ray-actor"),
                                                      (("decode-0", "decode-1"), "ray-object-store")],
                         ids=["1P1D-ray-actor", "1P2D-ray-object-store"])
def test_greedy_equals_colocated(disagg, mixed_prompts, colocated_outputs, llm_fp32, decode_workers, transport):
    import ray

    ray.get(disagg.workers["prefill-0"].actor.set_kv_transport.remote(transport), timeout=30)
    disagg.prefill_policy = Prefer("prefill-0")
    disagg.decode_policy = Prefer(*decode_workers)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    n_before = len(disagg.finished_requests)
    outs = _generate(disagg, mixed_prompts, params)
    _compare(outs, colocated_outputs, mixed_prompts, llm_fp32)
    records = disagg.finished_requests[n_before:]
    used = {m.decode_worker for m in records}
    assert used == set(decode_workers)
    assert {m.worker for m in records} == {"prefill-0"}
    # the phase record spans both workers: bytes at block granularity, TTFT tiled exactly
    bytes_per_token = llm_fp32.engine.model_config.kv_bytes_per_token(4)
    bs = 16
    for out, m in zip(outs, sorted(records, key=lambda m: int(m.request_id))):
        assert m.request_id == out.request_id and m.finish_reason == "length"
        assert m.kv_transfer_bytes == math.ceil(m.num_prompt_tokens / bs) * bs * bytes_per_token
        assert m.first_token_sampled_ns < m.kv_transfer_queued_ns <= m.kv_transfer_start_ns < m.kv_transfer_end_ns
        # transfer queue and wire are the decode worker's fetch queue and fetch, never overwritten; the
        # object store's copy-out at park time asks for the transfer before the fetch is queued
        if transport == "ray-object-store":  # the router hop to the decode worker lies between them
            assert m.kv_transfer_queued_ns < m.kv_transfer_start_ns
        assert m.kv_transfer_end_ns <= m.decode_admitted_ns < m.token_sampled_ns[1]
        assert sum(m.ttft_components_ns().values()) == m.first_token_sent_ns - m.arrived_ns
        assert m.ttft_s == pytest.approx(sum(m.ttft_components().values()), abs=1e-9)
        assert len(m.token_sampled_ns) == len(m.token_sent_ns) == len(m.token_iteration_ids) == 10
        assert m.prefill_chunks and m.decode_admission_wait_s >= 0 and m.transfer_s > 0
    _assert_clean(disagg)


@pytest.mark.slow
def test_seeded_sampling_continues_the_same_random_stream(disagg, mixed_prompts, llm_fp32):
    """The request's random generator travels with its KV: seeded samples equal colocated ones."""
    prompts = mixed_prompts[:3]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=12, ignore_eos=True)
              for i in range(3)]
    ref = llm_fp32.generate(prompts, params)
    outs = _generate(disagg, prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


@pytest.mark.slow
def test_record_metrics_and_trace(disagg, tmp_path):
    import json

    from phaselab.obs.rundir import read_run_dir
    from phaselab.obs.perfetto import validate_trace

    disagg.write_record(str(tmp_path))
    run = read_run_dir(str(tmp_path))
    assert run.config["mode"] == "disagg" and set(run.config["workers"]) == set(disagg.workers)
    assert {(r.worker, r.role) for r in run.iterations} >= {("prefill-0", "prefill"), ("decode-0", "decode"),
                                                          ("decode-1", "decode")}
    assert all(r.kv_transfer_bytes for r in run.requests)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert validate_trace(trace) == []
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"prefill-0 (prefill)", "decode-0 (decode)", "decode-1 (decode)"} <= names
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert len(flows) == 2 * len(run.requests)
    pids = {e["args"]["name"]: e["pid"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    starts = {e["pid"] for e in flows if e["ph"] == "s"}
    assert starts == {pids["prefill-0 (prefill)"]}  # every arrow leaves the prefill worker's track
    text = (tmp_path / "metrics.prom").read_text()
    for w in ("prefill-0", "decode-0", "decode-1"):
        assert f'phaselab_iterations_total{{role="{w.split("-")[0]}",worker="{w}"}}' in text
        assert f'phaselab_worker_busy_ratio{{role="{w.split("-")[0]}",worker="{w}"}}' in text
    assert f'phaselab_kv_transfer_bytes_count{{role="router",worker="router"}} {float(len(run.requests))}' in text
    busy = disagg.busy_fractions()
    assert 0 < busy["prefill-0"] < 1 and 0 < busy["decode-0"] < 1


# -- failures: each test kills one more worker of the shared deployment ---------------------------------------
def _drive(eng, done, timeout_s: float = 90.0) -> dict:
    """Step the router until done(outputs) holds; returns the latest output per request."""
    latest: dict = {}
    deadline = time.monotonic() + timeout_s
    while not done(latest):
        assert time.monotonic() < deadline, f"timed out; got {latest}"
        for out in eng.step():
            latest[out.request_id] = out
    return latest


def _worker_stats(eng, name: str):
    import ray

    return ray.get(eng.workers[name].actor.stats.remote(), timeout=30)


def _transfer_in_progress(eng, rid: str, worker: str) -> bool:
    """The decode worker took the request's transfer from its queue and has not finished it
    (with a fault delay set, it sleeps inside the fetch)."""
    r = eng.tracked(rid)
    if r is None or r.phase != "decode" or r.decode_worker != worker or r.metrics.kv_transfer_end_ns is not None:
        return False
    return _worker_stats(eng, worker).num_transfer_queue == 0


def _failures(eng) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(eng.router_metrics.render().decode()):
        for s in fam.samples:
            if s.name.endswith("_total"):
                key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()))
                out[key] = s.value
    return out


@pytest.mark.slow
def test_decode_death_with_a_spare_reroutes_or_reprefills(disagg, mixed_prompts, llm_fp32):
    """decode-0 dies with one request decoding on it and another mid-transfer: the transfer is
    re-routed to decode-1 (prefill-0 still holds that KV); the decoding one lost its KV and is
    prefilled again (prompt + tokens so far), then continues on decode-1. Both complete."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    p_decode, p_transfer = mixed_prompts[9], mixed_prompts[12]
    refs = llm_fp32.generate([p_decode, p_transfer], params)
    disagg.prefill_policy, disagg.decode_policy = Prefer("prefill-0"), Prefer("decode-0")
    before = _failures(disagg)
    disagg.add_request(p_decode, params, request_id="t-decode")
    _drive(disagg, lambda o: "t-decode" in o and len(o["t-decode"].token_ids) >= 4)
    disagg.workers["decode-0"].actor.set_fault_transfer_delay.remote(30.0)
    disagg.add_request(p_transfer, params, request_id="t-transfer")
    _drive(disagg, lambda _: _transfer_in_progress(disagg, "t-transfer", "decode-0"))
    disagg.kill_worker("decode-0")
    outs = _drive(disagg, lambda o: all(k in o and o[k].finished for k in ("t-decode", "t-transfer")))
    _compare([outs["t-decode"], outs["t-transfer"]], refs, [p_decode, p_transfer], llm_fp32)
    m_decode, m_transfer = outs["t-decode"].metrics, outs["t-transfer"].metrics
    assert m_decode.decode_worker == m_transfer.decode_worker == "decode-1"
    assert m_decode.recompute_chunks and not m_transfer.recompute_chunks  # only the decoding one recomputed
    after = _failures(disagg)
    assert after["phaselab_disagg_worker_failures_total[decode][decode-0]"] == 1
    assert after["phaselab_disagg_reroutes_total"] == before.get("phaselab_disagg_reroutes_total", 0) + 1
    assert after["phaselab_disagg_reprefills_total[decode_worker_died]"] == 1
    _assert_clean(disagg)


@pytest.mark.slow
def test_prefill_death_mid_prefill_reprefills_on_the_spare(disagg, llm_fp32):
    prompt = llm_fp32.get_tokenizer().encode(long_text(20))[:1200]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = llm_fp32.generate([prompt], params)[0]
    disagg.prefill_policy = Prefer("prefill-0")
    disagg.add_request(prompt, params, request_id="t-prefill")
    _drive(disagg, lambda _: _worker_stats(disagg, "prefill-0").num_running == 1)
    disagg.kill_worker("prefill-0")
    out = _drive(disagg, lambda o: "t-prefill" in o and o["t-prefill"].finished)["t-prefill"]
    assert out.finish_reason == "length"
    _compare([out], [ref], [prompt], llm_fp32)
    assert out.metrics.worker == "prefill-1" and not out.metrics.recompute_chunks
    assert _failures(disagg)["phaselab_disagg_reprefills_total[prefill_worker_died]"] == 1
    _assert_clean(disagg)


@pytest.mark.slow
def test_last_decode_death_mid_transfer_and_mid_decode_is_a_clear_error(disagg, mixed_prompts):
    """decode-1 is the last decode worker: one request decodes on it, another is mid-transfer."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    disagg.add_request(mixed_prompts[3], params, request_id="t-last-decode")
    _drive(disagg, lambda o: "t-last-decode" in o and len(o["t-last-decode"].token_ids) >= 3)
    disagg.workers["decode-1"].actor.set_fault_transfer_delay.remote(30.0)
    disagg.add_request(mixed_prompts[4], params, request_id="t-last-transfer")
    _drive(disagg, lambda _: _transfer_in_progress(disagg, "t-last-transfer", "decode-1"))
    killed = time.monotonic()
    disagg.kill_worker("decode-1")
    outs = _drive(disagg, lambda o: all(k in o and o[k].finished for k in ("t-last-decode", "t-last-transfer")))
    assert time.monotonic() - killed < FAULT_CONFIG["worker_timeout_s"]  # well within every configured bound
    for rid in ("t-last-decode", "t-last-transfer"):
        out = outs[rid]
        assert out.finish_reason == "error" and "no decode worker is alive" in out.outputs[0].error
        assert "decode-1" in out.outputs[0].error and out.token_ids  # the first token(s) were streamed
    assert len(outs["t-last-decode"].token_ids) >= 3
    assert _failures(disagg)["phaselab_disagg_request_failures_total[no_decode_worker]"] == 2
    _assert_clean(disagg)  # prefill-1 freed the lease of the request that never reached a decode worker


@pytest.mark.slow
def test_last_prefill_death_mid_prefill_is_a_clear_error(disagg, llm_fp32):
    prompt = llm_fp32.get_tokenizer().encode(long_text(20))[:1200]
    disagg.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), request_id="t-last-prefill")
    _drive(disagg, lambda _: _worker_stats(disagg, "prefill-1").num_running == 1)
    killed = time.monotonic()
    disagg.kill_worker("prefill-1")
    out = _drive(disagg, lambda o: "t-last-prefill" in o and o["t-last-prefill"].finished)["t-last-prefill"]
    assert time.monotonic() - killed < FAULT_CONFIG["worker_timeout_s"]
    assert out.finish_reason == "error" and "no prefill worker is alive" in out.outputs[0].error
    assert not out.token_ids
    f = _failures(disagg)
    assert f["phaselab_disagg_request_failures_total[no_prefill_worker]"] == 1
    assert sum(v for k, v in f.items() if k.startswith("phaselab_disagg_worker_failures")) == 4
    text = disagg.render_metrics().decode()
    assert "phaselab_disagg_worker_failures_total" in text and "phaselab_disagg_reroutes_total 1.0" in text
    # no worker left: a new request fails at once, clearly
    rid = disagg.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    out = _drive(disagg, lambda o: rid in o and o[rid].finished, timeout_s=10)[rid]
    assert out.finish_reason == "error" and "no prefill worker is alive" in out.outputs[0].error


@pytest.mark.slow
def test_layout_mismatch_is_refused_at_handshake(cluster, tmp_path):
    from phaselab.engine_args import EngineArgs
    from phaselab.disagg.router import DisaggEngine
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    config = tiny_hf_config()
    path = write_hf_dir(str(tmp_path / "tiny"), config, random_weights(config))
    args = EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB", mode="disagg", prefill_threads=1,
                      decode_threads=1)
    with pytest.raises(KVLayoutMismatchError) as e:
        DisaggEngine(args, decode_overrides={"block_size": 32, "dtype": "bfloat16"})
    msg = str(e.value)
    assert "prefill-0" in msg and "decode-0" in msg and "block_size: 16" in msg and "dtype: 'float32'" in msg


@pytest.mark.slow
def test_offline_llm_mode_disagg_matches_colocated(cluster, tmp_path):
    from phaselab import LLM
    from tests._loader_helpers import random_weights, tiny_hf_config, write_hf_dir

    config = tiny_hf_config()
    path = write_hf_dir(str(tmp_path / "tiny"), config, random_weights(config, seed=3))
    options = {"model": path, "dtype": "float32", "kv_cache_memory": "4MiB"}
    prompts = [list(range(5, 40)), list(range(60, 77))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(**options).generate(prompts, params)
    llm = LLM(**options, mode="disagg", prefill_workers=1, decode_workers=1, prefill_threads=1, decode_threads=1)
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(o.metrics.kv_transfer_bytes and o.metrics.decode_worker == "decode-0" for o in outs)


def test_cli_builds_disagg_options():
    from phaselab.cli import _engine_args, build_parser

    ns = build_parser().parse_args(["generate", "hi", "--mode", "disagg", "--prefill-workers", "2",
                                    "--decode-workers", "3", "--decode-threads", "1", "--ray-address", "10.0.0.1:6379",
                                    "--kv-transport", "ray-actor"])
    args = _engine_args(ns)
    assert (args.mode, args.prefill_workers, args.decode_workers, args.decode_threads, args.prefill_threads) == (
        "disagg", 2, 3, 1, None)
    assert args.ray_address == "10.0.0.1:6379" and args.kv_transport == "ray-actor"
    with pytest.raises(ConfigError, match="mode"):
        type(args)(mode="split")
