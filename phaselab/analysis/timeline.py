"""`phaselab timeline RUN_DIR [RUN_DIR2]`: what every worker and every request did, and when.

    run "chunked, budget 512"                                               shared time axis (s)
    engine-0   ▮▮▮▮▮▮▮▮▮██▮▮▮▮▮▮▮▮▮▮▮▮██▮▮▮▮        iterations coloured by prefill/decode token mix
    stream-0   ░▮|||||||||||||||||||||||||||||      queue ░, prefill chunks ▮, decode tokens |
    long-0                 ░░▮▮▮▮▮▮▮||              stalls marked in red on the stalled stream
    adaptive budget (--slo-tbt-ms): a black step line in the worker's lane is the prefill budget
    (lane height = max_num_batched_tokens); a decode iteration over the TBT target is outlined red
    run "disaggregated 1P1D"
    prefill-0  ...   decode-0  ...                 transfer ▬ between the prefill chunk and decode

Two outputs from one model of the run (`build_timeline`): a PNG (matplotlib, Agg backend) and a
self-contained interactive HTML page (inline SVG drawn by inline JavaScript, no network): hover
for details, wheel to zoom, drag to pan, double-click to reset. Several runs share one time axis
(each run's clock starts at its own first event). The Perfetto trace (trace.json) stays the way
to dig deeper.
"""

from __future__ import annotations

import html
import json
from os import PathLike
from pathlib import Path
from typing import Any

from phaselab.analysis.accounting import STALL_FACTOR, account_run
from phaselab.obs.rundir import RunData, read_run_dir

MAX_REQUEST_LANES = 120
MAX_TICKS_PER_REQUEST = 2000
PREFILL_RGB = (232, 135, 30)
DECODE_RGB = (59, 125, 216)
COLORS = {"queue": "#c9ced8", "wait": "#e4e7ee", "prefill": "#e8871e", "recompute": "#a34f00",
          "transfer_queue": "#d9c8f0",
          "transfer": "#7b4fc9", "admission": "#e7a1d4", "decode": "#3b7dd8", "stall": "#d62728",
          "interference": "#f4a3a3"}


def _rel(ns: int | None, t0: int) -> float | None:
    return None if ns is None else round((ns - t0) / 1e9, 6)


