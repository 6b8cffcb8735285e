"""Experiments: the orchestrators that build engines (through serving_engine.make_engine) or
simulations, run workloads on them and hand the run directories to phaselab.analysis (which only
reads them). The layer above the engine, the simulator and the analysis (docs/architecture.md).

    compare.py          `phaselab compare`: prefill-first vs chunked vs disaggregated on the bundled model
    compare_sim.py      `phaselab compare --simulate`: the same comparison simulated at cluster scale
    compare_predict.py  compare's predicted vs measured: each chunked configuration simulated from the
                        prefill-first run
    compare_report.py   compare's report.html
    compare_cli.py      the `compare` subcommand's parser and dispatch
    diagnose_verify.py  `diagnose RUN --verify`: the recorded workload rerun as recorded and changed
    plan.py             `phaselab plan`: the simulator's SLO search (phaselab/sim/search.py), and --verify
    plan_verify.py      `plan --verify`: the top configurations run for real on this machine
"""
