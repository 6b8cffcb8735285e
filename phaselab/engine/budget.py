"""The adaptive budget's cost model on a real engine: seeded, then refitted from every iteration.

    start:  --slo-cost-file FILE (coefficients JSON, e.g. a previous run's config.json "slo" entry)
            or a warm-up: cost.online_fit.warm_up_shapes run as synthetic plans on the runner
            (borrowed KV blocks, garbage K/V, each shape twice: the first run pays first-touch costs)
    step:   the engine measures the iteration (schedule -> outputs handed over, the span a TBT
            target bounds) and BudgetLearner.observe refits; the scheduler gets the coefficients
            before its next plan
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from phaselab.core.outputs import shape_plan
from phaselab.cost.online_fit import BudgetLearner, OnlineCostFitter, warm_up_shapes
from phaselab.cost.iteration_cost import IterationCostCoefficients
from phaselab.errors import ConfigError

if TYPE_CHECKING:
    from phaselab.engine.engine import LLMEngine

logger = logging.getLogger("phaselab.engine")


def load_coefficients(path: str) -> IterationCostCoefficients:
    """Coefficients from a JSON file: {"overhead_s": ...}, {"coefficients": {...}} or a run
    directory's config.json (its "slo" entry)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the cost coefficients from {path!r} ({e}); give a JSON file such as a "
                          "previous run's config.json, or drop --slo-cost-file to warm up at start") from e
    d = d.get("slo", d)
    d = d.get("cost_model", d)
    return IterationCostCoefficients.from_json(d.get("coefficients", d))


def start_learner(engine: LLMEngine) -> BudgetLearner:
    args = engine.args
    wide_rows = engine.linear.wide_rows
    if args.slo_cost_file:
        learner = BudgetLearner(OnlineCostFitter(load_coefficients(args.slo_cost_file), wide_rows=wide_rows),
                                args.slo_cost_file)
    else:
        learner = BudgetLearner(OnlineCostFitter(IterationCostCoefficients(), wide_rows=wide_rows), "warm-up")
        warm_up(engine, learner)
    engine.scheduler.set_cost_coefficients(learner.coefficients)
    logger.info("adaptive budget: TBT target %.1f ms, cost model from %s: %s", args.slo_tbt_ms,
                learner.seed_source, learner.coefficients)
    return learner


def warm_up(engine: LLMEngine, learner: BudgetLearner) -> None:
    """Time the warm-up shapes on the runner (blocks borrowed from the idle pool) and fit them."""
    sc, cc = engine.scheduler_config, engine.cache_config
    pool = engine.scheduler.kv_cache_manager.block_pool
    shapes = warm_up_shapes(sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len,
                            pool.num_free_blocks * cc.block_size)
    need = max(-(-max([s + n for n, s in chunks] + list(decodes)) // cc.block_size) + len(chunks) + len(decodes)
               for chunks, decodes in shapes)
    blocks = pool.allocate(min(need, pool.num_free_blocks))
    if not blocks:
        raise ConfigError("no free KV block to warm the adaptive budget's cost model up; give the KV cache "
                          "more memory or pass --slo-cost-file")
    t0 = time.monotonic()
    try:
        for repeat in range(2):
            for i, (chunks, decodes) in enumerate(shapes):
                plan = shape_plan(-1 - i, chunks, decodes, blocks, cc.block_size)
                start = time.monotonic_ns()
                engine.executor.execute(plan)
                seconds = (time.monotonic_ns() - start) / 1e9
                engine.executor.sampler.free([s.request_id for s in plan.scheduled])
                if repeat:
                    learner.fitter.update(learner.features(plan), seconds)
    finally:
        pool.free(blocks)
    learner.fitter.anchor()
    logger.info("adaptive budget: warm-up of %d shapes took %.1fs", 2 * len(shapes), time.monotonic() - t0)