def build_timeline(run: RunData, title: str) -> dict[str, Any]:
    """The run as plain data (seconds since the run's first event) for both renderers."""
    starts = [m.arrived_ns for m in run.requests] + [r.start_ns for r in run.iterations]
    t0 = min(starts) if starts else 0
    workers: dict[str, dict[str, Any]] = {}
    role_order = {"colocated": 0, "prefill": 1, "decode": 2}
    for r in sorted(run.iterations, key=lambda r: (role_order.get(r.role, 3), r.worker, r.start_ns)):
        w = workers.setdefault(r.worker, {"name": r.worker, "role": r.role, "iters": []})
        w["iters"].append([_rel(r.start_ns, t0), _rel(r.end_ns, t0), r.num_prefill_tokens, r.num_decode_tokens,
                           r.iteration_id, len(r.chunks), r.prefill_budget,
                           None if r.predicted_ns is None else round(r.predicted_ns / 1e9, 9)])
    account = account_run(run.requests, run.iterations, run.config)
    gaps: dict[str, list[list[Any]]] = {}
    for g in account.gaps:
        if g.cause != "stall":
            continue
        culprits = ", ".join(f"{rid} ({n})" for rid, n in sorted(g.culprits.items(), key=lambda kv: -kv[1])[:3])
        gaps.setdefault(g.request_id, []).append(
            [_rel(g.start_ns, t0), _rel(g.end_ns, t0), round(g.excess_s, 6), int(g.is_stall()), culprits])
    reqs = []
    ordered = sorted(run.requests, key=lambda m: m.arrived_ns)
    for m in ordered[:MAX_REQUEST_LANES]:
        sent = m.token_sent_ns or m.token_sampled_ns
        step = max(1, len(sent) // MAX_TICKS_PER_REQUEST)
        reqs.append({
            "id": m.request_id, "prompt": m.num_prompt_tokens, "cached": m.num_cached_tokens,
            "out": m.num_output_tokens, "arr": _rel(m.arrived_ns, t0),
            "queue": [_rel(m.queued_ns or m.arrived_ns, t0), _rel(m.first_scheduled_ns, t0)]
            if m.first_scheduled_ns is not None else None,
            "chunks": [[_rel(c.start_ns, t0), _rel(c.end_ns, t0), c.num_tokens, c.iteration_id]
                       for c in m.prefill_chunks],
            "recompute": [[_rel(c.start_ns, t0), _rel(c.end_ns, t0), c.num_tokens, c.iteration_id]
                          for c in m.recompute_chunks],
            "transfer": [_rel(m.kv_transfer_queued_ns, t0), _rel(m.kv_transfer_start_ns, t0),
                         _rel(m.kv_transfer_end_ns, t0), _rel(m.decode_admitted_ns, t0), m.kv_transfer_bytes]
            if m.kv_transfer_start_ns is not None else None,
            "first": _rel(m.first_token_sent_ns, t0),
            "tokens": [_rel(t, t0) for t in sent[::step]],
            "stalls": gaps.get(m.request_id, []),
            "fin": _rel(m.finished_ns, t0), "reason": m.finish_reason, "ttft": m.ttft_s,
            "worker": m.worker, "dworker": m.decode_worker,
        })
    ends = [m.finished_ns for m in run.requests if m.finished_ns] + [r.end_ns for r in run.iterations]
    return {
        "title": title, "t0_ns": t0, "end": _rel(max(ends), t0) if ends else 0.0,
        "workers": list(workers.values()), "requests": reqs,
        "omitted_requests": max(0, len(ordered) - MAX_REQUEST_LANES),
        "stall_factor": STALL_FACTOR,
        # the adaptive budget (docs/slo.md): its target and the budget's full scale
        "slo_tbt_s": next((r.slo_tbt_s for r in run.iterations if r.slo_tbt_s is not None), None),
        "max_budget": (run.config.get("scheduler") or {}).get("max_num_batched_tokens"),
    }


def load_timeline(path: str | PathLike[str], title: str | None = None) -> dict[str, Any]:
    run = read_run_dir(path)
    return build_timeline(run, title or _default_title(run, str(path)))


def _default_title(run: RunData, path: str) -> str:
    sched = run.config.get("scheduler") or {}
    if run.config.get("mode") == "disagg":
        return f"{Path(path).name} (disaggregated)"
    if sched and (sched.get("slo_tbt_ms") or 0) > 0:
        return f"{Path(path).name} (chunked, adaptive budget, TBT target {sched['slo_tbt_ms']:g} ms)"
    if sched:
        return f"{Path(path).name} ({sched.get('policy')}, budget {sched.get('max_num_batched_tokens')})"
    return Path(path).name


def _draw_budget(ax: Any, t: dict[str, Any], w: dict[str, Any], row: int) -> None:
    """The adaptive budget over time in a worker's lane, and its decode iterations over the target."""
    target, scale = t.get("slo_tbt_s"), t.get("max_budget") or 0
    with_budget = [it for it in w["iters"] if len(it) > 6 and it[6] is not None]
    if not with_budget or not scale:
        return
    xs, ys = [], []
    for s, e, *_rest in with_budget:
        b = _rest[4]
        y = row + 0.4 - 0.8 * min(b, scale) / scale
        xs += [s, e]
        ys += [y, y]
    ax.plot(xs, ys, color="black", linewidth=0.6)
    if target:
        over = [(s, max(e - s, 1e-6)) for s, e, _p, d, *_ in w["iters"] if d and e - s > target]
        if over:
            ax.broken_barh(over, (row - 0.45, 0.9), facecolors="none", edgecolor=COLORS["stall"], linewidth=0.8)


# -- PNG -------------------------------------------------------------------------------------------------------------
def _mix_rgb(prefill: int, decode: int) -> tuple[float, float, float]:
    """Blue (decode tokens only) to orange (prefill tokens only), by the prefill share of the tokens."""
    f = prefill / (prefill + decode) if prefill + decode else 0.0
    r, g, b = ((d + (p - d) * f) / 255 for p, d in zip(PREFILL_RGB, DECODE_RGB))
    return r, g, b


def render_png(timelines: list[dict[str, Any]], path: str | PathLike[str], width_in: float = 14.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = [len(t["workers"]) + len(t["requests"]) for t in timelines]
    heights = [max(1.2, 0.22 * n + 0.6) for n in lanes]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(width_in, sum(heights) + 1.0), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    x_end = max((t["end"] or 0.0) for t in timelines) or 1.0
    for ax, t in zip(axes[:, 0], timelines):
        labels: list[str] = []
        for w in t["workers"]:
            row = len(labels)
            labels.append(f"{w['name']} ({w['role']})")
            bars = [(s, max(e - s, 1e-6)) for s, e, *_ in w["iters"]]
            colors = [_mix_rgb(p, d) for _, _, p, d, *_ in w["iters"]]
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors, edgecolor="white", linewidth=0.2)
            _draw_budget(ax, t, w, row)
        for r in t["requests"]:
            row = len(labels)
            labels.append(str(r["id"])[:18])
            if r["queue"] and r["queue"][1] is not None:
                ax.broken_barh([(r["queue"][0], max(r["queue"][1] - r["queue"][0], 1e-6))], (row - 0.3, 0.6),
                               facecolors=COLORS["queue"])
            elif not r["chunks"] and r["first"] is not None and r["arr"] is not None:  # a client's record
                ax.broken_barh([(r["arr"], max(r["first"] - r["arr"], 1e-6))], (row - 0.3, 0.6),
                               facecolors=COLORS["wait"], edgecolor=COLORS["queue"], linewidth=0.5)
            for key, color in (("chunks", COLORS["prefill"]), ("recompute", COLORS["recompute"])):
                if r[key]:
                    ax.broken_barh([(s, max(e - s, 1e-6)) for s, e, *_ in r[key]], (row - 0.35, 0.7),
                                   facecolors=color)
            if r["transfer"]:
                q, s, e, adm, _ = r["transfer"]
                if q is not None and s is not None and s > q:
                    ax.broken_barh([(q, s - q)], (row - 0.25, 0.5), facecolors=COLORS["transfer_queue"])
                if s is not None and e is not None:
                    ax.broken_barh([(s, max(e - s, 1e-6))], (row - 0.35, 0.7), facecolors=COLORS["transfer"])
                if e is not None and adm is not None and adm > e:
                    ax.broken_barh([(e, adm - e)], (row - 0.25, 0.5), facecolors=COLORS["admission"])
            if r["tokens"]:
                if r["first"] is not None and r["fin"] is not None:
                    ax.plot([r["first"], r["fin"]], [row, row], color=COLORS["decode"], linewidth=0.6, alpha=0.5)
                ax.vlines(r["tokens"], row - 0.3, row + 0.3, color=COLORS["decode"], linewidth=0.5)
            for s, e, _excess, is_stall, _c in r["stalls"]:
                ax.broken_barh([(s, max(e - s, 1e-6))], (row - 0.45, 0.9), facecolors="none",
                               edgecolor=COLORS["stall"] if is_stall else COLORS["interference"],
                               linewidth=1.2 if is_stall else 0.6)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_ylim(max(len(labels), 1) - 0.5, -0.5)
        ax.set_xlim(0, x_end * 1.01)
        title = t["title"] + (f"  (+{t['omitted_requests']} requests not drawn)" if t["omitted_requests"] else "")
        if t.get("slo_tbt_s"):
            n_over = sum(1 for w in t["workers"] for s, e, _p, d, *_ in w["iters"] if d and e - s > t["slo_tbt_s"])
            title += (f"  [black line: prefill budget / {t['max_budget']}; red outline: {n_over} decode iterations "
                      f"over the {t['slo_tbt_s'] * 1e3:g} ms TBT target]")
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="x", linewidth=0.3, alpha=0.5)
        if t["workers"]:
            ax.axhline(len(t["workers"]) - 0.5, color="#888", linewidth=0.5)
    axes[-1, 0].set_xlabel("seconds since the run's first event")
    handles = [Patch(color=_mix_rgb(1, 0), label="iteration: prefill tokens"),
               Patch(color=_mix_rgb(0, 1), label="iteration: decode tokens"),
               Patch(color=COLORS["queue"], label="queue"), Patch(color=COLORS["prefill"], label="prefill chunk"),
               Patch(color=COLORS["transfer"], label="KV transfer"),
               Patch(color=COLORS["decode"], label="decode tokens"),
               Patch(facecolor="none", edgecolor=COLORS["stall"], label=f"stall (> {STALL_FACTOR:g}x pace)")]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# -- interactive HTML ----------------------------------------------------------------------------------------------
