"""Write benchmarks/RESULTS.md from the result JSONs: every figure comes from a measurement file.

    python benchmarks/results_md.py [--results benchmarks/results] [--out benchmarks/RESULTS.md]

Reads roofline.json, engine.json (benchmarks/engine.py), serve_vs_peers.md (rendered by
benchmarks/serve_vs_peers.py from its JSON), sim_fidelity.json, sim_validation.json and slo_serving.json; a missing file leaves its
section saying which command makes it.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def med(d: dict | None) -> float | None:
    return None if d is None else d.get("median")


def spread(d: dict | None) -> str:
    return "" if not d or d.get("n", 0) < 2 else f" ({fmt(d['min'])}-{fmt(d['max'])})"


def machine_section(eng: dict, roof: dict | None) -> list[str]:
    m = eng["machine"]
    flags = ", ".join(k for k, v in m["cpu"]["flags"].items() if v) or "none"
    out = [
        "## Machine and settings",
        "",
        f"- CPU: {m['cpu']['model']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB; flags: {flags}"
        f" (no AMX: bf16 GEMMs run on AVX512-BF16, not on AMX tiles).",
        f"- {m['platform']}; Python {m['python']}; torch {m['torch']} (CPU capability {m['cpu_capability']});"
        f" transformers {m['transformers']}.",
        f"- Threads: torch intra-op {m['torch_num_threads']}, OMP_WAIT_POLICY={m['OMP_WAIT_POLICY']}"
        f" (both engines of a run in one process, one after the other).",
        f"- phaselab commit {m['phaselab_git']['commit'][:9]}"
        f"{' (with local edits)' if m['phaselab_git'].get('phaselab_dirty') else ''};"
        f" engine.py run {eng['date']} ({eng['duration_s'] / 60:.0f} min),"
        f" load average {fmt(m['loadavg_at_start'][0], 2)} at start, {fmt(m['loadavg_at_end'][0], 2)} at end"
        f" (the benchmark alone keeps it near 1-2 on 2 cores).",
        f"- Command: `python {' '.join(eng['command'])}`.",
    ]
    if roof:
        bw = roof["bandwidth"]
        out.append(
            f"- Ceilings (`benchmarks/roofline.py`, {roof['date']}): read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s"
            f" ({bw['array_bytes'] / 2**30:.0f} GiB arrays); model-layer GEMM mix at 512 rows:"
            f" bf16 {roof['bfloat16']['gemm_flops_per_s']['layer_mix']['512'] / 1e9:.0f} GFLOP/s,"
            f" fp32 {roof['float32']['gemm_flops_per_s']['layer_mix']['512'] / 1e9:.0f} GFLOP/s;"
            f" at 1 row: bf16 {roof['bfloat16']['gemm_flops_per_s']['layer_mix']['1'] / 1e9:.1f},"
            f" fp32 {roof['float32']['gemm_flops_per_s']['layer_mix']['1'] / 1e9:.1f} GFLOP/s."
        )
    return out + [""]


def engine_section(eng: dict) -> list[str]:
    out = ["## Engine, offline (`benchmarks/engine.py`)", "",
           "Medians of the trials, (min-max) where there were several. `floor` = max(FLOPs / GEMM rate measured"
           " at that row count, bytes / read bandwidth), bytes = weights once + KV read + KV written.", ""]
    for dt, sec in eng["dtypes"].items():
        p = sec.get("prefill")
        if p:
            out += [f"### Prefill, {dt}", "",
                    "| prompt | phaselab tok/s | transformers tok/s | phaselab / HF | phaselab % of GEMM rate | HF % of GEMM rate | floor tok/s |",
                    "|---|---|---|---|---|---|---|"]
            for n, row in p["lengths"].items():
                ph, hf = row.get("phaselab", {}), row.get("transformers", {})
                out.append(
                    f"| {n} | {fmt(med(ph.get('tokens_per_s')), 0)}{spread(ph.get('tokens_per_s'))} "
                    f"| {fmt(med(hf.get('tokens_per_s')), 0)}{spread(hf.get('tokens_per_s'))} "
                    f"| {fmt(row.get('ratio_phaselab_over_hf_tokens_per_s'), 2)}x "
                    f"| {fmt(100 * ph['fraction_of_gemm_rate'], 0) if 'fraction_of_gemm_rate' in ph else '-'}% "
                    f"| {fmt(100 * hf['fraction_of_gemm_rate'], 0) if 'fraction_of_gemm_rate' in hf else '-'}% "
                    f"| {fmt(row['floor']['floor_tokens_per_s'], 0)} |")
            out.append("")
        d = sec.get("decode")
        if d:
            out += [f"### Decode, {dt} ({d['context']}-token contexts)", "",
                    "| batch | phaselab ms/step | transformers ms/step | speedup | phaselab / floor | phaselab / bandwidth floor | HF / floor | floor ms (bound) | bandwidth floor ms |",
                    "|---|---|---|---|---|---|---|---|---|"]
            for b, row in d["batches"].items():
                ph, hf, fl = row.get("phaselab", {}), row.get("transformers", {}), row["floor"]
                out.append(
                    f"| {b} | {fmt(med(ph.get('ms_per_step')))}{spread(ph.get('ms_per_step'))} "
                    f"| {fmt(med(hf.get('ms_per_step')))}{spread(hf.get('ms_per_step'))} "
                    f"| {fmt(row.get('speedup_phaselab_over_hf'), 2)}x | {fmt(ph.get('time_over_floor'), 2)}x "
                    f"| {fmt(ph.get('time_over_bandwidth_floor'), 2)}x | {fmt(hf.get('time_over_floor'), 2)}x "
                    f"| {fmt(fl['floor_ms'])} ({fl['bound']}) | {fmt(fl['bandwidth_floor_ms'])} |")
            out.append("")
        o = sec.get("offline")
        if o:
            w, ph, hf = o["workload"], o.get("phaselab", {}), o.get("transformers", {})
            kv = o.get("kv_cache", {}).get("phaselab", {})
            mem = o.get("memory", {}).get("per_engine", {})
            out += [f"### Offline workload, {dt}: {w['requests']} x {w['prompt_tokens']} -> {w['output_tokens']} greedy tokens", "",
                    "| engine | output tok/s | wall s | time / floor | peak RSS during its runs |",
                    "|---|---|---|---|---|"]
            for name, e in (("phaselab", ph), ("transformers generate()", hf)):
                key = "phaselab" if name == "phaselab" else "transformers"
                rss = mem.get(key, {}).get("peak_rss_bytes")
                out.append(f"| {name} | {fmt(med(e.get('output_tokens_per_s')))} | {fmt(med(e.get('wall_s')))} "
                           f"| {fmt(e.get('time_over_floor'), 2)}x | {fmt(rss / 2**30 if rss else None, 2)} GiB |")
            out += ["", f"Speedup {fmt(o.get('speedup_phaselab_over_hf'), 2)}x; transformers in sub-batches of"
                        f" {o.get('transformers_sub_batch')}. phaselab's KV cache: budget {kv.get('budget_bytes', 0) / 2**30:.2f} GiB"
                        f" allocated once, peak {kv.get('peak_used_fraction', 0) * 100:.0f}% of its blocks in use,"
                        f" tensor never regrown: {kv.get('cache_tensor_unchanged')}; transformers' DynamicCache grows"
                        f" on demand (modeled peak {o.get('kv_cache', {}).get('transformers', {}).get('peak_used_bytes', 0) / 2**30:.2f} GiB)."
                        " Peak RSS includes both engines' weights (one process).", ""]
    return out


def targets_section(eng: dict, served_md: str | None) -> list[str]:
    out = ["## Issue 9 targets", "",
           "| target | dtype | value | met | stated for this dtype |", "|---|---|---|---|---|"]
    for t in eng["summary"]["targets"]:
        out.append(f"| {t['target']} | {t['dtype']} | {fmt(t['value'], 2)} | {'yes' if t['met'] else 'no'} "
                   f"| {'yes' if t['binding'] else 'no (reported for comparison)'} |")
    if served_md and "Issue 9's served targets" in served_md:
        out += ["", "Served targets: see the end of the served section below."]
    return out + [""]


def fidelity_section(fid: dict | None) -> list[str]:
    if not fid:
        return ["## Simulator self-fidelity", "", "Run `python benchmarks/sim_fidelity.py`.", ""]
    out = ["## Simulator self-fidelity (`benchmarks/sim_fidelity.py`, issue 10)", "",
           f"Calibrated on the `{fid.get('calibrate_on', 'calibration')}` run, predicting the others (relative error of the"
           " simulated figure; targets: p50 within 10%, p99 within 20%).", "",
           "| run | load (share of capacity) | load average | TTFT p50 | TTFT p99 | TBT p50 | TBT p99 |",
           "|---|---|---|---|---|---|---|"]
    c = fid.get("ceilings")
    if c:  # the efficiencies are fractions of the ceilings measured on the run's host (docs/simulator.md)
        h = c.get("host", {})
        out[2:2] = [f"Efficiencies capped at 1 of this host's ceilings, measured at the start: {h.get('cpu_model')} "
                    f"({', '.join(h.get('isa', []))}; {h.get('threads')} threads, {h.get('dtype')}), GEMM "
                    f"{c['peak_flops'] / 1e9:.0f} GFLOP/s, read {c['mem_bandwidth'] / 1e9:.1f} GB/s, load average "
                    f"{h.get('load_average_before', [float('nan')])[0]:.1f}; capped: "
                    f"{', '.join(fid.get('capped') or []) or 'none'}.", ""]
    for name, r in fid["runs"].items():
        c = r.get("comparison", {})
        la = r.get("load_average")
        la_s = fmt(la.get("mean"), 2) if isinstance(la, dict) else "-"
        cells = [f"{100 * c[k]['error']:+.0f}%" if k in c else "-" for k in ("ttft_s_p50", "ttft_s_p99", "tbt_s_p50", "tbt_s_p99")]
        out.append(f"| {name} | {fmt(r.get('fraction_of_capacity'), 2)} | {la_s} | " + " | ".join(cells) + " |")
    return out + [""]


def validation_section(val: dict | None) -> list[str]:
    if not val:
        return ["## Simulator validation against published results", "",
                "Run `python benchmarks/sim_validation.py`.", ""]
    lo, hi = val.get("target", [0.7, 1.3])
    out = ["## Simulator validation against published results (`benchmarks/sim_validation.py`, issue 15)", "",
           f"Predicted / published for each case (target {lo}-{hi}); the GPU cost model is fitted on Vidur's operator"
           " profiles only, never on these results. Setups, sources and causes of misses: the script's docstrings,"
           " docs/simulator.md.", "",
           "| case | what | published | ours | unit | ratio |", "|---|---|---|---|---|---|"]
    for r in val["rows"]:
        flag = "" if r["within_target"] else " (miss)"
        out.append(f"| {r['case']} | {r['what']} | {r['published']:.4g} | {r['predicted']:.4g} | {r['unit']} | "
                   f"{r['ratio']:.2f}{flag} |")
    out.append("")
    out.append(f"{val['num_within_target']} of {val['num_rows']} within the target; geometric mean ratio "
               f"{val['geomean_ratio']:.2f}.")
    trends = [r for r in val["rows"] if "trend_right" in r]
    if trends:
        out.append("Trends: " + "; ".join(f"{r['case']} ({r['what'].split(':')[0]}): "
                                          f"{'right' if r['trend_right'] else 'WRONG'}" for r in trends) + ".")
    return out + [""]


def linear_section(lin: dict | None, *profs: dict | None) -> list[str]:
    """Issue 18: linear paths (benchmarks/linear.py) and decode-step shares (benchmarks/step_profile.py)."""
    if not lin:
        return ["## Linear paths (issue 18)", "", "Run `python benchmarks/linear.py`.", ""]
    cpu = lin.get("cpu", {})
    isa = ", ".join(k for k, v in cpu.get("isa", {}).items() if v)
    out = ["## Linear paths: weights as stored (`benchmarks/linear.py`, issue 18)", "",
           f"Machine: {cpu.get('model', '?')}, {lin.get('cores')} cores ({isa}); torch {lin.get('torch')}, "
           f"{lin.get('threads')} threads; run {lin.get('started')}, load average {fmt(lin['load_avg_at_start'][0], 1)} at start, "
           f"{fmt(lin['load_avg_at_end'][0], 1)} at end (a shared machine: compare paths within a row, as ratios). "
           f"Read bandwidth {fmt(lin.get('read_bandwidth_GBps'), 1)} GB/s.", ""]
    for act, rows in lin.get("rows", {}).items():
        paths = [k for k in next(iter(rows.values())) if not k.startswith("load")]
        out += [f"All linear layers of the bundled model once (30 layers + LM head), activations {act}: ms (GB/s of the weights as that path stores them)", "",
                "| rows | " + " | ".join(paths) + " | load |", "|---" * (len(paths) + 2) + "|"]
        for m, r in rows.items():
            out.append(f"| {m} | " + " | ".join(f"{r[p]['ms']:.1f} ({r[p]['GBps']:.1f})" for p in paths)
                       + f" | {fmt(r['load_avg_before'], 1)} |")
        out.append("")
    if lin.get("decode"):
        out += ["Decode, batch 1, 512-token context (median step); floor = (weights as stored + KV read) / read bandwidth; "
                "16-bit floor = bf16 weights + bf16 KV.", "",
                "| dtype / path | ms/step | weights MB | floor ms | / floor | / 16-bit floor | load |", "|---|---|---|---|---|---|---|"]
        for k, v in lin["decode"].items():
            out.append(f"| {k} | {v['ms_per_step_median']:.1f} | {v['weight_bytes'] / 1e6:.1f} | {v['floor_ms']:.1f} | "
                       f"{v['vs_floor']:.2f}x | {fmt(v.get('vs_floor16'), 2)}x | {fmt(v['load_avg'], 1)} |")
        out.append("")
    if lin.get("prefix"):
        out += ["Prefill of 2000 new tokens, cold vs after a 16-token prefix-cache hit (ms per new token):", "",
                "| dtype | cold | after the hit | ratio | load |", "|---|---|---|---|---|"]
        for k, v in lin["prefix"].items():
            out.append(f"| {k} | {v['cold_ms_per_token']:.3f} | {v['after_16_token_hit_ms_per_token']:.3f} | "
                       f"{v['ratio']:.2f}x | {fmt(v['load_avg'], 1)} |")
        out.append("")
    bat = lin.get("batched_run")
    if bat:
        b0 = next(iter(bat["configs"].values()))
        batches = list(b0["ms_per_step_median"])
        out += [f"Batched decode (`benchmarks/linear.py --sections batched`, run {bat.get('started')}, {bat.get('cpu', {}).get('model', '?')}; "
                "512-token contexts; engines take turns round by round): median ms per step, wall (CPU ms of the "
                "process's threads: on a shared machine the wall time also counts other jobs' turns on the cores)", "",
                "| dtype / path | linear decision | weights held MB | " + " | ".join(f"batch {b}" for b in batches) + " | load |",
                "|---|---|---|" + "---|" * len(batches) + "---|"]
        for cfg, v in bat["configs"].items():
            how = (f"native <= {v['max_native_rows']} rows, then {v['batched']} GEMM" if v.get("batched")
                   else "torch matmuls on dense weights")
            out.append(f"| {cfg} | {v['dtype']}, {how} | "
                       f"{v['memory_bytes'] / 1e6:.0f} | " + " | ".join(
                           f"{v['ms_per_step_median'].get(b, 0):.1f} ({fmt(v.get('cpu_ms_per_step_median', {}).get(b))})"
                           for b in batches) + f" | {fmt(v['load_avg_mean'], 1)} |")
        out.append("")
    for prof in profs:
        if not prof:
            continue
        how = ""
        if "kernel_threads" in prof:
            how = (f" Run {prof['started']}; kernels on {prof['kernel_threads'].split(' (')[0]}, decode RoPE/KV "
                   f"write/attention {'fused into one call' if prof['fused_decode'] else 'as separate torch ops'}")
            if prof.get("fused_timed_as") == "attention":
                how += (", timed as attention; residual add + RMSNorm and SiLU*up "
                        + ("native (elementwise.c)." if prof.get("native_elementwise") else "as torch ops."))
            else:
                how += " (the attention column counts the separate ops only: fused, they fall under model other)."
        out += ["Decode step shares (`benchmarks/step_profile.py`; 512-token contexts): ms/step, then shares." + how
                + " `layers`: the decoder layers in one native call; `forward`: the whole forward in one (embedding"
                " to logits); x floor: the step / (weights as stored / the read bandwidth measured beside it).",
                "", "| dtype / path | batch | ms/step | x floor | linear | attention | layers | forward | model other "
                "| sampling | engine | load |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cfg, runs in prof.get("profiles", {}).items():
            for r in runs:
                sh = r["share"]
                ratio = f"{r['step_over_floor']:.2f}x" if "step_over_floor" in r else "-"
                out.append(f"| {cfg} | {r['batch']} | {r['step_ms']:.1f} | {ratio} | " + " | ".join(
                    f"{100 * sh[k]:.0f}%" if k in sh else "-"
                    for k in ("linear", "attention", "layers", "forward", "model other", "sampling", "engine"))
                    + f" | {fmt(r['load_avg'][1], 1)} |")
        out.append("")
    return out


def multihost_section(mh: dict | None) -> list[str]:
    lines = ["## KV transfer across two simulated hosts (`benchmarks/multihost_kv.py`)", ""]
    if mh is None:
        return lines + ["Run `sudo python benchmarks/multihost_kv.py` (network namespaces, a veth pair shaped with tc).", ""]
    lines += [f"1P1D, prefill in one network namespace and decode in another, KV over a veth pair (Ray object "
              f"transfer over TCP), {mh['config']['requests']} prompts of {mh['config']['prompt_tokens']} tokens "
              f"per rate; CPU {mh['machine'].get('cpu_model', '?')}. Bandwidth = KV bytes / (transfer start -> end) "
              "per request; link bytes = what the veth carried a -> b (KV + protocol).", "",
              "| shaped link | KV per request (MiB) | bandwidth median (MB/s) | range (MB/s) | achieved / shaped | link bytes / KV bytes |",
              "|---|---|---|---|---|---|"]
    for r in mh["rates"]:
        bw = r["bandwidth_bytes_per_s"]
        ratio = r["link_bytes_a_to_b"] / r["kv_bytes_total"] if r.get("kv_bytes_total") else None
        lines.append(f"| {r['rate']} | {fmt((r['kv_bytes_per_request'] or 0) / 2**20, 2)} | "
                     f"{fmt((bw['median'] or 0) / 1e6)} | {fmt((bw['min'] or 0) / 1e6)}-{fmt((bw['max'] or 0) / 1e6)} | "
                     f"{fmt(r['achieved_over_shaped'], 2)} | {fmt(ratio, 2)} |")
    return lines + [""]


def soak_section(soak: dict | None) -> list[str]:
    lines = ["## Soak (`benchmarks/soak.py`)", ""]
    if soak is None:
        return lines + ["Run `python benchmarks/soak.py` (10 minutes per mode).", ""]
    lines += [f"{soak['config']['minutes']:g} minutes per mode, {soak['config']['concurrency']} clients, mixed valid "
              "(~60%), invalid (~20%, each must be a 400) and dropped streams (~20%); resources after a settling "
              "pause against the baseline taken after warm-up; RSS sampled every "
              f"{soak['config'].get('sample_s', 30):g} s during the soak (growth from mid-soak to the end of the load "
              "must stay within "
              f"{soak['config'].get('plateau_tolerance', 0.02) * 100:g}% of the baseline: a warm-up plateaus, a leak "
              "keeps growing).", "",
              "| mode | requests | server errors | RSS baseline -> mid-soak -> after (MiB) | RSS growth, 2nd half | "
              "KV blocks after | fds baseline -> after | ok |",
              "|---|---|---|---|---|---|---|---|"]
    for r in soak["modes"]:
        b, a = r["baseline"], r["after_settle"]
        errors = sum(v for k, v in r["counts"].items() if k.split("_")[-1].startswith("5") and "503" not in k)
        mid = fmt(r["rss_mid_soak_mib"], 0) + " -> " if "rss_mid_soak_mib" in r else ""
        half = f"{r['rss_growth_second_half_mib']:+.0f} MiB" if "rss_growth_second_half_mib" in r else "-"
        lines.append(f"| {r['mode']} | {r['requests']} | {errors} | {fmt(b['rss_mib'], 0)} -> {mid}{fmt(a['rss_mib'], 0)} | "
                     f"{half} | {a['kv_blocks_used']:g} | {b['fds']} -> {a['fds']} | {'yes' if r['ok'] else 'NO'} |")
    for r in soak["modes"]:
        anon = r.get("anon_growth_mib_by_process")
        if anon:
            top = sorted(anon.items(), key=lambda kv: -abs(kv[1]))[:4]
            lines.append(f"\n{r['mode']}: private memory (RssAnon) after vs baseline, largest changes: "
                         + ", ".join(f"{k} {v:+.1f} MiB" for k, v in top) + ".")
        shm = {k: v for k, v in r.get("shmem_growth_mib_by_process", {}).items() if abs(v) >= 0.5}
        if shm:
            lines[-1] += (" Shared (RssShmem: pages of Ray's object store the process touched, bounded by the "
                          "store's size): " + ", ".join(f"{k} {v:+.1f} MiB" for k, v in shm.items()) + ".")
    return lines + [""]


def slo_section(r: dict | None) -> list[str]:
    """The adaptive budget against fixed budgets (benchmarks/slo_serving.py, issue 17)."""
    if r is None:
        return ["## SLO-aware serving", "", "Run `python benchmarks/slo_serving.py`.", ""]
    keys = [f"{t * 1e3:g}" for t in r["targets_s"]]
    m = r["machine"]
    step = f"{r['decode_step_s'] * 1e3:.0f} ms" if r.get("decode_step_s") else "given"
    times = (" and ".join(f"{t / r['decode_step_s']:.0f}x" for t in r["targets_s"]) if r.get("decode_step_s")
             else "given, not derived from")
    out = ["## SLO-aware serving (`benchmarks/slo_serving.py`, issue 17)", "",
           f"{m.get('cpu', m['processor'])}, {m['cores']} cores, {m['dtype']}, load average at start "
           f"{m['loadavg_at_start'][0]:.1f}. TBT targets {', '.join(k + ' ms' for k in keys)} ({times} the "
           f"decode step of the interference streams alone: {step}). Goodput: requests/s with TTFT <= "
           f"{r['ttft_slo_s']:g} s and TPOT <= the target. 'held': ITL p99 <= 1.15 x the target.", ""]
    if r.get("code_note"):
        out += [f"Code: {r['code_note']}.", ""]
    if r.get("rounds"):
        out += [f"Each configuration ran {r.get('rounds_done', r['rounds'])} time(s), interleaved (round k in forward "
                "order, the next backward) so that the shared machine's drifting load falls on all alike; the "
                "figures pool every round's gaps and TTFTs; 'per round' gives each round's ITL p99 / TTFT p50 and "
                f"the 1-minute load average when it started. Load at the end: {fmt((m.get('loadavg_at_end') or [None])[0])}.", ""]
    for w, results in r["workloads"].items():
        out += [f"### {w}", "",
                "| config | ITL p50 | ITL p99 | TTFT p50 | TTFT p99 | "
                + " | ".join(f"TBT attainment @{k} ms" for k in keys) + " | "
                + " | ".join(f"goodput @{k} ms" for k in keys) + " | adaptive: budget p50, prefill in mixed iterations "
                "p50, infeasible, pred. error p50, error factor at end | per round: ITL p99 / TTFT p50 (load) |",
                "|---|" + "---:|" * (4 + 2 * len(keys)) + "---|---|"]
        for name, v in results.items():
            a = v.get("adaptive")
            extra = (f"{a['budget_p50']:.0f}, {fmt(a.get('mixed_prefill_tokens_p50'), 0)}, {a['num_infeasible']}, "
                     f"{a['prediction_error_p50'] * 100:.0f}%, "
                     + "/".join(f"{x:.2f}" for x in a.get("error_factor_end") or [] if x is not None)
                     if a else "")
            per_round = "; ".join(f"{x['itl_p99_s'] * 1e3:.0f} ms / {x['ttft_p50_s']:.2f} s ({x['loadavg_1m_before']:.1f})"
                                  for x in v.get("rounds", []))
            out.append(f"| {name} | {v['itl_p50_s'] * 1e3:.0f} ms | {v['itl_p99_s'] * 1e3:.0f} ms | "
                       f"{v['ttft_p50_s']:.2f} s | {v['ttft_p99_s']:.2f} s | "
                       + " | ".join(f"{v['at'][k]['tbt_attainment'] * 100:.1f}%"
                                    + (" held" if v["at"][k]["holds"] else "") for k in keys) + " | "
                       + " | ".join(f"{v['at'][k]['goodput_rps']:.3f}/s" for k in keys) + f" | {extra} | {per_round} |")
        for c in r["acceptance"].get(w, []):
            verdict = ("no fixed budget holds it here: nothing to match" if c["passed"] is None
                       else f"adaptive TTFT p50 / best holding fixed ({c['best_fixed']}) = {c['ttft_ratio']:.2f}; "
                            f"{'PASS' if c['passed'] else 'MISS'}")
            out.append(f"\nTarget {c['target_ms']:g} ms (all rounds pooled): fixed budgets that hold it: "
                       f"{', '.join(c['fixed_that_hold']) or 'none'}; adaptive holds it: {c['adaptive_holds']}; "
                       f"{verdict}.")
        for i, checks in enumerate(r.get("acceptance_per_round", {}).get(w, []), start=1):
            out.append(f"\nRound {i} alone: " + "; ".join(
                f"{c['target_ms']:g} ms: " + ("nothing to match" if c["passed"] is None else
                                              f"{'PASS' if c['passed'] else 'MISS'} (TTFT ratio {c['ttft_ratio']:.2f}, "
                                              f"adaptive {'holds' if c['adaptive_holds'] else 'does not hold'})")
                for c in checks) + ".")
        out.append("")
    return out


# Served tables measured before the rounds protocol (one round per server, a fixed order, four requests
# at concurrency 1, llama.cpp at -t 2 under OMP_WAIT_POLICY=PASSIVE without a search): withdrawn from
# this document (issue 35); their JSON files stay in results/ as a record.
WITHDRAWN_SERVED = ("serve_vs_peers_epyc*", "serve_vs_peers_xeon_amx*", "serve_vs_peers_phaselab_fp32",
                    "wait_policy_served_*")


def served_section(results: str, doc: dict | None, served_md: str | None) -> list[str]:
    """The rounds protocol's table (serve_vs_peers.md, rendered by the script from its JSON), then the
    list of withdrawn one-round tables."""
    import glob

    out: list[str] = []
    # the protocol's runs on other machines (serve_vs_peers.py --out results/serve_vs_peers_rounds_<cpu>.json),
    # each with its own markdown: a CPU's ratios are never carried to another
    others = []
    for path in sorted(glob.glob(os.path.join(results, "serve_vs_peers_rounds_*.json"))):
        md = os.path.splitext(path)[0] + ".md"
        other = load(path)
        if other is not None and other.get("protocol") and os.path.exists(md):
            with open(md) as f:
                others += f.read().strip().splitlines() + [""]
    if doc is not None and doc.get("protocol") and served_md:
        out += served_md.strip().splitlines() + [""] + others
    elif others:
        out += others
    else:
        out += ["No results of the rounds protocol yet: run `python benchmarks/serve_vs_peers.py` (about 40 "
                "minutes with the peers of `../shared/peers` installed).", ""]
    old = [f"`{pat}.json` ({n})" for pat in WITHDRAWN_SERVED
           if (n := len(glob.glob(os.path.join(results, pat + ".json"))))]
    if old:
        out += ["**Withdrawn.** The served tables of earlier sessions were measured with one round per server "
                "in a fixed order, four requests at concurrency 1, vLLM at one thread binding per run and "
                "llama.cpp at `-t 2` under `OMP_WAIT_POLICY=PASSIVE` (3x slower in its own llama-bench than "
                "with the OpenMP default on the AMX Xeon), with no search of either peer's settings. None of "
                "their ratios is carried here; their files stay in `benchmarks/results/` as a record: "
                + ", ".join(old) + ".", ""]
    return out


def notes_sections(results: str) -> list[str]:
    """The hand-written analyses (`results/notes/*.md`, one section each, named by the time they were
    written), newest first, verbatim: what a session measured with ad-hoc loops or read off several
    result files at once. Kept as files so that regenerating this document does not drop them."""
    folder = os.path.join(results, "notes")
    if not os.path.isdir(folder):
        return []
    out = []
    for name in sorted((f for f in os.listdir(folder) if f.endswith(".md")), reverse=True):
        with open(os.path.join(folder, name)) as f:
            out += f.read().rstrip("\n").splitlines() + [""]
    return out


def _plan_args(a: dict) -> str:
    keys = ("hardware", "slo_ttft_ms", "slo_tbt_ms", "attainment", "num_prompts", "input_len", "output_len", "budgets",
            "max_num_seqs", "params", "verify_top", "verify_runs")
    return "`" + " ".join(f"--{k.replace('_', '-')} {a[k]}" for k in keys if a.get(k) is not None) + "`"


def plan_verify_section(r: dict | None) -> list[str]:
    """`phaselab plan --verify` on this machine (issue 17): predicted vs measured goodput."""
    if r is None or "verify" not in r:
        return ["## plan --verify", "", "Run `phaselab plan --hardware cpu ... --verify --result-json "
                "benchmarks/results/plan_verify.json` (command in docs/slo.md).", ""]
    v = r["verify"]
    out = ["## `phaselab plan --verify` on this machine (issue 17)", "",
           f"Machine: {v.get('cpu', 'CPU not recorded')}. Arguments: {_plan_args(r.get('arguments') or {})}. "
           f"{r['definition']}. Verified: each configuration run for real (bundled model, in process) at its "
           "planned rate, several times alternated with the others; goodput there = requests meeting both SLOs per "
           f"second of the run, the median run's. Tolerance {v['tolerance']:.0%}.", "",
           "| rank | configuration | planned rate | attainment pred. | attainment meas. | goodput pred. | "
           "goodput meas. | error | each run's goodput | load | verdict |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for i, row in enumerate(v["rows"], start=1):
        runs = ", ".join(f"{m['goodput']:.3g}" for m in row.get("runs") or [])
        out.append(f"| {i} | {row['configuration']} | {row['rate']:.3g}/s | {row['attainment_predicted']:.0%} | "
                   f"{row['attainment_measured']:.0%} | {row['goodput_predicted']:.3g}/s | "
                   f"{row['goodput_measured']:.3g}/s | {row['goodput_error']:+.0%} | {runs or 'one run'} | "
                   f"{row['loadavg_1m']:.1f} | {'within' if row['within_tolerance'] else 'OUTSIDE'} |")
    return out + [""]


def wait_policy_section(r: dict | None, served: dict[str, dict] | None = None) -> list[str]:
    """Threads between kernel calls: OpenMP's wait policy and the kernel pool (benchmarks/wait_policy.py, issue 18)."""
    if r is None:
        return []
    import statistics

    cpu = r["cpu"]
    out = ["## Threads between kernel calls: OpenMP's wait policy and the kernel pool (`benchmarks/wait_policy.py`, "
           "issue 18)", "",
           f"{cpu.get('cpu_model')}; run {r['started']}, load average {r['loadavg_at_start']:.1f} at start, "
           f"{r.get('loadavg_at_end', 0):.1f} at end. The engine as served (`--dtype auto`), one process per "
           "configuration (OpenMP reads the variables when torch loads it); median decode-only iteration of "
           "512-token contexts, ms, the median over rounds and processes (each round's figures in brackets); "
           "CPU: the process's CPU seconds per wall second (2 = both threads busy all the time). "
           "'two at once': two identical processes on the same 2 cores, as two disaggregated workers run.", "",
           "| policy | processes | " + " | ".join(f"batch {b}" for b in r["batches"]) + " | CPU (batch 1) |",
           "|---|---|" + "---|" * len(r["batches"]) + "---|"]
    keys = sorted({(x["policy"], x["processes"]) for x in r["runs"]}, key=lambda k: (k[1], k[0]))
    for policy, n in keys:
        runs = [x for x in r["runs"] if x["policy"] == policy and x["processes"] == n]
        cells = []
        for b in r["batches"]:
            v = [x["batches"][str(b)]["step_ms"] for x in runs]
            cells.append(f"{statistics.median(v):.1f} ({', '.join(f'{y:.1f}' for y in v)})")
        cpu1 = [x["batches"][str(r["batches"][0])]["cpu_s_per_wall_s"] for x in runs]
        env = ", ".join(f"{k}={v}" for k, v in r["policies"][policy].items())
        out.append(f"| {policy} ({env}) | {'alone' if n == 1 else 'two at once'} | " + " | ".join(cells)
                   + f" | {statistics.median(cpu1):.2f} |")
    out.append("")
    if served:
        first = next(iter(served.values()))
        dates = ", ".join(f"{k} {d['servers']['phaselab']['date']}" for k, d in served.items())
        out += ["Served (`[GOMP_SPINCOUNT=20000] [PHASELAB_POOL=0] python benchmarks/serve_vs_peers.py --servers "
                "phaselab --phaselab-dtype auto`, one run each: spin-20000 and PASSIVE back to back, before the pool "
                "existed (the spinning run was made while `auto` still spun in `serve`, which these runs led to "
                "stop); pool and pool+spin-20000 later (pool: the phaselab run of the late-afternoon issue-18 table); "
                f"started {dates}; the same client and workloads as the served section; compare columns made close "
                "in time): output tok/s | TTFT p50 ms | ITL p50 ms. Beside the engine, `serve` runs its HTTP event "
                "loop and the client streams from the same 2 cores: there a spinning OpenMP thread holds a core "
                "they need, and with the pool an OpenMP spin brought nothing.",
                "", "| workload | " + " | ".join(served) + " |", "|---|" + "---|" * len(served)]
        for w in first["servers"]["phaselab"]["workloads"]:
            cells = []
            for d in served.values():
                v = d["servers"]["phaselab"]["workloads"][w]
                cells.append(f"{v['output_throughput']:.1f} \\| {v['median_ttft_ms']:.0f} \\| {v['median_itl_ms']:.1f}")
            out.append(f"| {w} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def kernel_isa_section(results: str) -> list[str]:
    """benchmarks/kernel_isa.py's files (kernel_isa*.json), one table per file, naming its CPU."""
    import glob

    files = sorted(glob.glob(os.path.join(results, "kernel_isa*.json")))
    lines = ["## The small-row linear kernel per instruction-set build (`benchmarks/kernel_isa.py`, issue 18)", ""]
    if not files:
        return lines + ["Run `python benchmarks/kernel_isa.py` to fill this section.", ""]
    for path in files:
        r = load(path)
        labels = list(r["builds"])
        bw = ", ".join(f"{lb} {r['builds'][lb]['read_GBps']:.1f}" for lb in labels)
        lines += [f"### {r['cpu']} ({', '.join(r['isa_flags'])}), `{os.path.basename(path)}`", "",
                  (f"`before` is commit {r['before_commit']}'s kernel, built the same way. " if "before_commit" in r else "")
                  + f"Read bandwidth (GB/s, measured in each build's process): {bw}. Builds took turns, best of "
                  "the rounds. ps per weight (x the floor of the weights as stored / read bandwidth; below 1x "
                  "where eight copies of a small layer stay in the 32 MiB L3). fp32 activations.", "",
                  "| format, layer, rows | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for case in r["builds"][labels[0]]["cases"]:
            cells = [r["builds"][lb]["cases"].get(case) for lb in labels]
            lines.append(f"| {case} | " + " | ".join(
                "-" if c is None else f"{c['ps_per_weight']:.0f} ({c['x_floor']:.2f}x)" for c in cells) + " |")
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ns = ap.parse_args()
    eng = load(os.path.join(ns.results, "engine.json"))
    roof = load(os.path.join(ns.results, "roofline.json"))
    fid = load(os.path.join(ns.results, "sim_fidelity.json"))
    served_path = os.path.join(ns.results, "serve_vs_peers.md")
    served = open(served_path).read() if os.path.exists(served_path) else None
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/results_md.py` from the JSON files in `benchmarks/results/`;"
             " the commands that make them are in each section. Numbers are from one 2-core shared machine:"
             " compare figures within a table (same run), not across runs.", ""]
    if eng is None:
        lines += ["Run `python benchmarks/roofline.py && python benchmarks/engine.py` first.", ""]
    else:
        lines += machine_section(eng, roof) + targets_section(eng, served) + engine_section(eng)
    lines += ["## Served against vLLM and llama.cpp, each at its best (`benchmarks/serve_vs_peers.py`)", ""]
    lines += served_section(ns.results, load(os.path.join(ns.results, "serve_vs_peers.json")), served)
    notes = notes_sections(ns.results)
    if notes:
        lines += ["## Kernel and decode-step analyses (session notes, issue 18)", "",
                  "Hand-written analyses of the sessions that tuned the kernels, newest first. The served "
                  "ratios against vLLM and llama.cpp quoted in them come from the withdrawn one-round tables "
                  "(previous section): read the protocol's table above for those.", ""]
        lines += notes
    lines += fidelity_section(fid)
    lines += validation_section(load(os.path.join(ns.results, "sim_validation.json")))
    lin = load(os.path.join(ns.results, "linear.json"))
    bat = load(os.path.join(ns.results, "linear_batched.json"))
    if lin is not None and bat is not None:
        lin["batched_run"] = {"configs": bat["batched"], "started": bat.get("started"), "cpu": bat.get("cpu")}
    lines += linear_section(lin, *(load(os.path.join(ns.results, f)) for f in
                                   ("step_profile.json", "step_profile_fused.json", "step_profile_before.json",
                                    "step_profile_earlier.json")))
    lines += kernel_isa_section(ns.results)
    lines += multihost_section(load(os.path.join(ns.results, "multihost_kv.json")))
    lines += soak_section(load(os.path.join(ns.results, "soak.json")))
    lines += slo_section(load(os.path.join(ns.results, "slo_serving.json")))
    lines += plan_verify_section(load(os.path.join(ns.results, "plan_verify.json")))
    served_policies = {name: load(os.path.join(ns.results, f"wait_policy_served_{stem}.json"))
                       for name, stem in (("spin-20000", "spin"), ("PASSIVE", "passive"), ("pool", "pool"),
                                          ("pool+spin-20000", "pool_spin"))}
    lines += wait_policy_section(load(os.path.join(ns.results, "wait_policy.json")), None)
    del served_policies  # their served runs (one round each) are withdrawn with the peer tables
    with open(ns.out, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
