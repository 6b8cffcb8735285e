"""Search deployments: the best one per GPU under latency SLOs, by simulation.

Two definitions, named in every output (`SLO.definition()`):

- **goodput** (DistServe, OSDI'24): the highest request rate at which at least `attainment` of the
  requests meet both the TTFT SLO and the TPOT SLO; divided by the GPUs of the deployment, it is
  the *goodput per GPU* the search maximises.
- **capacity** (Sarathi-Serve, OSDI'24): the highest request rate at which the P99 time between
  tokens (every gap between consecutive tokens of a request, all requests pooled) stays under its
  SLO while the median scheduling delay (queued -> first scheduled) stays under `max_queue_s`
  (Sarathi-Serve uses 2 s); per GPU likewise.

    for each candidate deployment (one unit: a colocated engine of tp GPUs, or p prefill + d decode
    engines of tp_p / tp_d GPUs; more units replicate it, which keeps the per-GPU figure):
        rate: double from a guess until the SLO fails, then bisect (the same seeded requests at every
        rate: the gamma/Poisson gaps scale as 1/rate, so feasibility is monotone up to noise)
    rank by rate / GPUs

The candidates: colocated tp x policy x token budget; disaggregated (p, d) ratios x tp_p x tp_d
x prefill budget, within `max_gpus`. Deployments whose weights do not fit are skipped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from phaselab.core.config import BUDGETS_TRIED
from phaselab.errors import ConfigError
from phaselab.cost.catalog import HardwareSpec
from phaselab.cost.pricing import CostParams
from phaselab.sim.deployment import TPS_TRIED, Deployment, RoleConfig
from phaselab.sim.loop import simulate
from phaselab.sim.summary import percentile, slo_attainment
from phaselab.sim.workload import SimRequest, random_requests
from phaselab.modelinfo.model_config import ModelConfig
from phaselab.workload.arrivals import ArrivalPlan


@dataclass(frozen=True)
class SLO:
    kind: str = "goodput"  # "goodput" (DistServe) | "capacity" (Sarathi-Serve)
    ttft_s: float = 1.0
    tpot_s: float = 0.1
    attainment: float = 0.9
    tbt_p99_s: float = 0.1
    max_queue_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in ("goodput", "capacity"):
            raise ConfigError(f"unknown SLO kind {self.kind!r}; choose goodput (DistServe) or capacity (Sarathi-Serve)")
        if not 0 < self.attainment <= 1:
            raise ConfigError("attainment must be in (0, 1]")

    def definition(self) -> str:
        if self.kind == "goodput":
            return (f"goodput (DistServe's definition): the highest request rate at which >= {self.attainment:.0%} "
                    f"of requests meet both TTFT <= {self.ttft_s * 1e3:g} ms and TPOT <= {self.tpot_s * 1e3:g} ms; "
                    "per GPU: divided by the GPUs of the deployment")
        return (f"capacity (Sarathi-Serve's definition): the highest request rate at which the P99 time between "
                f"tokens <= {self.tbt_p99_s * 1e3:g} ms and the median scheduling delay <= {self.max_queue_s:g} s; "
                "per GPU: divided by the GPUs of the deployment")

    def check(self, requests: Sequence[Any]) -> tuple[bool, float]:
        """Whether a run meets the SLO, and the figure it was judged on."""
        if self.kind == "goodput":
            att = slo_attainment(requests, self.ttft_s, self.tpot_s)
            return att >= self.attainment, att
        ok = [m for m in requests if m.finish_reason in ("stop", "length")]
        tbt = [g for m in ok for g in m.itl_s]
        queue = [m.queue_s for m in ok if m.queue_s is not None]
        p99 = percentile(tbt, 99) if tbt else math.inf
        passed = len(ok) == len(requests) and p99 <= self.tbt_p99_s and percentile(queue, 50) <= self.max_queue_s
        return passed, p99


@dataclass
class Candidate:
    deployment: Deployment
    rate: float = 0.0  # req/s meeting the SLO
    figure: float = math.nan  # attainment or P99 TBT at that rate
    num_simulations: int = 0
    error: str | None = None

    @property
    def per_gpu(self) -> float:
        return self.rate / self.deployment.num_gpus

    def to_json(self) -> dict[str, Any]:
        d = self.deployment
        return {"deployment": d.describe(), "mode": d.mode, "num_gpus": d.num_gpus, "rate": self.rate,
                "rate_per_gpu": self.per_gpu, "figure_at_rate": self.figure, "num_simulations": self.num_simulations,
                "error": self.error,
                "config": {"num_prefill": d.num_prefill, "num_decode": d.num_decode, "prefill": asdict(d.prefill),
                           "decode": asdict(d.decode), "colocated": asdict(d.colocated)}}


@dataclass
class SearchResult:
    slo: SLO
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.error is None and c.rate > 0]
        return max(ok, key=lambda c: c.per_gpu) if ok else None

    def ranked(self) -> list[Candidate]:
        return sorted(self.candidates, key=lambda c: (c.error is not None, -c.per_gpu))

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {"definition": self.slo.definition(), "slo": asdict(self.slo),
                "best": best.to_json() if best else None, "candidates": [c.to_json() for c in self.ranked()]}


def candidates(model: ModelConfig, hardware: HardwareSpec, max_gpus: int,
               modes: Sequence[str] = ("colocated", "disagg"),
               tps: Sequence[int] = TPS_TRIED, budgets: Sequence[int] = BUDGETS_TRIED,
               policies: Sequence[str] = ("chunked", "prefill-first"), max_pool: int = 4,
               params: CostParams | None = None, base: dict[str, Any] | None = None,
               role: dict[str, Any] | None = None, ratios: Sequence[tuple[int, int]] | None = None,
               prefill_policies: Sequence[str] = ("chunked",), adaptive_tbt_ms: Sequence[float] = (),
               max_num_seqs: Sequence[int | None] = (None,)) -> list[Deployment]:
    """Every deployment unit of the search space that fits in max_gpus and in memory.

    role: more RoleConfig fields for every engine (max_num_seqs, long_prefill_token_threshold, ...);
    ratios: the disaggregated (P, D) engine counts to try (default: every coprime pair up to max_pool);
    prefill_policies: the prefill pool's scheduling (chunked with each budget, or prefill-first);
    adaptive_tbt_ms: colocated chunked engines whose budget adapts to each target (up to the largest
    budget, docs/slo.md); max_num_seqs: seats of colocated engines and decode pools to try (None:
    RoleConfig's default, or role's)."""
    base, role = base or {}, role or {}
    out: list[Deployment] = []
    tps = [t for t in tps if t <= max_gpus and model.num_attention_heads % t == 0]

    def fits(d: Deployment) -> bool:
        try:
            d.resolved_max_model_len()
            return True
        except ConfigError:
            return False

    def seats(n: int | None) -> dict[str, int]:
        return {} if n is None else {"max_num_seqs": n}

    if "colocated" in modes:
        for tp, seq in itertools.product(tps, max_num_seqs):
            scheduling = [(policy, budget, 0.0) for policy in policies
                          for budget in (budgets if policy == "chunked" else [None])]
            scheduling += [("chunked", max(budgets, default=None), t) for t in adaptive_tbt_ms]
            for policy, budget, target in scheduling:
                d = Deployment(model, hardware, "colocated", colocated=RoleConfig(
                    tp=tp, policy=policy, max_num_batched_tokens=budget, slo_tbt_ms=target, **{**role, **seats(seq)}),
                    params=params, **base)
                if fits(d):
                    out.append(d)
    if "disagg" in modes:
        pairs = ratios or [(p, dn) for p in range(1, max_pool + 1) for dn in range(1, max_pool + 1)
                           if math.gcd(p, dn) == 1]  # (2, 2) is (1, 1) twice: same per-GPU figure
        for (p, dn), tp_p, tp_d in itertools.product(pairs, tps, tps):
            if p * tp_p + dn * tp_d > max_gpus:
                continue
            for policy, seq in itertools.product(prefill_policies, max_num_seqs):
                for budget in (budgets if policy == "chunked" else [None]):
                    d = Deployment(model, hardware, "disagg", num_prefill=p, num_decode=dn,
                                   prefill=RoleConfig(tp=tp_p, policy=policy, max_num_batched_tokens=budget, **role),
                                   decode=RoleConfig(tp=tp_d, **{**role, **seats(seq)}), params=params, **base)
                    if fits(d):
                        out.append(d)
    return out


WorkloadAt = Callable[[float], list[SimRequest]]
CostModelFactory = Callable[[str, str, RoleConfig], Any]  # (worker name, role, its RoleConfig) -> cost model


def random_workload_at(num_prompts: int, input_len: str, output_len: str, seed: int = 0,
                       burstiness: float = 1.0) -> WorkloadAt:
    return lambda rate: random_requests(num_prompts, input_len, output_len, seed,
                                        ArrivalPlan(request_rate=rate, burstiness=burstiness))


def max_rate(deployment: Deployment, workload_at: WorkloadAt, slo: SLO, start_rate: float = 1.0,
             num_bisections: int = 6, max_doublings: int = 12, cost_model: CostModelFactory | None = None
             ) -> Candidate:
    """The highest rate meeting the SLO (doubling, then bisection on a log scale). cost_model: builds
    each worker's cost model, (name, role, RoleConfig) -> an object with predict(plan) -> IterationCost
    (default: the roofline model of the deployment's hardware and parameters)."""
    cand = Candidate(deployment)

    def passes(rate: float) -> tuple[bool, float]:
        cand.num_simulations += 1
        result = simulate(deployment, workload_at(rate), ArrivalPlan(self_timed=True), record_iterations=False,
                          cost_model_factory=cost_model)
        return slo.check(result.requests)

    lo, hi = 0.0, start_rate
    ok, fig = passes(hi)
    for _ in range(max_doublings):
        if not ok:
            break
        lo, cand.figure = hi, fig
        hi *= 2
        ok, fig = passes(hi)
    if ok:  # never failed: the workload is too small to load this deployment
        cand.rate, cand.figure = hi, fig
        return cand
    if lo == 0.0:  # failed at the first guess: halve until one passes
        for _ in range(max_doublings):
            hi /= 2
            ok, fig = passes(hi)
            if ok:
                lo, cand.figure = hi, fig
                hi *= 2
                break
        if lo == 0.0:
            return cand
    for _ in range(num_bisections):
        mid = math.sqrt(lo * hi)
        ok, fig = passes(mid)
        if ok:
            lo, cand.figure = mid, fig
        else:
            hi = mid
    cand.rate = lo
    return cand


def search(deployments: Sequence[Deployment], workload_at: WorkloadAt, slo: SLO, start_rate_per_gpu: float = 1.0,
           num_bisections: int = 6, progress: Callable[[int, int, Candidate], None] | None = None,
           cost_model: CostModelFactory | None = None) -> SearchResult:
    result = SearchResult(slo)
    for i, d in enumerate(deployments):
        try:
            cand = max_rate(d, workload_at, slo, start_rate_per_gpu * d.num_gpus, num_bisections,
                            cost_model=cost_model)
        except ConfigError as e:
            cand = Candidate(d, error=str(e))
        result.candidates.append(cand)
        if progress is not None:
            progress(i + 1, len(deployments), cand)
    return result