TIMELINE_CSS = """
.tl-wrap { position: relative; border: 1px solid #d9dee7; border-radius: 4px; margin: 8px 0 16px; background: #fff; }
.tl-legend { font-size: 12px; color: #404756; padding: 6px 8px; display: flex; flex-wrap: wrap; gap: 12px; }
.tl-legend span.sw { display: inline-block; width: 12px; height: 10px; margin-right: 4px; vertical-align: -1px; }
.tl-help { font-size: 11px; color: #6b7385; padding: 0 8px 6px; }
.tl-svg { display: block; width: 100%; user-select: none; cursor: grab; }
.tl-tip { position: absolute; pointer-events: none; background: rgba(20,24,33,.92); color: #fff; font-size: 12px;
          padding: 5px 8px; border-radius: 4px; white-space: pre; display: none; z-index: 5; max-width: 520px; }
"""

TIMELINE_JS = r"""
(function () {
  var NS = 'http://www.w3.org/2000/svg';
  var PF = [232, 135, 30], DC = [59, 125, 216];
  var COL = %COLORS%;
  function mix(p, d) {
    var f = (p + d) > 0 ? p / (p + d) : 0;
    return 'rgb(' + [0, 1, 2].map(function (i) { return Math.round(DC[i] + (PF[i] - DC[i]) * f); }).join(',') + ')';
  }
  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmtS(s) { return s == null ? '-' : (Math.abs(s) < 1 ? (s * 1000).toFixed(1) + ' ms' : s.toFixed(3) + ' s'); }
  function niceStep(span, px) {
    var raw = span / Math.max(1, px / 90), p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p; return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
  }
  window.phaselabTimeline = function (root, runs) {
    var LABEL = 150, LW = 16, LR = 11, HEAD = 22, AXIS = 24;
    var maxEnd = 0;
    runs.forEach(function (r) { maxEnd = Math.max(maxEnd, r.end || 0); });
    if (maxEnd <= 0) maxEnd = 1;
    var view = { x0: 0, x1: maxEnd * 1.01 };
    var tip = document.createElement('div'); tip.className = 'tl-tip'; root.appendChild(tip);
    var svg = el('svg', { 'class': 'tl-svg' }, root);
    var nShapes = 0;
    function draw() {
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      nShapes = 0;
      var W = Math.max(600, root.clientWidth || 1000), PW = W - LABEL - 10;
      var sx = function (t) { return LABEL + (t - view.x0) / (view.x1 - view.x0) * PW; };
      var clip = el('clipPath', { id: root.id + '-clip' }, el('defs', {}, svg));
      var y = 4;
      var tops = [];
      runs.forEach(function (run) {
        tops.push(y);
        el('text', { x: 4, y: y + 15, 'font-size': 13, 'font-weight': 600, fill: '#1d2330' }, svg).textContent =
          run.title + (run.omitted_requests ? '  (+' + run.omitted_requests + ' requests not drawn)' : '');
        y += HEAD;
        run.workers.forEach(function (w) {
          el('text', { x: 4, y: y + LW - 4, 'font-size': 11, fill: '#404756' }, svg).textContent = w.name + ' (' + w.role + ')';
          var g = el('g', { 'clip-path': 'url(#' + root.id + '-clip)' }, svg);
          w.iters.forEach(function (it) {
            if (it[1] < view.x0 || it[0] > view.x1) return;
            var x = sx(it[0]), x2 = sx(it[1]);
            var rc = el('rect', { x: x, y: y + 1, width: Math.max(0.6, x2 - x), height: LW - 2, fill: mix(it[2], it[3]),
              'class': 'tl-iter' }, g);
            nShapes++;
            rc.__tip = w.name + ' iteration ' + it[4] + '\n' + fmtS(it[0]) + ' -> ' + fmtS(it[1]) + ' (' + fmtS(it[1] - it[0]) + ')' +
              '\nprefill tokens ' + it[2] + ', decode tokens ' + it[3] + ', requests ' + it[5] +
              (it[6] != null ? '\nadaptive budget ' + it[6] + ' prefill tokens; predicted ' + fmtS(it[7]) +
                ' vs target ' + fmtS(run.slo_tbt_s) : '');
            if (run.slo_tbt_s && it[3] > 0 && it[1] - it[0] > run.slo_tbt_s) {
              rc.setAttribute('stroke', COL.stall); rc.setAttribute('stroke-width', 1.2);
            }
            if (it[6] != null && run.max_budget) {
              var by = y + 1 + (LW - 2) * (1 - Math.min(it[6], run.max_budget) / run.max_budget);
              el('line', { x1: x, x2: Math.max(x + 0.6, x2), y1: by, y2: by, stroke: '#000', 'stroke-width': 1 }, g);
            }
          });
          y += LW;
        });
        el('line', { x1: 0, x2: W, y1: y + 2, y2: y + 2, stroke: '#c4cad6' }, svg);
        y += 4;
        run.requests.forEach(function (r) {
          el('text', { x: 4, y: y + LR - 2, 'font-size': 10, fill: '#5b6577' }, svg).textContent = String(r.id).slice(0, 22);
          var g = el('g', { 'clip-path': 'url(#' + root.id + '-clip)' }, svg);
          var base = r.id + ': prompt ' + r.prompt + ' (cached ' + r.cached + '), output ' + r.out + ', TTFT ' + fmtS(r.ttft);
          function bar(s, e, color, h, text) {
            if (s == null || e == null || e < view.x0 || s > view.x1) return;
            var x = sx(s);
            var rc = el('rect', { x: x, y: y + (LR - h) / 2, width: Math.max(0.8, sx(e) - x), height: h, fill: color }, g);
            rc.__tip = base + '\n' + text; nShapes++;
          }
          if (r.queue) bar(r.queue[0], r.queue[1], COL.queue, LR - 4, 'queue ' + fmtS(r.queue[1] - r.queue[0]));
          else if (!r.chunks.length && r.first != null) bar(r.arr, r.first, COL.wait, LR - 4, 'waiting for the first token (client view) ' + fmtS(r.first - r.arr));
          r.chunks.forEach(function (c, i) { bar(c[0], c[1], COL.prefill, LR - 1, 'prefill chunk ' + i + ': ' + c[2] + ' tokens in iteration ' + c[3] + ', ' + fmtS(c[1] - c[0])); });
          r.recompute.forEach(function (c, i) { bar(c[0], c[1], COL.recompute, LR - 1, 'recompute chunk ' + i + ': ' + c[2] + ' tokens'); });
          if (r.transfer) {
            var t = r.transfer;
            bar(t[0], t[1], COL.transfer_queue, LR - 5, 'KV transfer queued ' + fmtS(t[1] - t[0]));
            bar(t[1], t[2], COL.transfer, LR - 2, 'KV transfer ' + fmtS(t[2] - t[1]) + (t[4] ? ', ' + (t[4] / 1e6).toFixed(2) + ' MB' : ''));
            bar(t[2], t[3], COL.admission, LR - 5, 'decode admission wait ' + fmtS(t[3] - t[2]));
          }
          if (r.first != null && r.fin != null && r.fin >= view.x0 && r.first <= view.x1) {
            var ln = el('line', { x1: sx(Math.max(r.first, view.x0)), x2: sx(Math.min(r.fin, view.x1)), y1: y + LR / 2, y2: y + LR / 2,
              stroke: COL.decode, 'stroke-opacity': 0.35, 'stroke-width': 3 }, g);
            ln.__tip = base + '\ndecode: ' + r.out + ' tokens, first ' + fmtS(r.first) + ', finished ' + fmtS(r.fin) + ' (' + r.reason + ')';
          }
          var ticks = '';
          r.tokens.forEach(function (t) {
            if (t < view.x0 || t > view.x1) return;
            var x = sx(t).toFixed(1); ticks += 'M' + x + ' ' + (y + 1) + 'V' + (y + LR - 1);
          });
          if (ticks) { el('path', { d: ticks, stroke: COL.decode, 'stroke-width': 1 }, g); nShapes++; }
          r.stalls.forEach(function (s) {
            if (s[1] < view.x0 || s[0] > view.x1) return;
            var x = sx(s[0]);
            var rc = el('rect', { x: x, y: y, width: Math.max(1, sx(s[1]) - x), height: LR,
              fill: s[3] ? COL.stall : COL.interference, 'fill-opacity': s[3] ? 0.28 : 0.2,
              stroke: s[3] ? COL.stall : COL.interference, 'stroke-width': s[3] ? 1.2 : 0.6, 'class': s[3] ? 'tl-stall' : 'tl-interf' }, g);
            rc.__tip = base + '\n' + (s[3] ? 'STALL' : 'slowed') + ': gap ' + fmtS(s[1] - s[0]) + ' (excess ' + fmtS(s[2]) + ')' +
              (s[4] ? '\nprefill of ' + s[4] : ''); nShapes++;
          });
          y += LR;
        });
        y += 10;
      });
      el('rect', { x: LABEL, y: 0, width: PW, height: y }, clip);
      var step = niceStep(view.x1 - view.x0, PW);
      for (var t = Math.ceil(view.x0 / step) * step; t <= view.x1; t += step) {
        var x = sx(t);
        el('line', { x1: x, x2: x, y1: 0, y2: y, stroke: '#e6e9ef', 'stroke-width': 1 }, svg).setAttribute('pointer-events', 'none');
        el('text', { x: x, y: y + 14, 'font-size': 10, 'text-anchor': 'middle', fill: '#5b6577' }, svg).textContent =
          (step < 1 ? t.toFixed(step < 0.01 ? 3 : step < 0.1 ? 2 : 1) : t.toFixed(0)) + ' s';
      }
      svg.setAttribute('height', y + AXIS);
      svg.setAttribute('viewBox', '0 0 ' + W + ' ' + (y + AXIS));
      // the grid went on top of the shapes: move it underneath
      Array.prototype.slice.call(svg.querySelectorAll('line[pointer-events="none"]')).forEach(function (l) {
        svg.insertBefore(l, svg.firstChild.nextSibling);
      });
      root.setAttribute('data-shapes', nShapes);
      root.setAttribute('data-rendered', 'yes');
    }
    svg.addEventListener('mousemove', function (ev) {
      var t = ev.target && ev.target.__tip;
      if (!t) { tip.style.display = 'none'; return; }
      var b = root.getBoundingClientRect();
      tip.textContent = t; tip.style.display = 'block';
      tip.style.left = Math.min(ev.clientX - b.left + 14, b.width - 300) + 'px';
      tip.style.top = (ev.clientY - b.top + 14) + 'px';
    });
    svg.addEventListener('mouseleave', function () { tip.style.display = 'none'; });
    function toT(ev) {
      var b = svg.getBoundingClientRect(), W = b.width, PW = W - LABEL - 10;
      return view.x0 + (ev.clientX - b.left - LABEL) / PW * (view.x1 - view.x0);
    }
    svg.addEventListener('wheel', function (ev) {
      ev.preventDefault();
      var t = toT(ev), k = ev.deltaY > 0 ? 1.25 : 0.8;
      var x0 = t - (t - view.x0) * k, x1 = t + (view.x1 - t) * k;
      view.x0 = Math.max(-0.05 * maxEnd, x0); view.x1 = Math.min(maxEnd * 1.05, Math.max(view.x0 + 1e-4, x1));
      draw();
    }, { passive: false });
    var drag = null;
    svg.addEventListener('mousedown', function (ev) { drag = { t: toT(ev), x0: view.x0, x1: view.x1 }; svg.style.cursor = 'grabbing'; });
    window.addEventListener('mouseup', function () { drag = null; svg.style.cursor = ''; });
    svg.addEventListener('mousemove', function (ev) {
      if (!drag) return;
      var d = toT(ev) - drag.t;
      view.x0 -= d; view.x1 -= d; draw();
    });
    svg.addEventListener('dblclick', function () { view.x0 = 0; view.x1 = maxEnd * 1.01; draw(); });
    window.addEventListener('resize', draw);
    draw();
  };
})();
""".replace("%COLORS%", json.dumps(COLORS))


