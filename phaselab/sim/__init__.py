"""phaselab's simulator: the engine's own scheduler and router on a virtual clock (docs/simulator.md).

    workload.py    SimRequest; the bench's generators and seeds (random, shared-prefix, interference, trace)
    catalog.py     HardwareSpec (A100, H100, H200, this CPU), LinkSpec (NVLink 3/4, PCIe 4/5, IB HDR/NDR,
                   25/100 GbE), MODELS as modelinfo.model_config.ModelConfig (Llama family, OPT, any config.json); every
                   figure with its source
    catalog_files.py  a device or link from a JSON file (documented schema, errors naming the field)
    efficiency.py  bounded efficiency curves: GEMM by tokens, attention by query rows and keys, K/V by context
    pricing.py     RooflineCostModel.predict(plan) -> IterationCost: roofline per operator class + overheads
                   + tensor-parallel all-reduce; CostParams (every efficiency in (0, 1]) with sources
    profiles.py    operator-level profile tables (Vidur's format); the packaged Vidur data in data/vidur/
    fit.py         `simulate fit`: a device's curves from profile tables; the shipped fits in data/fits/
    deployment.py  Deployment: colocated replicas or prefill/decode pools, per-role tp and scheduler options
    events.py      EventQueue: the virtual clock
    transfer.py    Network: KV flows on links, max-min fair sharing, latency, per-flow rate caps
    sim_worker.py  SimWorker: one engine, a core Scheduler + CostModelExecutor (the cost model's times)
    loop.py        Simulator: the workers on the virtual clock; core's routing policy;
                   RequestMetrics / IterationRecord exactly as the engine stamps them; SimResult.write(dir)
    replay.py      a real run's measured iteration times in, the same plans out
    calibrate.py   fit CostParams to a real run's iteration log (non-negative least squares, capped at 1)
    search.py      best goodput (DistServe) or capacity (Sarathi-Serve) per GPU over deployments
    summary.py     summaries: TTFT, TPOT, TBT, queue, transfer share; SLO attainment
    simulate_cli.py `phaselab simulate run | replay | calibrate | fit | search | catalog`

Imports `core`, `obs`, `modelinfo` (the torch-free model description) and the bench's workload generators; never torch
or `phaselab.engine` (a test runs a simulation in a fresh interpreter and checks).
"""
