"""Analysis of recorded runs: which phase is slow, why, and what would fix it.

    diagnose.py    the symptom table worked through, causes ranked with evidence (docs/analysis.md)
    accounting.py  every request's E2E cut into causes that sum to it (the ranking's score)
    timeline.py    PNG and interactive HTML timelines: worker lanes, request lanes, stalls marked
    report.py      the HTML report of `phaselab compare`
    compare.py     `phaselab compare`: the same workloads under prefill-first, chunked and disagg
    external.py    a `phaselab bench` client run against any server, plus its /metrics scrapes
    cli.py         the `diagnose`, `timeline` and `compare` subcommands

Everything here reads run directories (phaselab.obs.rundir) only and never imports torch;
compare.py is the exception that orchestrates runs, importing the engine lazily.
"""