def _legend_html() -> str:
    pf = "rgb(%d,%d,%d)" % PREFILL_RGB
    dc = "rgb(%d,%d,%d)" % DECODE_RGB
    items = [(f"linear-gradient(90deg,{dc},{pf})", "iteration: decode → prefill token mix"),
             (COLORS["queue"], "queue"), (COLORS["wait"], "waiting for the first token (client)"),
             (COLORS["prefill"], "prefill chunk"), (COLORS["recompute"], "recompute"),
             (COLORS["transfer_queue"], "KV transfer queued"), (COLORS["transfer"], "KV transfer"),
             (COLORS["admission"], "decode admission wait"), (COLORS["decode"], "decode tokens"),
             (COLORS["stall"], f"stall (gap > {STALL_FACTOR:g}x the stream's pace)"),
             (COLORS["interference"], "slowed by another prompt's prefill")]
    return '<div class="tl-legend">' + "".join(
        f'<span><span class="sw" style="background:{c}"></span>{html.escape(t)}</span>' for c, t in items) + "</div>"


def timeline_fragment(timelines: list[dict[str, Any]], element_id: str = "timeline") -> str:
    """A <div> that draws the runs (needs TIMELINE_JS once on the page, and TIMELINE_CSS)."""
    data = json.dumps(timelines, separators=(",", ":")).replace("</", "<\\/")
    return (f'<div class="tl-wrap">{_legend_html()}'
            '<div class="tl-help">hover for details · wheel to zoom · drag to pan · double-click to reset</div>'
            f'<div id="{element_id}" class="tl-root" style="position:relative"></div></div>'
            f'<script type="application/json" id="{element_id}-data">{data}</script>'
            f'<script>phaselabTimeline(document.getElementById("{element_id}"), '
            f'JSON.parse(document.getElementById("{element_id}-data").textContent));</script>')


