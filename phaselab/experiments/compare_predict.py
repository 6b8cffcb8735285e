"""`compare`'s predicted vs measured: each chunked configuration predicted from the prefill-first run.

    prefill-first run (a workload's run directory) ─▶ Predictor (analysis/predict.py: the run's own
        workload, scheduler and calibrated cost model) ─▶ simulated with `--policy chunked
        --max-num-batched-tokens B` for each fixed-budget chunked configuration
    ─▶ predicted change (simulated after / before) next to the measured one (that configuration's
       run / the prefill-first run, same workload), per user-facing figure

The same check `diagnose --verify` makes for one suggestion, made for every configuration compare
ran anyway. The measured side is one run of each configuration, one after the other: on a shared
machine their difference carries the load's drift too (verify alternates reruns to cancel it;
compare runs each configuration once). Reads run directories only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phaselab.analysis.predict import FIGURES, Change, Prediction, figures, make_predictor

if TYPE_CHECKING:
    from phaselab.experiments.compare import CompareResult

BASELINE = "prefill-first"


@dataclass
class ConfigPrediction:
    workload: str
    config: str  # the configuration's name
    label: str
    prediction: Prediction
    measured: dict[str, float | None]  # the configuration's own run

    def measured_relative(self, name: str) -> float | None:
        b, a = self.prediction.measured.get(name), self.measured.get(name)
        return (a - b) / b if b and a is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "config": self.config, "flags": self.prediction.change.flags,
                "baseline": BASELINE, "cost_model_error": self.prediction.cost_model_error,
                "figures": {n: {"baseline": self.prediction.measured.get(n), "measured": self.measured.get(n),
                                "predicted_change": self.prediction.relative(n),
                                "measured_change": self.measured_relative(n)} for n in FIGURES}}


def compare_predictions(result: CompareResult, workloads: tuple[str, ...] = ("interference",)
                        ) -> tuple[list[ConfigPrediction], list[str]]:
    """Predicted vs measured for every fixed-budget chunked configuration of a real compare, from its
    prefill-first run; (rows, notes). A simulated compare gets none: both sides would be simulated."""
    from phaselab.obs.rundir import read_run_dir

    if result.plan.simulation is not None:
        return [], []
    base = next((r for r in result.results if r.config.name == BASELINE), None)
    if base is None:
        return [], [f"no {BASELINE} configuration: nothing to predict the others from"]
    rows: list[ConfigPrediction] = []
    notes: list[str] = []
    for w in workloads:
        if w not in base.runs:
            continue
        predictor, why = make_predictor(base.runs[w])
        if predictor is None:
            notes.append(f"{w}: {why}")
            continue
        for r in result.results:
            c = r.config
            if c.mode != "colocated" or c.policy != "chunked" or c.slo_tbt_ms or not c.budget or w not in r.runs:
                continue
            change = Change({"policy": "chunked", "max_num_batched_tokens": c.budget},
                            f"--policy chunked --max-num-batched-tokens {c.budget}",
                            {"policy": "chunked", "max_num_batched_tokens": c.budget})
            rows.append(ConfigPrediction(w, c.name, c.label, predictor.predict(change),
                                         figures(read_run_dir(r.runs[w]).requests)))
    return rows, notes
