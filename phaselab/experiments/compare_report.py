"""The report of `phaselab compare`: side-by-side tables, the top diagnosis of each configuration,
and the timelines of every approach on one time axis.

    OUT/report.html      self-contained page (tables, diagnoses, interactive timelines, the PNG inline)
    OUT/summary.md       the same tables and diagnoses in markdown (summary.txt: as on the terminal)
    OUT/summary.json     every number of the tables, per configuration and workload
    OUT/timeline.png     the interference runs of every configuration, one shared time axis
    OUT/timeline.html    the same, interactive
    OUT/<workload>-<configuration>/   run directories, each with diagnosis.md/.html/.json
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phaselab.analysis import fmt
from phaselab.analysis.diagnose import Diagnosis
from phaselab.analysis.doc import Bullets, Doc, Heading, Para, RawHtml, Table, render_html, render_markdown, render_text
from phaselab.analysis.timeline import load_timeline, render_png, render_timeline_page, timeline_fragment, timeline_head

if TYPE_CHECKING:
    from phaselab.experiments.compare import CompareResult, ConfigResult

WORKLOADS = ("load", "interference", "sweep")  # "load": compare --simulate only


def _busy(d: Diagnosis) -> str:
    pools: dict[str, list[float]] = {}
    for w, f in d.summary.busy.items():
        pools.setdefault(_role_of(d, w), []).append(f)
    return ", ".join(f"{role} {fmt.pct(sum(v) / len(v), 0)}" for role, v in pools.items()) or "—"


def _role_of(d: Diagnosis, worker: str) -> str:
    if d.disagg:
        for p in d.disagg.pools:
            if worker in p.workers:
                return p.role
    return "engine"


def metric_rows(diags: list[Diagnosis], workload: str) -> list[tuple[str, list[str], list[Any]]]:
    """(label, formatted cells, raw values) per metric, one cell per configuration."""
    rows: list[tuple[str, list[str], list[Any]]] = []

    def add(label: str, values: list[Any], f: Any) -> None:
        rows.append((label, [f(v) for v in values], values))

    s = [d.summary for d in diags]
    add("TTFT p50", [x.ttft_p50_s for x in s], fmt.s)
    add("TTFT p99", [x.ttft_p99_s for x in s], fmt.s)
    add("TTFT: queue / prefill / transfer / other",
        [(x.ttft_shares.get("queue", 0), x.ttft_shares.get("prefill", 0), x.ttft_shares.get("transfer", 0),
          x.ttft_shares.get("overhead", 0)) for x in s],
        lambda v: " / ".join(fmt.pct(p, 0) for p in v))
    if workload == "interference":
        long_ttft = [_mean_ttft(d, "long-") for d in diags]
        add("long prompts: TTFT (mean)", long_ttft, fmt.s)
        add("streams: longest gap", [_max_gap(d, "stream-") for d in diags], fmt.s)
    add("ITL p50", [x.itl_p50_s for x in s], fmt.s)
    add("ITL p99", [x.itl_p99_s for x in s], fmt.s)
    add("max stall", [x.max_stall_s for x in s], lambda v: fmt.s(v) if v else "none")
    add("stalls (> 3x pace)", [x.num_stalls for x in s], str)
    add("output throughput", [x.output_throughput for x in s], lambda v: f"{fmt.num(v, 1)} tok/s")
    add("KV transferred", [x.transfer_bytes for x in s], lambda v: fmt.nbytes(v) if v else "—")
    add("KV transfer bandwidth", [x.transfer_bandwidth for x in s], fmt.rate)
    add("busy fraction", [_busy(d) for d in diags], str)
    add("top cause", [(d.top.cause, d.top.share) if d.top else None for d in diags],
        lambda v: f"{v[0]} ({fmt.pct(v[1], 0)})" if v else "—")
    return rows


def _mean_ttft(d: Diagnosis, prefix: str) -> float | None:
    v = [a.ttft_s for a in d.account.requests if a.request_id.startswith(prefix) and a.ttft_s is not None]
    return sum(v) / len(v) if v else None


def _max_gap(d: Diagnosis, prefix: str) -> float | None:
    from phaselab.obs.rundir import read_run_dir

    if not d.path:
        return None
    gaps = [g for m in read_run_dir(d.path).requests if m.request_id.startswith(prefix) for g in m.itl_s]
    return max(gaps) if gaps else None


def sweep_rows(results: list[ConfigResult]) -> tuple[list[str], list[list[str]], dict[str, Any]]:
    from phaselab.obs.rundir import read_run_dir

    per: dict[str, dict[int, float | None]] = {}
    transfer: dict[str, dict[int, float | None]] = {}
    lens: set[int] = set()
    for r in results:
        path = r.runs.get("sweep")
        if path is None:
            continue
        run = read_run_dir(path)
        per[r.config.name] = {m.num_prompt_tokens: m.ttft_s for m in run.requests}
        transfer[r.config.name] = {m.num_prompt_tokens: m.transfer_s for m in run.requests}
        lens |= set(per[r.config.name])
    names = [r.config.name for r in results if r.config.name in per]
    rows = [[str(n)] + [fmt.s(per[c].get(n)) for c in names] for n in sorted(lens)]
    slopes = []
    for r in results:
        d = r.diagnoses.get("sweep")
        fit = d.prefill.fit if d and d.prefill else None
        slopes.append(f"{fit.slope * 1e3:.3f} ms/token (R^2 {fit.r2:.2f})" if fit else "—")
    rows.append(["prefill slope"] + slopes[:len(names)])
    if any(v is not None for c in transfer.values() for v in c.values()):
        rows += [[f"{n}: KV transfer"] + [fmt.s(transfer[c].get(n)) for c in names] for n in sorted(lens)]
    return names, rows, {"ttft_s": per, "transfer_s": transfer}


def engine_paths(result: CompareResult) -> dict[str, str]:
    """What the header says of the runs: the weight path the engines ran and why (the first colocated
    run's config.json), and the ceilings every floor and efficiency is judged against (each
    configuration's diagnoses: the disaggregated workers' differ where they run on fewer threads).
    Empty strings for a simulated compare or a run without them."""
    out = {"weights": "", "ceilings": ""}
    first = next((r for r in result.results if r.config.mode != "disagg" and r.runs), None)
    if first is None or result.plan.simulation is not None:
        return out
    w = "interference" if "interference" in first.runs else next(iter(first.runs))
    try:
        cfg = json.loads((Path(first.runs[w]) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    lin = cfg.get("linear") or {}
    if lin.get("path"):
        formats = ", ".join(f"{f} x {n}" for f, n in (lin.get("formats") or {}).items())
        what = ("the GGUF's quantized blocks as stored, read by the native kernels" if lin["path"] == "q" else
                f"dense {lin['path']} weights through the native kernels" if lin["path"] in ("bf16", "fp32") else
                "dense weights through torch's matmuls")
        size = f", {fmt.nbytes(lin['weight_bytes'])} per decode step" if lin.get("weight_bytes") else ""
        out["weights"] = (f"weights: path {lin['path']}: {what} ({formats}{size}), chosen at start-up as `phaselab "
                          f"serve --weights auto` chooses it: {lin.get('reason', 'reason not recorded')}; dtype "
                          f"{lin.get('dtype_reason') or cfg.get('dtype')}")
    seen: dict[tuple[float, float, str], list[str]] = {}  # each configuration's, in order (the workers' threads)
    for r in result.results:
        for d in r.diagnoses.values():
            c = d.ceilings
            labels = seen.setdefault((c.bandwidth_bytes_per_s, c.gemm_flops_per_s, c.label()), [])
            if r.config.label not in labels:
                labels.append(r.config.label)
    parts = [f"{fmt.rate(bw)} read, {fmt.rate(gemm, 'FLOP/s')} GEMM, {label}" for bw, gemm, label in seen]
    if parts:
        out["ceilings"] = "ceilings (every floor and efficiency below): " + parts[0] + "".join(
            f"; {', '.join(labels)}: {part}" for part, labels in list(zip(parts, seen.values()))[1:])
    return out


def compare_doc(result: CompareResult, with_timelines: bool = False, png_b64: str | None = None,
                timelines: list[dict[str, Any]] | None = None) -> Doc:
    p = result.plan
    inter = p.interference
    sim = p.simulation
    if sim is None:
        doc = Doc("phaselab compare: prefill-first vs chunked prefill vs disaggregated serving")
        engine = engine_paths(result)
        doc.add(Para(
            f"Bundled model, {p.dtype}, KV cache {p.kv_cache_memory}; every configuration runs the same two workloads. "
            f"**interference**: {inter.num_streams} streams ({inter.stream_input_len}-token prompts, "
            f"{inter.stream_output_len} tokens each) decode while {inter.num_long_prompts} prompts of "
            f"{inter.long_input_len} tokens arrive (when every stream has {inter.long_arrival_tokens(0)}, "
            f"{inter.long_arrival_tokens(1)}, ... tokens). **sweep**: one request at a time with inputs of "
            f"{', '.join(map(str, p.sweep_lens))} tokens ({p.sweep_output_len} output tokens). "
            f"Wall time {fmt.s(result.wall_s)}."))
        if engine["weights"] or engine["ceilings"]:
            doc.add(Bullets([x for x in (engine["weights"], engine["ceilings"]) if x]))
    else:
        doc = Doc(f"phaselab compare (simulated): prefill-first vs chunked prefill vs disaggregated serving, "
                  f"{sim.model} on {sim.num_gpus} x {sim.hardware}")
        rate = "all at once" if sim.request_rate == float("inf") else f"{sim.request_rate:g} req/s"
        doc.add(Para(
            f"Simulated with phaselab's own scheduler and router on a virtual clock (docs/simulator.md): "
            f"{sim.model}, {sim.dtype}, {sim.num_gpus} x {sim.hardware}, TP{sim.tp} per engine, KV cache from device "
            f"memory. Every configuration runs the same three workloads. **load**: {sim.num_prompts} requests, inputs "
            f"{sim.input_len}, outputs {sim.output_len} tokens, open loop at {rate} "
            f"({'Poisson' if sim.burstiness == 1 else f'gamma, burstiness {sim.burstiness:g}'}, seed {sim.seed}). "
            f"**interference**: {inter.num_streams} streams ({inter.stream_input_len}-token prompts, "
            f"{inter.stream_output_len} tokens each) decode while {inter.num_long_prompts} long prompts arrive, "
            f"from {fmt.s(sim.long_start_s)} every {fmt.s(sim.long_interval_s)}. **sweep**: one request at a time "
            f"with inputs of {', '.join(map(str, p.sweep_lens))} tokens. "
            f"Simulation wall time {fmt.s(result.wall_s)}."))
    for n in result.notes:
        doc.add(Para(n, "note"))
    configs = [r for r in result.results]
    labels = [r.config.label for r in configs]
    for w in WORKLOADS:
        diags = [r.diagnoses[w] for r in configs if w in r.diagnoses]
        if not diags:
            continue
        doc.add(Heading(f"{w}: side by side", anchor=f"table-{w}"))
        rows = metric_rows(diags, w)
        doc.add(Table(["metric"] + labels, [[label] + cells for label, cells, _ in rows], css="compare"))
        if w == "sweep":
            names, srows, _ = sweep_rows(configs)
            doc.add(Table(["input tokens"] + [r.config.label for r in configs if r.config.name in names], srows,
                          caption="TTFT of one request alone, by input length (and its KV transfer when "
                                  "disaggregated)."))
        doc.add(Heading(f"{w}: top diagnosis of each", level=3))
        for r in configs:
            d = r.diagnoses.get(w)
            if d is None or d.top is None:
                continue
            t = d.top
            doc.add(Para(f"**{r.config.label}**: {t.cause} ({fmt.pct(t.share)} of request time, "
                         f"{t.key.text()}): {t.verdict}."))
            doc.add(Bullets([f"change: {t.change}", f"worked if: {t.check}",
                             f"full diagnosis: [{r.runs[w].name}/diagnosis.html]({r.runs[w].name}/diagnosis.html)"]))
        if w == "interference":
            _prediction_blocks(doc, result)
        if w == "interference" and with_timelines:
            _timeline_blocks(doc, timelines, png_b64)
    doc.add(Heading("How to read this", anchor="help"))
    doc.add(Bullets([
        "prefill-first runs each long prompt in one iteration: the streams stall for the whole prefill.",
        "chunked prefill serves the running decodes first and gives the rest of the budget to a chunk: stalls "
        "shrink to one chunk's time; the long prompt's TTFT grows, more with a smaller budget.",
        "disaggregated serving prefills on its own worker: the decode worker never stalls, but each request's KV "
        "must be moved (bytes, bandwidth and the wait for the transport are in the tables).",
        "Each configuration's run directory holds its diagnosis (diagnosis.html) and trace.json (ui.perfetto.dev).",
    ]))
    return doc


def predictions(result: CompareResult) -> tuple[list[Any], list[str]]:
    """compare_predict's rows, computed once per result (the report renders several documents)."""
    if result.predictions is None:
        from phaselab.experiments.compare_predict import compare_predictions

        result.predictions = compare_predictions(result)
    return result.predictions  # type: ignore[no-any-return]