def timeline_head() -> str:
    return f"<style>{TIMELINE_CSS}</style><script>{TIMELINE_JS}</script>"


def render_timeline_page(timelines: list[dict[str, Any]], title: str = "phaselab timeline") -> str:
    from phaselab.analysis.doc import Doc, Para, RawHtml, render_html

    doc = Doc(title)
    doc.add(Para("One lane per worker (iterations coloured by their prefill/decode token mix) and one lane per "
                 "request (queue, prefill chunks, KV transfer, decode tokens; stalls marked). Runs share one time "
                 "axis, each from its own first event. For more detail open trace.json in ui.perfetto.dev."))
    doc.add(RawHtml(timeline_fragment(timelines)))
    return render_html(doc, extra_head=timeline_head())


def write_timeline(run_dirs: list[str | PathLike[str]], out_png: str | PathLike[str], out_html: str | PathLike[str],
                   titles: list[str] | None = None) -> tuple[Path, Path]:
    timelines = [load_timeline(p, titles[i] if titles else None) for i, p in enumerate(run_dirs)]
    png = render_png(timelines, out_png)
    page = Path(out_html)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render_timeline_page(timelines, "phaselab timeline: " + " vs ".join(t["title"] for t in timelines)),
                    encoding="utf-8")
    return png, page
