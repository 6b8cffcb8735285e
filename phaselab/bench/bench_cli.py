"""`phaselab bench`: load an OpenAI-compatible server and measure what its users feel.

    add_bench_parser(subparsers)   adds the "bench" sub-command (flags: docs/bench.md)
    run_bench(ns) -> int           runs it; 0 when at least one request completed

Never imports torch nor loads a model: the bench measures over HTTP only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

# Building the parser imports nothing heavy: `phaselab --help` stays fast.
WORKLOADS = ("random", "shared-prefix", "interference", "trace")


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="load an OpenAI-compatible server and report TTFT, ITL, TPOT, E2E, stalls and goodput",
        description="Load generator for any OpenAI-compatible server (phaselab, vLLM, SGLang, llama.cpp). "
                    "Records raw per-token arrival times; metrics are derived after the run. See docs/bench.md.",
    )
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    t.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions or /v1/completions (default: %(default)s)")
    t.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer used to build prompts of exact lengths: a .gguf, a Hugging Face model directory "
                        "or a tokenizer.json (default: the bundled SmolLM2 GGUF)")
    t.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not send stream_options.include_usage (for servers that reject it); output tokens "
                        "are then counted from content chunks")
    t.add_argument("--extra-body", default=None, metavar="JSON",
                   help='fields merged into every request body, e.g. \'{"top_p": 0.9, "min_tokens": 8}\'')
    t.add_argument("--request-timeout", type=float, default=None,
                   help="seconds without a byte from the server before a request is given up as incomplete "
                        "(default: no limit)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random", help="(default: %(default)s)")
    w.add_argument("--num-prompts", type=int, default=100, help="measured requests (default: %(default)s)")
    w.add_argument("--input-len", default="256",
                   help="random: prompt tokens, a length spec: N, uniform:LO:HI, normal:MEAN:STD, "
                        "lognormal:MEDIAN:SIGMA, choice:A,B,C (default: %(default)s)")
    w.add_argument("--output-len", default="128", help="max_tokens per request, a length spec (default: %(default)s)")
    w.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to ignore EOS so every request generates exactly max_tokens")
    w.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    from phaselab.cliargs import add_fields
    from phaselab.workload.interference import InterferenceParams
    from phaselab.workload.params import SharedPrefixParams

    sp = p.add_argument_group("shared-prefix workload")
    add_fields(sp, SharedPrefixParams, ("num_groups", "prefix_len", "suffix_len"))
    it = p.add_argument_group("interference workload")
    add_fields(it, InterferenceParams)
    tr = p.add_argument_group("trace workload")
    tr.add_argument("--trace", default=None, help="JSONL trace file (see docs/bench.md)")
    tr.add_argument("--time-scale", type=float, default=1.0,
                    help="multiply the trace's arrival offsets (0.5 = replay twice as fast) (default: %(default)s)")

    a = p.add_argument_group("arrivals")
    a.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: N users, each sends its next request when its last one ends")
    a.add_argument("--request-rate", type=float, default=math.inf,
                   help="open loop: requests/s (default: inf, all at once)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps: 1 = Poisson, <1 burstier, >1 more regular "
                        "(CV = 1/sqrt(burstiness)) (default: %(default)s)")
    a.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open loop, trace)")
    a.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (and awaited) before the measured run, excluded from the results")
    a.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals (default: %(default)s)")

    m = p.add_argument_group("metrics and output")
    m.add_argument("--percentiles", default="50,90,95,99", help="(default: %(default)s)")
    m.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in ms, vLLM's semantics: ttft:MS tpot:MS e2el:MS")
    m.add_argument("--stall-factor", type=float, default=3.0,
                   help="a gap is a stall when longer than this x its stream's median gap (default: %(default)s)")
    m.add_argument("--result-json", default=None, help="write the result JSON here")
    m.add_argument("--requests-jsonl", default=None, help="write one JSON line per request here")
    m.add_argument("--record", metavar="DIR", default=None,
                   help="write a client run directory (config.json, requests.jsonl, result.json, ...; docs/bench.md)")
    m.add_argument("--scrape-metrics", action="store_true",
                   help="save the server's /metrics before and after the run and their difference")
    m.add_argument("--disable-progress", action="store_true", help="no live progress bar")
    return p


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        ps = ()
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"--percentiles {text!r}: comma-separated numbers in [0, 100], e.g. 50,90,99")
    return ps


def _bench_config(ns: argparse.Namespace) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(ns).items() if k not in ("api_key", "func") and not callable(v)}
    cfg["api_key_set"] = bool(ns.api_key)
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in cfg.items()}


def run_bench(ns: argparse.Namespace) -> int:
    from phaselab.bench import bench_report as report
    from phaselab.bench.client import ClientConfig, first_model
    from phaselab.bench.client_metrics import parse_goodput
    from phaselab.bench.bench_run import RunSettings, plan_from, run_specs
    from phaselab.workload.arrivals import workload_seeds
    from phaselab.workload.lengths import LengthDist, WorkloadError
    from phaselab.workload.prompts import PromptBuilder, build_specs, load_bench_tokenizer

    def fail(msg: str) -> int:
        print(f"phaselab bench: error: {msg}", file=sys.stderr)
        return 2

    try:
        percentiles = _percentiles(ns.percentiles)
        goodput = parse_goodput(ns.goodput) if ns.goodput else None
        self_timed = ns.workload in ("trace", "interference")
        plan = plan_from(ns.concurrency, ns.request_rate, ns.burstiness, ns.max_concurrency, self_timed, ns.time_scale)
        for spec in (ns.input_len, ns.output_len, ns.suffix_len):
            LengthDist.parse(spec)
        extra_body = json.loads(ns.extra_body) if ns.extra_body else {}
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
    except json.JSONDecodeError as e:
        return fail(f"--extra-body is not JSON ({e.msg})")
    except (ValueError, WorkloadError) as e:
        return fail(str(e))

    async def resolve_model() -> str:
        return ns.model or await first_model(ns.base_url, ns.api_key)

    try:
        model = asyncio.run(resolve_model())
    except Exception as e:
        return fail(f"cannot reach {ns.base_url} to list its models ({type(e).__name__}: {e}); is the server up?")

    rng = workload_seeds(ns.seed)[0]  # [1]: the arrival gaps (runner)
    needs_builder = ns.workload != "trace" or _trace_needs_tokenizer(ns.trace)
    try:
        builder = PromptBuilder(load_bench_tokenizer(ns.tokenizer), ns.endpoint) if needs_builder or ns.tokenizer \
            else None
        specs, warmups = build_specs(ns, builder, rng)
    except (WorkloadError, OSError) as e:
        return fail(str(e))

    client_cfg = ClientConfig(
        base_url=ns.base_url, model=model, endpoint=ns.endpoint, api_key=ns.api_key, include_usage=ns.include_usage,
        ignore_eos=ns.ignore_eos, temperature=ns.temperature, request_timeout_s=ns.request_timeout,
        extra_body=extra_body,
    )
    settings = RunSettings(plan=plan, seed=ns.seed, percentiles=percentiles, goodput=goodput,
                           stall_factor=ns.stall_factor, scrape_metrics=ns.scrape_metrics,
                           progress=not ns.disable_progress)
    anchor = report.clock_anchor()
    print(f"phaselab bench: {len(specs)} {ns.workload} requests to {ns.base_url} ({ns.endpoint}, model {model}); "
          f"{plan.describe()}", file=sys.stderr)
    try:
        outcome = asyncio.run(run_specs(client_cfg, specs, warmups, settings))
    except KeyboardInterrupt:
        return 130
    interrupted = outcome.interrupted
    result = {"workload": ns.workload, "endpoint": ns.endpoint, "model": model, "base_url": ns.base_url,
              **outcome.result}
    report.print_summary(result)
    for note in outcome.notes:
        print(f"note: {note}", file=sys.stderr)

    lines = [report.request_line(rec, m) for rec, m in
             zip(outcome.records, outcome.warmup_results + outcome.results)]
    if ns.result_json:
        report.write_json(ns.result_json, result)
        if outcome.metrics_before is not None and outcome.metrics_after is not None and not ns.record:
            stem = os.path.splitext(ns.result_json)[0]
            for name, text in (("before", outcome.metrics_before), ("after", outcome.metrics_after)):
                with open(f"{stem}.server_metrics_{name}.prom", "w", encoding="utf-8") as f:
                    f.write(text)
    if ns.requests_jsonl:
        report.write_jsonl(ns.requests_jsonl, lines)
    if ns.record:
        config = report.client_run_config(
            _bench_config(ns), {"base_url": ns.base_url, "endpoint": ns.endpoint, "model": model}, anchor)
        report.write_run_dir(ns.record, config, lines, result, outcome.metrics_before, outcome.metrics_after)
        print(f"client run directory written to {ns.record}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if result["completed"] > 0 else 1


def _trace_needs_tokenizer(path: str | None) -> bool:
    """A trace needs the tokenizer unless every line carries its prompt text."""
    if not path or not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line) if line.strip() else {"prompt": ""}
            except json.JSONDecodeError:
                return False  # trace_workload reports the bad line
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                return True
    return False


def main(argv: list[str] | None = None) -> int:
    """`python -m phaselab.bench.bench_cli ...`, until the lead wires `phaselab bench`."""
    parser = argparse.ArgumentParser(prog="phaselab")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
