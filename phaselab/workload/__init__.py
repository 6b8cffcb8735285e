"""One workload vocabulary for `phaselab bench`, `phaselab simulate` and `phaselab compare`
(docs/workload.md). No torch, no HTTP client.

    lengths.py       LengthDist ("256", "uniform:128:512", ...), WorkloadError
    arrivals.py      ArrivalPlan (closed / open Poisson-gamma / self-timed), arrival_offsets, workload_seeds
    params.py        RandomParams, SharedPrefixParams: the text workloads' parameters (and flags)
    interference.py  InterferenceParams: the interference workload, its timing in seconds or stream tokens
    trace_file.py    read_trace_rows: the trace JSONL (Mooncake keys too)
    request_spec.py  RequestSpec: one request of a text workload
    prompts.py       prompts of exact token lengths; the bench's text workloads; build_specs
    driver.py        Arrival + run_arrivals: the one open-loop driver of an engine in this process
"""
