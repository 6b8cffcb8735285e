"""phaselab bench: a load generator that measures, from outside, what users of an OpenAI-compatible
server feel. Raw per-token arrival timestamps are recorded; every metric is derived afterwards.

    client.py     StreamingClient.send(spec, record): one streamed request, raw stamped SSE lines
    sender.py     drive(specs, send, plan): an ArrivalPlan (phaselab/workload) sent over HTTP
    client_metrics.py derive(record) -> RequestResult; summarize(...) -> vLLM-keyed result dict
    bench_report.py progress bar, summary table, JSON/JSONL, client run directory, /metrics diff
    bench_run.py  run_specs(client config, specs, warm-ups, settings) -> RunOutcome
    bench_cli.py  add_bench_parser(subparsers), run_bench(ns)

The workloads (lengths, arrivals, prompts of exact token lengths) are phaselab/workload's.
No torch, no model: the tokenizer is loaded torch-free (docs/bench.md).
"""
