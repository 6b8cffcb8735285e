"""Analysis of recorded runs: which phase is slow, why, and what would fix it.

    diagnose.py    the symptom table worked through, causes ranked with evidence (docs/analysis.md)
    measures.py    the analyses of each symptom row (TTFT split, queue, prefill fit, decode, stalls, disagg)
    findings.py    one finding per cause (key figure, evidence, change, check) and their ranking
    accounting.py  every request's E2E cut into causes that sum to it (the ranking's score)
    timeline.py    PNG and interactive HTML timelines: worker lanes, request lanes, stalls marked
    report.py      the HTML report of `phaselab compare` (phaselab/experiments runs it)
    external.py    a `phaselab bench` client run against any server, plus its /metrics scrapes
    cli.py         the `diagnose` and `timeline` subcommands

Everything here reads run directories (phaselab.obs.rundir) only and never imports torch; the
orchestrator that makes runs for a comparison is phaselab/experiments/compare.py.
"""
