"""The phase record made visible: modeled cost, Prometheus metrics, Chrome/Perfetto traces, run directories.

Plain data like `core/`: nothing here imports torch (a test enforces it) and nothing reads a
clock except `rundir.run_config`, which dates the config.json it writes. The records themselves
(RequestMetrics, IterationRecord, ModeledCost) live in `core/timing.py`; this package turns them
into numbers, files and pictures.

    cost.modeled_cost(config, plan, dtype_bytes)    -> ModeledCost   (per iteration, MODELED)
    cost.CostFormulas(config, dtype_bytes)             the same counts, factors computed once (the simulator)
    prometheus.EngineMetrics(labels)                  observe_iteration / observe_finished / render
    trace.build_trace(requests, iterations)         -> Chrome trace dict; validate_trace, write_trace
    rundir.write_run_dir(path, ...) / read_run_dir(path) -> RunData
"""

from phaselab.obs.modeled_cost import modeled_cost
from phaselab.obs.prometheus import EngineMetrics
from phaselab.obs.rundir import RunData, read_run_dir, write_run_dir
from phaselab.obs.perfetto import build_trace, validate_trace, write_trace

__all__ = [
    "EngineMetrics", "RunData", "build_trace", "modeled_cost", "read_run_dir", "validate_trace",
    "write_run_dir", "write_trace",
]
