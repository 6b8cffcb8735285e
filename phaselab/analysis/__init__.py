"""Analysis of recorded runs: which phase is slow, why, and what would fix it.

    diagnose.py    the symptom table worked through, causes ranked with evidence (docs/analysis.md)
    measures.py    the analyses of each symptom row (TTFT split, queue, prefill fit, decode, stalls, disagg)
    findings.py    one finding per cause (key figure, evidence, change, check) and their ranking
    accounting.py  every request's E2E cut into causes that sum to it (the ranking's score)
    timeline.py    PNG and interactive HTML timelines: worker lanes, request lanes, stalls marked
    predict.py     each suggestion's effect simulated on the run's own calibration (phaselab/sim)
    external.py    a `phaselab bench` client run against any server, plus its /metrics scrapes
    diagnose_cli.py the `diagnose` and `timeline` subcommands

Everything here reads run directories (phaselab.obs.rundir) only, never builds an engine and never
imports torch; what reruns engines (`diagnose --verify`, `compare` and its report) is in
phaselab/experiments, the layer above (docs/architecture.md, Layers).
"""
