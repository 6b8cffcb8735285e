"""The phase record made visible: Prometheus metrics, Chrome/Perfetto traces, run directories.

Plain data like `core/`: nothing here imports torch (a test enforces it) and nothing reads a
clock except `rundir.run_config`, which dates the config.json it writes. The records themselves
(RequestMetrics, IterationRecord) live in `core/timing.py`, the modeled cost in `cost/formulas.py`;
this package turns them into numbers, files and pictures.

    prometheus.EngineMetrics(labels)                  observe_iteration / observe_finished / render
    perfetto.build_trace(requests, iterations)         -> Chrome trace dict; validate_trace, write_trace
    rundir.write_run_dir(path, ...) / read_run_dir(path) -> RunData
"""

from phaselab.obs.prometheus import EngineMetrics
from phaselab.obs.rundir import RunData, read_run_dir, write_run_dir
from phaselab.obs.perfetto import build_trace, validate_trace, write_trace

__all__ = [
    "EngineMetrics", "RunData", "build_trace", "read_run_dir", "validate_trace",
    "write_run_dir", "write_trace",
]
