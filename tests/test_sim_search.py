"""Deployment search: DistServe's goodput and Sarathi-Serve's capacity, named in the output."""

from __future__ import annotations

import json

import pytest

from phaselab.core.timing import RequestMetrics
from phaselab.errors import ConfigError
from phaselab.cost.catalog import get_hardware, get_model
from phaselab.sim.loop import simulate
from phaselab.sim.search import SLO, candidates, max_rate, random_workload_at, search


def _m(ttft_s: float, gaps: list[float], reason: str = "length") -> RequestMetrics:
    t = [1_000_000_000 + round(ttft_s * 1e9)]
    for g in gaps:
        t.append(t[-1] + round(g * 1e9))
    return RequestMetrics(arrived_ns=1_000_000_000, queued_ns=1_000_000_000, first_scheduled_ns=1_000_000_000,
                          token_sampled_ns=t, token_sent_ns=t, finished_ns=t[-1], finish_reason=reason,
                          num_output_tokens=len(t))


def test_goodput_is_distserves_attainment_of_both_slos():
    reqs = [_m(0.1, [0.02] * 4), _m(0.5, [0.02] * 4), _m(0.1, [0.2] * 4), _m(0.1, [0.02], "error")]
    slo = SLO("goodput", ttft_s=0.2, tpot_s=0.05, attainment=0.25)
    ok, attainment = slo.check(reqs)
    assert attainment == 0.25 and ok  # only the first meets both (a failed request misses)
    assert not SLO("goodput", ttft_s=0.2, tpot_s=0.05, attainment=0.3).check(reqs)[0]
    assert "DistServe" in slo.definition() and "200 ms" in slo.definition()


def test_capacity_is_sarathis_p99_time_between_tokens():
    reqs = [_m(0.1, [0.02] * 199 + [0.5]) for _ in range(3)]  # 0.5% of the gaps are long
    ok, p99 = SLO("capacity", tbt_p99_s=0.1).check(reqs)
    assert ok and p99 == pytest.approx(0.02)
    ok, p99 = SLO("capacity", tbt_p99_s=0.1).check(reqs + [_m(0.1, [0.3] * 10)])
    assert not ok
    assert "Sarathi-Serve" in SLO("capacity").definition()
    with pytest.raises(ConfigError):
        SLO("speed")


def test_candidates_fit_in_memory_and_in_the_gpu_budget():
    model, hw = get_model("llama-3-70b"), get_hardware("h100")
    deps = candidates(model, hw, max_gpus=8, tps=(1, 2, 4, 8), budgets=(2048,), policies=("chunked",), max_pool=2)
    assert deps and all(d.num_gpus <= 8 for d in deps)
    # 141 GB of weights: never on one or two 80 GB GPUs
    assert all(rc.tp >= 4 for d in deps for _, _, rc in d.roles())
    assert {d.mode for d in deps} == {"colocated", "disagg"}


def test_search_ranks_by_rate_per_gpu_and_names_its_definition():
    model, hw = get_model("llama-3-8b"), get_hardware("h100")
    deps = candidates(model, hw, max_gpus=2, tps=(1,), budgets=(2048,), policies=("chunked",), max_pool=1)
    assert [d.describe().split(":")[0] for d in deps] == ["1 x colocated (chunked 2048, TP1) on h100",
                                                          "disagg 1P (TP1, chunked 2048) "]
    slo = SLO("goodput", ttft_s=0.25, tpot_s=0.03, attainment=0.9)
    result = search(deps, random_workload_at(80, "uniform:256:1024", "uniform:16:64", seed=0), slo,
                    start_rate_per_gpu=4.0, num_bisections=3)
    assert result.best is not None and all(c.rate > 0 for c in result.candidates)
    ranked = result.ranked()
    assert ranked[0].per_gpu >= ranked[1].per_gpu
    out = result.to_json()
    assert out["definition"].startswith("goodput (DistServe's definition)")
    assert out["best"]["rate_per_gpu"] == pytest.approx(result.best.per_gpu)


def test_max_rate_brackets_the_slo():
    model, hw = get_model("llama-3-8b"), get_hardware("h100")
    (d,) = candidates(model, hw, 1, modes=("colocated",), tps=(1,), budgets=(512,), policies=("chunked",))
    workload = random_workload_at(60, "512", "32", seed=1)
    slo = SLO("goodput", ttft_s=0.1, tpot_s=0.02, attainment=0.9)
    c = max_rate(d, workload, slo, start_rate=2.0, num_bisections=4)
    assert c.rate > 0 and c.figure >= 0.9
    assert not slo.check(simulate(d, workload(c.rate * 3)).requests)[0]


def test_search_takes_another_cost_model():
    """search() prices iterations with the cost model it is given: with every iteration twice as long,
    the P99 time between tokens it judges doubles, and under an SLO between the two the slower model
    meets it only at a lower rate."""
    from phaselab.cost.catalog import get_hardware, get_model
    from phaselab.cost.pricing import RooflineCostModel
    from phaselab.sim.search import SLO, candidates, random_workload_at, search

    model, hw = get_model("llama-3-8b"), get_hardware("h100")
    deps = candidates(model, hw, 1, modes=("colocated",), tps=(1,), budgets=(512,), policies=("chunked",),
                      role={"max_num_seqs": 64})
    assert deps and all(d.colocated.max_num_seqs == 64 for d in deps)

    class Slower:
        def __init__(self, inner):
            self.inner = inner

        def predict(self, plan):
            cost = self.inner.predict(plan)
            cost.duration_ns *= 2
            return cost

    def slower(name, role, rc):
        d = deps[0]
        return Slower(RooflineCostModel(d.model, d.hardware, d.cost_params, rc.tp, d.dtype_bytes))

    workload = random_workload_at(60, "uniform:256:1024", "uniform:32:64", seed=0)
    fast = search(deps, workload, SLO("capacity", tbt_p99_s=1.0), num_bisections=2).candidates[0]
    slow = search(deps, workload, SLO("capacity", tbt_p99_s=1.0), num_bisections=2, cost_model=slower).candidates[0]
    assert slow.figure == pytest.approx(2 * fast.figure, rel=0.05)
    between = SLO("capacity", tbt_p99_s=1.5 * fast.figure)
    rate_fast = search(deps, workload, between, num_bisections=2).candidates[0].rate
    rate_slow = search(deps, workload, between, num_bisections=2, cost_model=slower).candidates[0].rate
    assert rate_slow < rate_fast


def test_plan_searches_the_adaptive_budget_and_seats(tmp_path, capsys):
    """`phaselab plan` (issue 17 item 3): the adaptive candidate at the TBT target and each seat
    count are in the search, ranked by goodput per GPU; --verify is refused, not faked."""
    from phaselab.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "--slo-ttft-ms", "500", "--slo-tbt-ms", "50", "--model", "llama-3-8b", "--hardware", "h100",
               "--max-gpus", "1", "--tps", "1", "--modes", "colocated", "--budgets", "512", "--max-num-seqs", "32,128",
               "--num-prompts", "30", "--bisections", "2", "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "goodput (DistServe's definition)" in text and "adaptive budget <= 512 for TBT 50 ms" in text
    data = json.loads(out.read_text())
    described = [c["deployment"] for c in data["candidates"]]
    assert len(described) == 6 and len(set(described)) == 6  # 3 schedulings x 2 seat counts, all named apart
    rates = [c["rate_per_gpu"] for c in data["candidates"]]
    assert rates == sorted(rates, reverse=True)
    assert main(["plan", "--slo-ttft-ms", "500", "--slo-tbt-ms", "50", "--verify"]) == 2
    assert "--verify" in capsys.readouterr().err
