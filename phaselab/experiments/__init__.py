"""Experiments: orchestrators that build engines or simulations, run workloads on them and hand
the run directories to phaselab.analysis (which only reads them).

    compare.py       `phaselab compare`: prefill-first vs chunked vs disaggregated on the bundled model
    compare_sim.py   `phaselab compare --simulate`: the same comparison simulated at cluster scale
    cli.py           the `compare` subcommand's parser and dispatch
"""
