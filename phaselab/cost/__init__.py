"""One cost package: what an iteration costs, counted, priced, fitted and learned.

Below `core` (the scheduler prices its plans with it) and above `modelinfo`; pure Python, no torch
(tests/test_obs_cost.py checks), `mypy --strict` with core (tests/test_core_typing.py).

    shapes.py          the attributes of a plan and a recorded iteration the package reads (Protocols)
    formulas.py        ModeledCost: bytes and FLOPs of one iteration from the model and the plan (MODELED);
                       CostFormulas, the same counts with the factors computed once
    iteration_cost.py  IterationCostCoefficients: the online model's six terms over a plan's shape
                       (what the SLO-aware budget predicts with); chunk_cost, largest_chunk_within
    online_fit.py      OnlineCostFitter / BudgetLearner: those coefficients learned from measured
                       iterations as the engine runs (recursive least squares, warm-up shapes)
    efficiency.py      bounded efficiency curves: GEMM by tokens, attention by rows and keys, K/V by context
    pricing.py         RooflineCostModel.predict(plan) -> IterationCost: roofline per operator class +
                       overheads + tensor-parallel all-reduce; CostParams with sources
    record_fit.py      the offline fit: CostParams fitted to a run's recorded iterations (NNLS)
    profiles.py        operator-level profile tables (Vidur's format); the packaged data in data/vidur/
    profile_fit.py     a device's curves fitted to profile tables; the shipped fits in data/fits/
    catalog.py         HardwareSpec, LinkSpec, MODELS: every figure with its source
    catalog_files.py   a device or link from a JSON file (documented schema, errors naming the field)
    host.py            this CPU's measured ceilings: the cache key, the per-machine cache file, which
                       ceilings bound a run (measured once by engine/ceilings.py, read everywhere)
"""