def _prediction_blocks(doc: Doc, result: CompareResult) -> None:
    from phaselab.analysis.advice import LABEL
    from phaselab.analysis.predict import FIGURES

    rows, notes = predictions(result)
    if not rows and not notes:
        return
    doc.add(Heading("interference: predicted vs measured, from the prefill-first run", level=3,
                    anchor="predicted-vs-measured"))
    pct = (lambda v: f"{v:+.0%}" if v is not None else "—")
    table = []
    for r in rows:
        for n in FIGURES:
            table.append([r.label, LABEL[n], pct(r.prediction.relative(n)), pct(r.measured_relative(n))])
    if rows:
        err = rows[0].prediction.cost_model_error
        doc.add(Table(["configuration", "figure", "predicted", "measured"], table, align_left=2, caption=(
            "Change against prefill-first: predicted by simulating the prefill-first run's workload with the "
            "configuration's policy and budget (the engine's scheduler, a cost model calibrated on that run"
            + (f", mean iteration error {err:.0%}" if err is not None else "") + "); measured: the configuration's "
            "own run. Each side is one run on a shared machine: differences within the machine's drift are noise.")))
    for n in notes:
        doc.add(Para(f"no prediction: {n}", "note"))


def _timeline_blocks(doc: Doc, timelines: list[dict[str, Any]] | None, png_b64: str | None) -> None:
    doc.add(Heading("Timelines: the interference workload under each approach", anchor="timelines"))
    doc.add(Para("One shared time axis. Worker lanes: iterations coloured by their prefill/decode token mix. "
                 "Request lanes: queue, prefill chunks, KV transfer, decode tokens; red: a stream stalled by "
                 "another request's prefill."))
    if timelines:
        doc.add(RawHtml(timeline_fragment(timelines, "timeline-interference"), "(interactive timeline)"))
    if png_b64:
        doc.add(RawHtml(f'<p><img id="timeline-png" alt="timeline (static)" style="max-width:100%" '
                        f'src="data:image/png;base64,{png_b64}"></p>', ""))


