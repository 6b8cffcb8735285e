"""phaselab bench: a load generator that measures, from outside, what users of an OpenAI-compatible
server feel. Raw per-token arrival timestamps are recorded; every metric is derived afterwards.

    client.py     StreamingClient.send(spec, record): one streamed request, raw stamped SSE lines
    arrivals.py   ArrivalPlan, arrival_offsets (Poisson/gamma), drive(specs, send, plan)
    workloads.py  random, shared-prefix, interference, trace; PromptBuilder (exact token lengths)
    metrics.py    derive(record) -> RequestResult; summarize(...) -> vLLM-keyed result dict
    report.py     progress bar, summary table, JSON/JSONL, client run directory, /metrics diff
    runner.py     run_specs(client config, specs, warm-ups, settings) -> RunOutcome
    cli.py        add_bench_parser(subparsers), run_bench(ns)

No torch, no model: the tokenizer is loaded torch-free (docs/bench.md).
"""
