"""`phaselab simulate calibrate`'s fit of a run directory: its iterations and its host's ceilings read,
then the cost model fitted to them (cost/record_fit.py holds the fit itself)."""

from __future__ import annotations

import warnings
from os import PathLike

from phaselab.core.timing import IterationRecord
from phaselab.cost.catalog import HardwareSpec, get_hardware
from phaselab.cost.host import host_mismatch, run_hardware
from phaselab.cost.record_fit import Fit, fit_params, iteration_cycles, run_model, run_wide_rows
from phaselab.obs.rundir import engine_config, read_run_dir


def calibrate(path: str | PathLike[str] | list[str | PathLike[str]], hardware: str | HardwareSpec | None = None,
              weighting: str = "sqrt", fixed: dict[str, float] | None = None) -> tuple[Fit, HardwareSpec]:
    """Fit a real run, or several runs of one engine pooled (a list: their iterations fitted together,
    each run's cycles its own; e.g. runs alternated with others so that a drift of a shared machine's
    speed falls on both sides). `fixed` pins coefficients (fit_params). The efficiencies are capped at 1 of `hardware`'s ceilings: by default
    the ones the engine measured on the run's host and recorded in it, else the catalog's `cpu` entry
    (host.py); a warning (also in fit.notes) says when they were measured on another CPU than the run's."""
    paths = list(path) if isinstance(path, (list, tuple)) else [path]
    runs = [read_run_dir(p) for p in paths]
    data = runs[0]
    config = engine_config(data.config)  # a disaggregated run: its workers' (one model, one dtype)
    for p, run in zip(paths, runs):
        if run.config.get("simulated"):
            raise ValueError(f"{p} is a simulated run; calibrate on a real one")
        if run_model(engine_config(run.config)) != run_model(config):
            raise ValueError(f"{p} ran another model or dtype than {paths[0]}; calibrate runs of one engine together")
    model, dtype_bytes = run_model(config)
    hw = run_hardware(config) if hardware is None else \
        hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    iters: list[IterationRecord] = []
    cycles: list[int] = []
    for run in runs:
        its = sorted(run.iterations, key=lambda r: r.start_ns)
        iters += its
        cycles += iteration_cycles(its)
    if not iters:
        raise ValueError(f"{', '.join(map(str, paths))} has no iterations to fit")
    fit = fit_params(iters, cycles, model, hw, dtype_bytes, " + ".join(map(str, paths)), weighting=weighting,
                     wide_rows=run_wide_rows(config), fixed=fixed)
    fit.notes = host_mismatch(config, hw)
    for note in fit.notes:
        warnings.warn(note, stacklevel=2)
    return fit, hw