def summary_json(result: CompareResult) -> dict[str, Any]:
    out: dict[str, Any] = {"plan": result.plan.to_json(), "wall_s": result.wall_s, "notes": result.notes,
                           "engine": engine_paths(result), "configs": []}
    for r in result.results:
        entry: dict[str, Any] = {"name": r.config.name, "label": r.config.label, "config": asdict(r.config),
                                 "wall_s": r.wall_s, "workloads": {}}
        for w, d in r.diagnoses.items():
            entry["workloads"][w] = {
                "run_dir": str(r.runs[w]), "summary": asdict(d.summary), "time_shares": d.account.shares,
                "top": None if d.top is None else {"cause": d.top.cause, "share": d.top.share,
                                                   "key_figure": asdict(d.top.key), "verdict": d.top.verdict,
                                                   "change": d.top.change, "check": d.top.check},
            }
        out["configs"].append(entry)
    rows, notes = predictions(result)
    out["predictions"] = [r.to_json() for r in rows]
    out["prediction_notes"] = notes
    return out


def write_compare_outputs(result: CompareResult) -> dict[str, Path]:
    out = result.out_dir
    files: dict[str, Path] = {}
    inter = [r for r in result.results if "interference" in r.runs]
    timelines = [load_timeline(r.runs["interference"], r.config.label) for r in inter]
    png_b64 = None
    if timelines:
        files["timeline_png"] = render_png(timelines, out / "timeline.png")
        files["timeline_html"] = out / "timeline.html"
        files["timeline_html"].write_text(render_timeline_page(timelines, "phaselab compare: interference timelines"),
                                          encoding="utf-8")
        png_b64 = base64.b64encode(files["timeline_png"].read_bytes()).decode("ascii")
    files["report"] = out / "report.html"
    files["report"].write_text(render_html(compare_doc(result, True, png_b64, timelines), extra_head=timeline_head()),
                               encoding="utf-8")
    doc = compare_doc(result)
    files["summary_md"] = out / "summary.md"
    files["summary_md"].write_text(render_markdown(doc), encoding="utf-8")
    files["summary_txt"] = out / "summary.txt"
    files["summary_txt"].write_text(render_text(doc), encoding="utf-8")
    files["summary_json"] = out / "summary.json"
    files["summary_json"].write_text(json.dumps(summary_json(result), indent=2, default=str) + "\n", encoding="utf-8")
    for r in result.results:
        for w, path in r.runs.items():
            files[f"{w}-{r.config.name}"] = path
    return files
