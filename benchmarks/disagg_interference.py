"""Prefill/decode interference: colocated prefill-first vs colocated chunked vs disaggregated 1P1D.

    python benchmarks/disagg_interference.py [--streams 4] [--stream-tokens 96] [--long-prompts 3]
        [--long-len 1024] [--gap 4] [--dtype bfloat16] [--transports ray-object-store ray-actor]
        [--repeat 3] [--out benchmarks/results/disagg_interference.json] [--record DIR]

The `interference` workload, offline with arrival times: `--streams` short requests start at t=0
and decode `--stream-tokens` tokens each; while they stream, `--long-prompts` prompts of
`--long-len` tokens arrive every `--gap` seconds and ask for a few tokens. A request's arrival
time is its scheduled time (the driver adds it at the first step boundary after it), so TTFT
counts the wait behind a running iteration in every mode (as queue time: the prompts are token
ids, so tokenization takes no time).

Modes (same checkpoint, loaded once; all on this machine's cores; prefix caching off so repeats
do not hit earlier runs' blocks; engines and workers built once and reused across repeats, which
run the modes interleaved):
  colocated-prefill-first   one engine, all cores, a long prompt's prefill is one iteration: streams stall
  colocated-chunked         one engine, all cores, --chunk-budget tokens per iteration
  disagg-1p1d[-<transport>] a prefill worker and a decode worker (Ray actors, --threads each), KV moved

Per mode: TTFT p50/p99 (all requests, and the long prompts alone), ITL p99 and max stall (the
longest gap between two tokens of a stream), throughput (output tokens / makespan), and for
disagg the KV transfer: bytes, time, bandwidth (bytes / transfer time per request, and in sum),
transfer queue and decode admission wait, per-worker busy fraction. Few requests: p99 is close
to the max. Times drift on a shared machine; compare modes within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from phaselab.engine_args import EngineArgs  # noqa: E402
from phaselab.core.sampling_params import SamplingParams  # noqa: E402
from phaselab.core.timing import RequestMetrics  # noqa: E402
from phaselab.engine.engine import LLMEngine  # noqa: E402
from phaselab.model.loader import load_checkpoint  # noqa: E402
from phaselab.workload.driver import Arrival, run_arrivals  # noqa: E402
from phaselab.workload.interference import InterferenceParams  # noqa: E402
from tests._model_helpers import long_text  # noqa: E402


def interference(a: argparse.Namespace) -> InterferenceParams:
    return InterferenceParams(num_streams=a.streams, stream_input_len=a.stream_len, stream_output_len=a.stream_tokens,
                              num_long_prompts=a.long_prompts, long_input_len=a.long_len, long_output_len=a.long_tokens,
                              long_start_s=a.first_long, long_interval_s=a.gap)


def workload(tokenizer: Any, p: InterferenceParams) -> list[Arrival]:
    """The interference workload with prompts cut from real text (distinct: no prefix-cache hits)."""
    ids = tokenizer.encode(long_text(80))
    assert len(ids) > p.long_input_len + 200 * p.num_long_prompts, "need more text"
    out = [Arrival(f"stream-{i}", ids[37 * i: 37 * i + p.stream_input_len], p.stream_output_len, "stream", at_s=0.0)
           for i in range(p.num_streams)]
    for k in range(p.num_long_prompts):
        start = 500 + 211 * k  # distinct prompts: no prefix-cache hits between them
        out.append(Arrival(f"long-{k}", ids[start: start + p.long_input_len], p.long_output_len, "long",
                           at_s=p.long_arrival_s(k)))
    return out


def drive(engine: Any, arrivals: list[Arrival]) -> float:
    """run_arrivals (each request added at the first step boundary after its arrival time, the wait
    counted as queueing); returns the makespan in seconds (first arrival -> last finish)."""
    start_ns = run_arrivals(engine, arrivals).start_ns
    last = max(m.finished_ns or 0 for m in engine.finished_requests)
    return (last - start_ns) / 1e9


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: list[RequestMetrics], makespan_s: float) -> dict[str, Any]:
    streams = [m for m in records if m.request_id.startswith("stream")]
    longs = [m for m in records if m.request_id.startswith("long")]
    ttft = [m.ttft_s for m in records if m.ttft_s is not None]
    ttft_long = [m.ttft_s for m in longs if m.ttft_s is not None]
    itl = [g for m in streams for g in m.itl_s]
    n_out = sum(m.num_output_tokens for m in records)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "finish_reasons": sorted({m.finish_reason or "?" for m in records}),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "ttft_long_p50_s": pct(ttft_long, 0.5), "ttft_long_p99_s": pct(ttft_long, 0.99),
        "ttft_stream_p50_s": pct([m.ttft_s for m in streams if m.ttft_s is not None], 0.5),
        "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99), "max_stall_s": max(itl) if itl else None,
        "output_tokens": n_out, "makespan_s": makespan_s, "throughput_tok_s": n_out / makespan_s,
        "long_prompt_ttft_components_mean_s": _mean_components(longs),
    }
    moved = [m for m in records if m.kv_transfer_bytes and m.transfer_s]
    if moved:
        total_bytes = sum(m.kv_transfer_bytes for m in moved)  # type: ignore[misc]
        total_s = sum(m.transfer_s for m in moved)  # type: ignore[misc]
        bw = [m.kv_transfer_bytes / m.transfer_s for m in moved]  # type: ignore[operator]
        big = [m.kv_transfer_bytes / m.transfer_s for m in moved if m.num_prompt_tokens >= 512]  # type: ignore[operator]
        out["transfer"] = {
            "num_transfers": len(moved), "bytes_total": total_bytes, "seconds_total": total_s,
            "bandwidth_bytes_per_s_sum": total_bytes / total_s,
            "bandwidth_bytes_per_s_p50": pct(bw, 0.5),
            "bandwidth_bytes_per_s_long_prompts_p50": pct(big, 0.5),
            "transfer_s_p50": pct([m.transfer_s for m in moved], 0.5),  # type: ignore[misc]
            "transfer_s_max": max(m.transfer_s for m in moved),  # type: ignore[type-var]
            "effective_bandwidth_bytes_per_s_p50": pct([m.kv_transfer_bytes * 1e9 / (m.kv_transfer_end_ns
                                                        - m.first_token_sampled_ns) for m in moved], 0.5),  # type: ignore
            "sampled_to_transfer_end_s_p50": pct([(m.kv_transfer_end_ns - m.first_token_sampled_ns) / 1e9
                                                  for m in moved], 0.5),  # type: ignore[operator]
            "decode_admission_wait_s_p50": pct([m.decode_admission_wait_s for m in moved
                                                if m.decode_admission_wait_s is not None], 0.5),
            "decode_admission_wait_s_max": max((m.decode_admission_wait_s for m in moved
                                                if m.decode_admission_wait_s is not None), default=None),
        }
    return out


def _mean_components(records: list[RequestMetrics]) -> dict[str, float]:
    comps = [m.ttft_components() for m in records if m.ttft_components()]
    return {k: statistics.mean(c[k] for c in comps) for k in comps[0]} if comps else {}


def colocated_engine(ckpt: Any, a: argparse.Namespace, policy: str) -> LLMEngine:
    budget = a.chunk_budget if policy == "chunked" else None
    args = EngineArgs(dtype=a.dtype, kv_cache_memory=a.kv_cache_memory, policy=policy, max_num_batched_tokens=budget,
                      num_threads=os.cpu_count(), enable_prefix_caching=False)
    eng = LLMEngine(args, checkpoint=ckpt)
    warm(eng)
    return eng


def disagg_engine(ckpt: Any, a: argparse.Namespace) -> Any:
    from phaselab.disagg import DisaggConfig
    from phaselab.disagg.router import DisaggEngine

    args = EngineArgs(dtype=a.dtype, kv_cache_memory=a.kv_cache_memory, mode="disagg", prefill_workers=1,
                      decode_workers=1, prefill_threads=a.threads, decode_threads=a.threads,
                      enable_prefix_caching=False)
    eng = DisaggEngine(args, DisaggConfig(poll_interval_s=0.02), checkpoint=ckpt)
    warm(eng)
    return eng


def run_colocated(eng: LLMEngine, arrivals: list[Arrival], policy: str, record: str | None) -> dict[str, Any]:
    makespan = drive(eng, arrivals)
    if record:
        eng.write_record(record)
    out = {"mode": f"colocated-{policy}", "threads": torch.get_num_threads(),
           "budget": eng.scheduler_config.max_num_batched_tokens, **summarize(eng.finished_requests, makespan),
           "busy_fraction_in_run": _busy_in_run(eng)}
    forget(eng)
    return out


def run_disagg(eng: Any, arrivals: list[Arrival], a: argparse.Namespace, transport: str,
               record: str | None) -> dict[str, Any]:
    import ray

    for w in eng.workers.values():
        if w.role == "prefill":
            ray.get(w.actor.set_kv_transport.remote(transport), timeout=30)
    makespan = drive(eng, arrivals)
    if record:
        eng.write_record(record)
    out = {"mode": f"disagg-1p1d-{transport}", "threads_per_worker": a.threads,
           **summarize(eng.finished_requests, makespan), "busy_fraction_in_run": _busy_in_run(eng)}
    forget(eng)
    return out


def forget(eng: Any) -> None:
    eng.finished_requests.clear()
    eng.iterations.clear()


def _busy_in_run(eng: Any) -> dict[str, float]:
    recs = [m for m in eng.finished_requests if not m.request_id.startswith("warm")]
    start = min(m.arrived_ns for m in recs)
    end = max(m.finished_ns for m in recs)
    busy: dict[str, int] = {}
    for it in eng.iterations:
        if it.start_ns >= start and it.end_ns <= end:
            busy[it.worker] = busy.get(it.worker, 0) + it.end_ns - it.start_ns
    return {w: b / (end - start) for w, b in busy.items()}


def warm(eng: Any) -> None:
    """One small request end to end (first-call costs out of the measurement), then forget it."""
    eng.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                    request_id="warm-0")
    while eng.has_unfinished_requests():
        eng.step()
    forget(eng)


SUMMARY_KEYS = ("ttft_p50_s", "ttft_p99_s", "ttft_long_p50_s", "ttft_long_p99_s", "itl_p50_s", "itl_p99_s",
                "max_stall_s", "throughput_tok_s", "makespan_s")
TRANSFER_KEYS = ("bandwidth_bytes_per_s_sum", "bandwidth_bytes_per_s_long_prompts_p50", "transfer_s_p50",
                 "sampled_to_transfer_end_s_p50", "decode_admission_wait_s_p50")


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median (and min/max) of the headline figures over the repeats of one mode."""
    out: dict[str, Any] = {"repeats": len(runs)}
    rows = [(k, [r[k] for r in runs]) for k in SUMMARY_KEYS]
    rows += [("transfer_" + k, [r["transfer"][k] for r in runs]) for k in TRANSFER_KEYS if "transfer" in runs[0]]
    for key, values in rows:
        values = [v for v in values if v is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-len", type=int, default=64, help="prompt tokens of each stream")
    p.add_argument("--stream-tokens", type=int, default=96, help="tokens each stream decodes")
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--first-long", type=float, default=2.0, help="arrival of the first long prompt (s)")
    p.add_argument("--gap", type=float, default=4.0, help="seconds between long prompts")
    p.add_argument("--chunk-budget", type=int, default=256, help="colocated chunked: tokens per iteration")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--threads", type=int, default=1, help="disagg: torch threads per worker")
    p.add_argument("--transports", nargs="+", default=["ray-object-store", "ray-actor"])
    p.add_argument("--modes", nargs="+", default=["prefill-first", "chunked", "disagg"])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "disagg_interference.json"))
    p.add_argument("--record", default=None, help="write one run directory per mode and repeat under DIR")
    p.add_argument("--repeat", type=int, default=3, help="runs of every mode, interleaved (medians reported)")
    a = p.parse_args()

    ckpt = load_checkpoint(None, getattr(torch, a.dtype))
    arrivals = workload(ckpt.tokenizer, interference(a))
    colocated = {m: colocated_engine(ckpt, a, m) for m in a.modes if m != "disagg"}
    disagg = disagg_engine(ckpt, a) if "disagg" in a.modes else None
    results: list[dict[str, Any]] = []
    try:
        for rep in range(a.repeat):  # modes interleaved, so drift on a shared machine hits each alike
            for mode in a.modes:
                runs = [(f"disagg-1p1d-{t}", t) for t in a.transports] if mode == "disagg" else [
                    (f"colocated-{mode}", mode)]
                for name, what in runs:
                    record = os.path.join(a.record, f"{name}-{rep}") if a.record else None
                    print(f"[{rep + 1}/{a.repeat}] {name} ...", file=sys.stderr, flush=True)
                    r = (run_disagg(disagg, arrivals, a, what, record) if mode == "disagg"
                         else run_colocated(colocated[mode], arrivals, what, record))
                    r["repeat"] = rep
                    results.append(r)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()
                                      if k in SUMMARY_KEYS}), file=sys.stderr)
    finally:
        if disagg is not None:
            disagg.shutdown()
    modes = list(dict.fromkeys(r["mode"] for r in results))
    doc = {
        "benchmark": "disagg_interference",
        "workload": {k: v for k, v in vars(a).items() if k not in ("out", "record")},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "torch": torch.__version__},
        "summary": {m: summary([r for r in results if r["mode"] == m]) for m in modes},
        "results": results,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
