"""One simulated engine: the engine's own core Scheduler driven through a cost model instead of a
model runner (sim/loop.py puts these workers on the virtual clock and moves requests between them).

    CostModelExecutor.execute(plan): a dummy token per sampled request (EOS where the workload
        stops it) and the cost model's predicted duration (times a noisy machine's factor,
        sim/noise.py, when one is given), split into prepare and forward
    warm_up_learner: the adaptive budget's warm-up (engine/budget.py), timed by the cost model
    SimWorker: the scheduler, the executor, the inbox and staged KV, and its busy time
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from phaselab.cost.iteration_cost import IterationCostCoefficients
from phaselab.core.executor import Executor
from phaselab.core.outputs import shape_plan
from phaselab.cost.online_fit import BudgetLearner, OnlineCostFitter, warm_up_shapes
from phaselab.core.outputs import SchedulerOutput, StepResult
from phaselab.core.request import Request
from phaselab.core.scheduler import Scheduler
from phaselab.sim.deployment import RoleConfig
from phaselab.sim.noise import IterationNoise, scaled
from phaselab.cost.pricing import IterationCost
from phaselab.sim.transfer import Flow
from phaselab.sim.workload import DUMMY_TOKEN, EOS_TOKEN

NS = 1_000_000_000


class CostModel(Protocol):
    def predict(self, plan: SchedulerOutput) -> IterationCost: ...


def warm_up_learner(scheduler: Scheduler, executor: CostModelExecutor) -> BudgetLearner:
    """The engine's warm-up (engine/budget.py) on the virtual clock: the same synthetic shapes,
    timed by the executor's cost model (and its noise) instead of the runner."""
    cost_model = executor.cost_model
    sc, cc = scheduler.scheduler_config, scheduler.cache_config
    # the engine's max_native_rows, where the cost model prices the batched GEMM's regime (CostParams)
    wide_rows = int(getattr(getattr(cost_model, "params", None), "wide_rows", 0) or 0)
    learner = BudgetLearner(OnlineCostFitter(IterationCostCoefficients(), wide_rows=wide_rows), "warm-up (simulated)")
    blocks = list(range(cc.num_blocks))
    for i, (chunks, decodes) in enumerate(warm_up_shapes(sc.max_num_batched_tokens, sc.max_num_seqs,
                                                         sc.max_model_len, cc.num_blocks * cc.block_size)):
        plan = shape_plan(-1 - i, chunks, decodes, blocks, cc.block_size)
        learner.fitter.update(learner.features(plan), executor.timed(plan).duration_ns / NS)
    learner.fitter.anchor()
    scheduler.set_cost_coefficients(learner.coefficients)
    return learner


class CostModelExecutor(Executor):
    """The executor of a simulated worker: a deterministic dummy token per sampled request (EOS
    where the workload says the request stops) and the cost model's predicted duration, split
    into prepare (fixed overheads) and forward (the rest). With `noise`, each time is the cost
    model's times the noise's factor for the plan at `clock()` (ns since the simulation's start)."""

    def __init__(self, cost_model: CostModel, stop_at: dict[str, int], noise: IterationNoise | None = None,
                 clock: Callable[[], int] | None = None, worker: str = "") -> None:
        self.cost_model = cost_model
        self.stop_at = stop_at  # request id -> output tokens after which it samples EOS
        self.last_cost = IterationCost(0)
        self.noise = noise
        self.clock = clock or (lambda: 0)
        self._rng = noise.generator(worker) if noise is not None else None

    def timed(self, plan: SchedulerOutput) -> IterationCost:
        """The plan's cost on this (possibly noisy) machine, now."""
        cost = self.cost_model.predict(plan)
        if self.noise is None or self._rng is None:
            return cost
        return scaled(cost, self.noise.factor(plan, self.clock() / NS, self._rng))

    def execute(self, plan: SchedulerOutput) -> StepResult:
        cost = self.last_cost = self.timed(plan)
        sampled = {}
        stop_at = self.stop_at
        for e in plan.scheduled:
            if e.sample:
                stop = stop_at.get(e.request_id)
                stops = stop is not None and e.num_output_tokens + 1 >= stop
                sampled[e.request_id] = EOS_TOKEN if stops else DUMMY_TOKEN
        prepare = min(cost.duration_ns, round(cost.overhead_s * NS))
        return StepResult(plan.iteration_id, sampled, prepare_ns=prepare, forward_ns=cost.duration_ns - prepare)


class SimWorker:
    """One engine of the deployment: a core Scheduler, an executor, and its place on the clock."""

    def __init__(self, name: str, role: str, rc: RoleConfig, scheduler: Scheduler, executor: CostModelExecutor) -> None:
        self.name, self.role, self.rc = name, role, rc
        self.scheduler = scheduler
        self.executor = executor
        self.inbox: list[Request] = []  # arrived, added to the scheduler at the next iteration boundary
        self.staged: deque[Request] = deque()  # decode side: KV arrived, waiting for admission
        self.busy = False
        self.kicked = False
        self.busy_ns = 0
        self.num_iterations = 0
        self.open_flows: list[Flow] = []  # layer-by-layer flows capped by this iteration
        # the adaptive budget's online cost model, learning from the cost model's times as the
        # engine learns from its measured ones (None under a fixed budget)
        self.learner: BudgetLearner | None = None
        if scheduler.scheduler_config.adaptive:
            self.learner = warm_up_learner(scheduler, executor)

    @property
    def has_work(self) -> bool:
        return bool(self.inbox or self.staged or self.scheduler.has_schedulable_requests())
