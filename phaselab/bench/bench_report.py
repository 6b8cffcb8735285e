"""What a run leaves behind: progress bar, summary table, result JSON, per-request JSONL, run directory,
and the server's /metrics before/after with their difference.

Client run directory (docs/bench.md; the layout of docs/run-directory.md, read by
`phaselab.obs.rundir.read_run_dir`):

    DIR/config.json                  {"format": "phaselab-run", "version": 1, "source": "client", ...}
    DIR/requests.jsonl               one {"record": "request", ...} per request, warm-ups flagged
    DIR/iterations.jsonl             empty: a client sees no scheduler iterations
    DIR/result.json                  the summary (vLLM bench serve keys where the metric is the same)
    DIR/server_metrics_before.prom   with --scrape-metrics
    DIR/server_metrics_after.prom
    DIR/server_metrics_diff.json

In requests.jsonl the phase-record fields hold what the client observed: `arrived_ns` is when the
request was sent, `token_sent_ns[i]` when content chunk i was received, `finished_ns` when the
response completed; the client-only fields and the client's derived values follow.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from phaselab.bench.client import STATUS_FAILED, STATUS_INCOMPLETE, RequestRecord
from phaselab.bench.client_metrics import RequestResult, percentile_key


# -- progress ------------------------------------------------------------------------------------------------
class Progress:
    """A live bar on stderr (rich): done/total, failures, elapsed. A no-op when disabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None
        self._failed = 0

    def start(self, total: int, description: str) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._failed = 0
        self._progress = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn(),
            console=Console(file=sys.stderr), transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, failed=0)

    def advance(self, rec: RequestRecord) -> None:
        if self._progress is None:
            return
        if rec.exception is not None or (rec.status_code is not None and rec.status_code != 200):
            self._failed += 1
        self._progress.update(self._task, advance=1, failed=self._failed)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# -- the summary table -------------------------------------------------------------------------------------------
