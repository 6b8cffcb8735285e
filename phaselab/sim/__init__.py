"""phaselab's simulator: the engine's own scheduler and router on a virtual clock (docs/simulator.md).

    workload.py    SimRequest; the bench's generators and seeds (random, shared-prefix, interference, trace)
    deployment.py  Deployment: colocated replicas or prefill/decode pools, per-role tp and scheduler options
    events.py      EventQueue: the virtual clock
    noise.py       IterationNoise: a noisy machine's iteration times (per-shape lognormal, slow periods)
    transfer.py    Network: KV flows on links, max-min fair sharing, latency, per-flow rate caps
    sim_worker.py  SimWorker: one engine, a core Scheduler + CostModelExecutor (the cost model's times)
    loop.py        Simulator: the workers on the virtual clock; core's routing policy;
                   RequestMetrics / IterationRecord exactly as the engine stamps them; SimResult.write(dir)
    replay.py      a real run's measured iteration times in, the same plans out
    calibrate.py   a run directory fitted: its iterations and host read, cost/record_fit.py's fit applied
    measure_host.py  this host's ceilings measured for a run, in a subprocess (python -m phaselab.engine.ceilings)
    search.py      best goodput (DistServe) or capacity (Sarathi-Serve) per GPU over deployments
    summary.py     summaries: TTFT, TPOT, TBT, queue, transfer share; SLO attainment
    simulate_cli.py `phaselab simulate run | replay | calibrate | fit | search | catalog`

Prices with `phaselab.cost` (the formulas, the hardware catalog, the roofline pricing, the fits).
Imports `core`, `cost`, `obs`, `modelinfo` (the torch-free model description) and the bench's workload generators; never torch
or `phaselab.engine` (a test runs a simulation in a fresh interpreter and checks).
"""
