"""Reading a run's workload back from its records (workload/rerun.py), as `diagnose --verify` reruns
it and its prediction simulates it: closed-loop requests released by the end that released them,
timed ones at their offsets, prefix-cache hits on one shared prefix. The truth is the workload the
run was given, not the reading of it."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

from phaselab.obs.rundir import read_run_dir
from phaselab.cost.catalog import get_hardware, get_model
from phaselab.sim.deployment import Deployment, RoleConfig
from phaselab.sim.loop import simulate
from phaselab.sim.replay import replay_inputs
from phaselab.sim.workload import SimRequest
from phaselab.workload.driver import Arrival, run_arrivals
from phaselab.workload.rerun import recorded_workload

MODEL = get_model("smollm2-135m")  # steps of milliseconds on the "cpu" entry: ends a step apart are not ties


def _workload() -> list[SimRequest]:
    """a0 fills the cache with a 320-token prefix; a1 and a2 end in the same step and release c0
    together; b0 (after a0) and b1 (after b0) reuse a0's prefix; r arrives on its own after an idle
    idle second or more."""
    return [SimRequest("a0", 400, 9, index=0, prefix_group=0, prefix_len=320),
            SimRequest("a1", 64, 3, index=1), SimRequest("a2", 64, 3, index=2),
            SimRequest("b0", 350, 4, index=3, prefix_group=0, prefix_len=320, after_finished="a0"),
            SimRequest("b1", 330, 2, index=4, prefix_group=0, prefix_len=320, after_finished="b0"),
            SimRequest("c0", 80, 3, index=5, after_finished=("a1", "a2")),
            SimRequest("r", 50, 2, index=6, arrival_s=5.0)]


def _run(tmp_path, reqs):
    d = Deployment(MODEL, get_hardware("cpu"), colocated=RoleConfig(max_num_batched_tokens=1024, num_blocks=256),
                   max_model_len=600)
    result = simulate(d, reqs)
    result.write(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())  # what replay reads of an engine's run
    cfg.pop("simulated")
    cfg["model"] = {"config": dataclasses.asdict(MODEL)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return {m.request_id: m for m in result.requests}


def test_closed_loop_triggers_and_prefix_hits_are_read_back_from_the_records(tmp_path):
    run = _run(tmp_path, _workload())
    # the simulator released each triggered request at its trigger's end (the last one's, for c0)
    assert run["b0"].arrived_ns == run["a0"].finished_ns and run["b1"].arrived_ns == run["b0"].finished_ns
    assert run["a1"].finished_ns == run["a2"].finished_ns == run["c0"].arrived_ns
    assert run["b0"].num_cached_tokens == run["b1"].num_cached_tokens == 320 and run["a0"].num_cached_tokens == 0

    recorded, notes = recorded_workload(read_run_dir(str(tmp_path)).requests)
    by_id = {r.request_id: r for r in recorded}
    assert {rid: r.after_finished for rid, r in by_id.items()} == {
        "a0": None, "a1": None, "a2": None, "b0": ("a0",), "b1": ("b0",), "c0": ("a1", "a2"), "r": None}
    assert by_id["r"].offset_s == 5.0
    # one shared prefix: as many tokens of it as each request hit, and the filler carries it whole
    assert {rid: r.shared_prefix for rid, r in by_id.items()} == {
        "a0": 320, "a1": 0, "a2": 0, "b0": 320, "b1": 320, "c0": 0, "r": 0}
    # 3 of the 4 arrivals that followed an end came within 5 ms of it: a closed-loop run (20 ms window)
    assert any("3 of 7 requests arrived within 20 ms of another's end" in n for n in notes), notes


def _record(rid, arrived_ms, ended_ms):
    return SimpleNamespace(request_id=rid, finish_reason="length", arrived_ns=round(arrived_ms * 1e6),
                           finished_ns=round(ended_ms * 1e6), token_sent_ns=[round(ended_ms * 1e6)],
                           num_cached_tokens=0, num_prompt_tokens=8, num_output_tokens=2)


def test_an_open_loop_arrival_is_read_as_released_only_within_5_ms_of_an_end():
    """Open loop: most arrivals are far from any end, so the window stays 5 ms: an arrival 3 ms after
    an end is read as released by it, one 8 ms after is not (in a closed-loop run it would be)."""
    open_loop = [_record("o0", 0, 100), _record("o1", 103, 180), _record("o2", 188, 300),
                 _record("o3", 240, 320), _record("o4", 400, 450), _record("o5", 520, 600)]
    got = {r.request_id: r.after_finished for r in recorded_workload(open_loop)[0]}
    assert got == {"o0": None, "o1": ("o0",), "o2": None, "o3": None, "o4": None, "o5": None}
    closed = [_record("c0", 0, 100), _record("c1", 0, 150), _record("c2", 102, 200), _record("c3", 158, 260),
              _record("c4", 201, 300)]
    got = {r.request_id: r.after_finished for r in recorded_workload(closed)[0]}
    assert got == {"c0": None, "c1": None, "c2": ("c0",), "c3": ("c1",), "c4": ("c2",)}


def test_prediction_inputs_rerun_the_workload_with_its_triggers_and_hits(tmp_path):
    """Simulated again from the records (a prediction's "before"), under a configuration that changes
    when requests end (max_num_seqs 1), each triggered request still arrives when its trigger ended
    and the prefix hits recur."""
    run = _run(tmp_path, _workload())
    deployment, reqs, _, notes = replay_inputs(read_run_dir(str(tmp_path)), at="arrival")
    assert any("share one random 320-token prefix" in n for n in notes), notes
    again = simulate(dataclasses.replace(deployment, colocated=dataclasses.replace(deployment.colocated, max_num_seqs=1)),
                     reqs)
    out = {m.request_id: m for m in again.requests}
    assert out["b0"].arrived_ns == out["a0"].finished_ns and out["b1"].arrived_ns == out["b0"].finished_ns
    assert out["c0"].arrived_ns == max(out["a1"].finished_ns, out["a2"].finished_ns)
    assert out["a1"].finished_ns != out["a2"].finished_ns  # one at a time now: c0 waited for the later
    assert {rid: m.num_cached_tokens for rid, m in out.items()} == {rid: m.num_cached_tokens for rid, m in run.items()}


class _CountingEngine:
    """The ServingEngine surface run_arrivals drives: each request ends after max_tokens steps."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.added: list[tuple[str, frozenset[str]]] = []  # (request, the requests finished when it was added)
        self.done: set[str] = set()

    def add_request(self, prompt, params, request_id, **_):
        self.added.append((request_id, frozenset(self.done)))
        self.left[request_id] = params.max_tokens
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self):
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            n = 0
            if self.left[rid] == 0:
                del self.left[rid]
                self.done.add(rid)
                n = 1
            outs.append(SimpleNamespace(request_id=rid, finished=n == 1, outputs=[SimpleNamespace(token_ids=[0])]))
        return outs


def test_driver_releases_a_request_after_all_of_its_triggers():
    engine = _CountingEngine()
    run_arrivals(engine, [Arrival("x", [1], 2, at_s=0.0), Arrival("y", [1], 5, at_s=0.0),
                          Arrival("z", [1], 1, after_finished=("x", "y")), Arrival("w", [1], 1, after_finished="x")])
    seen = dict(engine.added)
    assert seen["w"] >= {"x"} and "y" not in seen["w"]  # released by x alone, before y ended
    assert seen["z"] >= {"x", "y"}