def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of the terminal summary; section headers have an empty value."""
    rows: list[tuple[str, str]] = [
        ("Successful requests", _fmt(result["completed"])),
        ("Failed requests", _fmt(result["failed"])),
        ("Incomplete requests", _fmt(result["incomplete"])),
        ("Benchmark duration (s)", _fmt(result["duration"])),
        ("Total input tokens", _fmt(result["total_input_tokens"])),
        ("Total generated tokens", _fmt(result["total_output_tokens"])
         + (f"  ({result['output_tokens_from_chunks']} counted from chunks: no usage)"
            if result.get("output_tokens_from_chunks") else "")),
        ("Request throughput (req/s)", _fmt(result["request_throughput"])),
    ]
    if result.get("request_goodput") is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in (result.get("goodput_slos_ms") or {}).items())
        rows.append((f"Request goodput (req/s) [{slos} ms]", _fmt(result["request_goodput"])))
    rows += [
        ("Output token throughput (tok/s)", _fmt(result["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(result["total_token_throughput"])),
    ]
    sections = [
        ("ttft", "TTFT", "Time to first token"),
        ("tpot", "TPOT", "Time per output token (excl. 1st)"),
        ("itl", "ITL", "Inter-token latency (every gap)"),
        ("e2el", "E2EL", "End-to-end latency"),
        ("max_gap", "max gap", f"Stalls (per stream; stall = gap > {result['stall_factor']:g} x its median)"),
    ]
    for stem, short, header in sections:
        rows.append((header, ""))
        rows.append((f"Mean {short} (ms)", _fmt(result.get(f"mean_{stem}_ms"))))
        rows.append((f"Median {short} (ms)", _fmt(result.get(f"median_{stem}_ms"))))
        for p in result["percentiles"]:
            if p == 50:
                continue  # the median row says it
            rows.append((f"{percentile_key(p).upper()} {short} (ms)", _fmt(result.get(f"{percentile_key(p)}_{stem}_ms"))))
        if stem == "max_gap":
            rows.append(("Stalled gaps (all streams)", _fmt(result["total_stalls"])))
    if result.get("errors_summary"):
        rows.append(("Errors (count)", ""))
        for msg, n in list(result["errors_summary"].items())[:5]:
            rows.append((f"  {msg[:70]}", str(n)))
    return rows


def print_summary(result: dict[str, Any], file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="phaselab bench", show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in summary_rows(result):
        if value == "":
            table.add_section()
            table.add_row(f"[bold]{label}[/bold]", "")
        else:
            table.add_row(label, value)
    console = Console(file=file or sys.stdout)
    console.print(table)
    groups = result.get("groups")
    if groups:
        tg = Table(title="Per group", title_justify="left")
        for col in ("group", "ok", "failed", "incomplete", "median TTFT (ms)", "median ITL (ms)", "P99 ITL (ms)",
                    "max gap (ms)", "stalls"):
            tg.add_column(col, justify="right")
        for name, g in groups.items():
            tg.add_row(name, str(g["completed"]), str(g["failed"]), str(g["incomplete"]), _fmt(g["median_ttft_ms"], 1),
                       _fmt(g["median_itl_ms"], 1), _fmt(g.get("p99_itl_ms"), 1), _fmt(g["max_itl_ms"], 1),
                       str(g["total_stalls"]))
        console.print(tg)
    inter = result.get("interference")
    if inter:
        t2 = Table(title="Interference: streams' worst gap while each long prompt waited for its first token",
                   title_justify="left")
        for col in ("long prompt", "status", "TTFT (ms)", "max stream gap (ms)", "streams stalled"):
            t2.add_column(col, justify="right")
        for row in inter["long_prompts"]:
            t2.add_row(row["request_id"], row["status"], _fmt(row["ttft_ms"], 1), _fmt(row["max_stream_gap_ms"], 1),
                       str(row["num_streams_stalled"]))
        console.print(t2)
        print(f"median stream gap outside long prefills: "
              f"{_fmt(inter['median_stream_gap_outside_long_prefills_ms'], 1)} ms", file=file or sys.stdout)


# -- per-request lines -------------------------------------------------------------------------------------------
def request_line(rec: RequestRecord, m: RequestResult) -> dict[str, Any]:
    """One requests.jsonl object: the phase-record fields as the client saw them, then the rest."""
    from phaselab.core.timing import RequestMetrics
    from phaselab.obs.rundir import request_to_json

    finished = rec.end_ns if m.status != STATUS_INCOMPLETE else None
    core = RequestMetrics(
        arrived_ns=rec.sent_ns or rec.scheduled_ns, token_sent_ns=list(m.token_ns), finished_ns=finished,
        finish_reason=m.finish_reason or ("error" if m.status == STATUS_FAILED else None),
        request_id=rec.request_id, num_prompt_tokens=m.num_prompt_tokens or 0,
        num_output_tokens=m.num_output_tokens, worker="client", error=m.error,
    )
    line = request_to_json(core)
    line.update({
        "ttft_components_s": {},  # a client cannot tile TTFT into server phases
        "source": "client",
        "status": m.status,
        "group": m.group,
        "warmup": m.warmup,
        "server_request_id": m.server_request_id,
        "scheduled_ns": rec.scheduled_ns,
        "sent_ns": rec.sent_ns,
        "headers_ns": rec.headers_ns,
        "end_ns": rec.end_ns,
        "http_status": rec.status_code,
        "num_prompt_tokens_requested": m.num_prompt_tokens_requested,
        "max_tokens": rec.max_tokens,
        "output_tokens_source": m.output_tokens_source,
        "num_chunks": m.num_chunks,
        # the client's derived values (seconds), overriding the phase record's where both exist
        "start_s": m.start_s,
        "client_queue_s": m.client_queue_s,
        "ttft_s": m.ttft_s,
        "itl_s": m.itl_s,
        "tpot_s": m.tpot_s,
        "e2e_s": m.e2e_s,
        "max_gap_s": m.max_gap_s,
        "median_gap_s": m.median_gap_s,
        "num_stalls": m.num_stalls,
        "stall_s": m.stall_s,
    })
    return line


def write_jsonl(path: str | Path, lines: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for obj in lines:
            f.write(json.dumps(obj, separators=(",", ":"), default=str) + "\n")


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")


# -- server /metrics before and after ----------------------------------------------------------------------------
_CUMULATIVE = ("counter", "histogram", "summary", "gaugehistogram")


def _samples(text: str) -> dict[str, tuple[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue  # a timestamp, not a measurement
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            ftype = family.type
            if ftype in ("unknown", "untyped") and s.name.endswith(("_total", "_count", "_sum", "_bucket")):
                ftype = "counter"  # an untyped series named like a cumulative one
            out[f"{s.name}{{{labels}}}" if labels else s.name] = (ftype, float(s.value))
    return out


def metrics_diff(before: str, after: str) -> dict[str, Any]:
    """Counters and histogram/summary series: after - before. Gauges: both values.
    `histogram_means`: delta(_sum) / delta(_count) per series, i.e. the server-side mean over the run."""
    b, a = _samples(before), _samples(after)
    counters: dict[str, float] = {}
    gauges: dict[str, dict[str, float | None]] = {}
    for key, (ftype, value) in a.items():
        prev = b.get(key, (ftype, 0.0 if ftype in _CUMULATIVE else math.nan))[1]
        if ftype in _CUMULATIVE:
            counters[key] = value - prev
        else:
            gauges[key] = {"before": None if math.isnan(prev) else prev, "after": value}
    means: dict[str, float] = {}
    for key, delta in counters.items():
        name, brace, labels = key.partition("{")
        if name.endswith("_count") and delta > 0:
            sum_key = name[: -len("_count")] + "_sum" + brace + labels
            if sum_key in counters:
                means[name[: -len("_count")] + brace + labels] = counters[sum_key] / delta
    return {"counters": counters, "gauges": gauges, "histogram_means": means}


# -- the run directory --------------------------------------------------------------------------------------------
def client_run_config(bench_config: dict[str, Any], target: dict[str, Any], clock_anchor: dict[str, int]) -> dict[str, Any]:
    """config.json of a client run: the run-directory header plus what was measured and how."""
    import phaselab
    from phaselab.obs.rundir import run_config

    return run_config({
        "source": "client",
        "target": target,
        "bench": bench_config,
        "clock": {"name": "time.monotonic_ns", **clock_anchor},
        "versions": {"phaselab": phaselab.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
    })


def write_run_dir(
    path: str | Path,
    config: dict[str, Any],
    lines: Sequence[dict[str, Any]],
    result: dict[str, Any],
    metrics_before: str | None = None,
    metrics_after: str | None = None,
) -> None:
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "config.json", config)
    write_jsonl(root / "requests.jsonl", lines)
    (root / "iterations.jsonl").write_text("", encoding="utf-8")
    write_json(root / "result.json", result)
    if metrics_before is not None and metrics_after is not None:
        (root / "server_metrics_before.prom").write_text(metrics_before, encoding="utf-8")
        (root / "server_metrics_after.prom").write_text(metrics_after, encoding="utf-8")
        write_json(root / "server_metrics_diff.json", metrics_diff(metrics_before, metrics_after))


def clock_anchor() -> dict[str, int]:
    """monotonic_ns and unix time_ns read together: maps the run's stamps to wall-clock time."""
    return {"monotonic_ns": time.monotonic_ns(), "unix_ns": time.time_ns()}

