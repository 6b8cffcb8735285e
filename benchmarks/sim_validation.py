"""Validation of the simulator's cost model against published GPU serving results (issue 15, item 5).

Nothing here is fitted on these results: the GPU cost parameters are the shipped fits of Vidur's
operator profiles (phaselab/cost/data/fits/, `phaselab simulate fit`) plus the documented
FlashAttention-style attention efficiency; this script only runs the simulator and compares.
Each case writes down our reading of the published setup, the published number, ours, and the
ratio predicted / published (target 0.7-1.3; a miss is reported with its cause, never tuned away).

    python benchmarks/sim_validation.py [--quick] [--out benchmarks/results/sim_validation.json]

Cases:
  kv_sizing        DistServe (OSDI'24): KV cache of one 512-token OPT-66B request
  iteration_times  Splitwise (ISCA'24): Llama-2-70B prompt and token iteration times, A100/H100, TP8
  chunk_overhead   Sarathi-Serve (OSDI'24) section 5.4: prefill time in chunks vs in one pass, by chunk size
  capacity_gain    Sarathi-Serve: capacity under a strict P99 TBT SLO, chunked (budget 512) vs prefill-first
  distserve_motivation  DistServe section 2.3: colocated vs 2P:1D goodput per GPU, 13B, 512/64, one A100
  placement        DistServe / simdistserve: best placement and per-GPU goodput, OPT-13B on 4 x A100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from phaselab.core.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from phaselab.core.sampling_params import SamplingParams  # noqa: E402
from phaselab.cost.catalog import get_hardware, get_link, get_model  # noqa: E402
from phaselab.cost.pricing import RooflineCostModel, default_params  # noqa: E402
from phaselab.sim.deployment import Deployment, RoleConfig  # noqa: E402
from phaselab.sim.loop import simulate  # noqa: E402
from phaselab.sim.search import SLO, candidates, max_rate  # noqa: E402
from phaselab.sim.workload import random_requests  # noqa: E402
from phaselab.workload.arrivals import ArrivalPlan  # noqa: E402

SP = SamplingParams()
TARGET = (0.7, 1.3)


def plan_of(entries: list[tuple[int, int]]) -> SchedulerOutput:
    """(start_position, num_tokens) per request; every entry samples."""
    return SchedulerOutput(0, [ScheduledRequest(str(i), [0] * n, s, [], [], True, n > 1, SP)
                               for i, (s, n) in enumerate(entries)])


def row(case: str, what: str, published: float, predicted: float, unit: str, source: str,
        note: str = "") -> dict[str, Any]:
    ratio = predicted / published if published else float("nan")
    return {"case": case, "what": what, "published": published, "predicted": predicted, "unit": unit,
            "ratio": ratio, "within_target": bool(TARGET[0] <= ratio <= TARGET[1]), "source": source, "note": note}


# -- 1. KV sizing --------------------------------------------------------------------------------------------
def kv_sizing() -> list[dict[str, Any]]:
    """DistServe section 2.3 / 4: "the KV cache of a single 512-token request of OPT-66B is about
    1.13 GB". OPT-66B: 64 layers, hidden 9216, MHA (72 heads x 128), fp16: 2 x 64 x 9216 x 2 bytes
    per token. Their GB is GiB (2^30): 1.13 GiB; in decimal GB ours would be 1.21."""
    m = get_model("opt-66b")
    per_request = m.kv_bytes_per_token(2) * 512
    return [row("kv_sizing", "KV of one 512-token OPT-66B request (fp16)", 1.13, per_request / 2**30, "GiB",
                "DistServe (Zhong et al., OSDI'24), section 2.3: 1.13 GB for a 512-token OPT-66B request")]


# -- 2. Splitwise iteration times ----------------------------------------------------------------------------
# Splitwise's characterization of Llama-2-70B on DGX-A100 and DGX-H100, TP8 (vLLM-based), as published
# in its simulator's input table github.com/Mutinifni/splitwise-sim data/perf_model.csv (5 runs each;
# median of them here, ms). prompt_time: the prompt iteration of a batch of prompts; token_time: one
# token iteration of the batch (prompt 512, 128 output tokens: mean context ~576). The issue names
# TP4; the table has TP8 (and a TP2 set) for this model, so TP8 is what is compared.
SPLITWISE_TP8 = {  # device -> {(kind, prompt tokens, batch): ms}
    "a100": {("prompt", 512, 1): 94.31, ("prompt", 1024, 1): 154.46, ("prompt", 2048, 1): 274.22,
             ("prompt", 4096, 1): 661.22, ("prompt", 8192, 1): 1549.82, ("prompt", 512, 8): 767.62,
             ("token", 512, 1): 44.85, ("token", 512, 8): 46.47, ("token", 512, 32): 53.02,
             ("token", 512, 64): 71.61},
    "h100": {("prompt", 512, 1): 53.39, ("prompt", 1024, 1): 77.91, ("prompt", 2048, 1): 136.80,
             ("prompt", 4096, 1): 390.29, ("prompt", 8192, 1): 844.89, ("prompt", 512, 8): 371.63,
             ("token", 512, 1): 29.76, ("token", 512, 8): 32.50, ("token", 512, 32): 38.62,
             ("token", 512, 64): 50.16},
}
SPLITWISE_SOURCE = ("Splitwise (Patel et al., ISCA'24) characterization, Llama-2-70B TP8, as its simulator's input "
                    "github.com/Mutinifni/splitwise-sim data/perf_model.csv (median of 5 runs)")


def iteration_times() -> list[dict[str, Any]]:
    out = []
    m = get_model("llama-2-70b")
    for dev, table in SPLITWISE_TP8.items():
        hw = get_hardware(dev)
        cm = RooflineCostModel(m, hw, tp=8, tp_link=get_link(hw.tp_link))
        for (kind, prompt, batch), ms in table.items():
            if kind == "prompt":
                plan = plan_of([(0, prompt)] * batch)
            else:
                plan = plan_of([(prompt + 64, 1)] * batch)
            c = cm.predict(plan)
            note = (f"overhead {c.overhead_s * 1e3:.1f} ms, GEMMs {c.linear_s * 1e3:.1f} ({c.linear_bound}), attention "
                    f"{c.attention_s * 1e3:.1f}, all-reduce {c.allreduce_s * 1e3:.1f}, elementwise "
                    f"{c.elementwise_s * 1e3:.1f}")
            out.append(row("iteration_times", f"{dev} TP8 {kind} iteration, prompt {prompt}, batch {batch}", ms,
                           c.duration_ns / 1e6, "ms", SPLITWISE_SOURCE, note))
    return out


# -- 3. Chunked-prefill overhead -----------------------------------------------------------------------------
def chunk_overhead() -> list[dict[str, Any]]:
    """Sarathi-Serve section 5.4 ('Overhead of chunked-prefills'), our reading: Yi-34B on 2 A100s
    (TP2), a long prompt prefilled alone in chunks of 512, 1024, 2048 vs in one pass; the paper
    reports the overhead falling with the chunk size, at most about 25% at chunk 512 (our reading of
    its figure; approximate, the figure's exact values are not re-read here). We predict the sum of
    the chunks' iteration times over the one-pass time for prompts of 4k, 8k and 16k tokens (Yi-34B's
    4k context limit aside: the 200K config has the same shapes)."""
    m = get_model("yi-34b")
    hw = get_hardware("a100")
    cm = RooflineCostModel(m, hw, tp=2, tp_link=get_link("nvlink3"))
    out = []
    for prompt in (4096, 8192, 16384):
        whole = cm.predict(plan_of([(0, prompt)])).duration_ns
        overheads = {}
        for chunk in (512, 1024, 2048):
            total = sum(cm.predict(plan_of([(s, min(chunk, prompt - s))])).duration_ns for s in range(0, prompt, chunk))
            overheads[chunk] = total / whole - 1
        trend = overheads[512] > overheads[1024] > overheads[2048] >= 0
        r = row("chunk_overhead", f"Yi-34B TP2 A100, {prompt}-token prompt: overhead at chunk 512", 0.25,
                overheads[512], "fraction", "Sarathi-Serve (Agrawal et al., OSDI'24), section 5.4, figure "
                "'overhead of chunked prefills' (our approximate reading: up to ~25% at chunk 512)",
                "overhead by chunk: " + ", ".join(f"{c}: {v:+.1%}" for c, v in overheads.items())
                + f"; falls with chunk size: {trend}")
        r["trend_right"] = trend
        r["overhead_by_chunk"] = overheads
        out.append(r)
    return out


# -- workloads ---------------------------------------------------------------------------------------------
def lognormal_workload(num: int, in_median: int, in_sigma: float, out_median: int, out_sigma: float, max_len: int,
                       seed: int):
    """Requests with lognormal prompt and output lengths (chat-like), each fitting max_len."""
    def at(rate: float):
        reqs = random_requests(num, f"lognormal:{in_median}:{in_sigma}", f"lognormal:{out_median}:{out_sigma}", seed,
                               ArrivalPlan(request_rate=rate))
        out = []
        for r in reqs:
            p = min(r.num_prompt_tokens, max_len // 2)
            out.append(dataclasses.replace(r, num_prompt_tokens=p, max_tokens=min(r.max_tokens, max_len - p - 1)))
        return out
    return at


# DistServe's ShareGPT for OPT-13B (its OPT tokenizer, prompt + output within the 2048 context): the
# 5%-quantiles of prompt and output lengths of the 300 requests of DistServe's own measured run
# (github.com/LLMServe/DistServe simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/
# distserve-300-3.exp, prompt_len / output_len of each request; only these quantiles are kept here).
# Mean prompt 780, median 758; mean output 176, median 67: prompts far longer, outputs shorter and
# more skewed than a lognormal chat guess (their log-correlation is -0.13: drawn independently here).
DISTSERVE_SHAREGPT_PROMPT_Q = (9, 31, 94, 180, 279, 345, 430, 501, 573, 658, 758, 821, 867, 972, 1047, 1157, 1319,
                               1421, 1512, 1718, 2003)
DISTSERVE_SHAREGPT_OUTPUT_Q = (2, 5, 9, 12, 14, 18, 23, 33, 36, 48, 67, 112, 164, 201, 236, 278, 337, 403, 478, 594,
                               1085)


def quantile_workload(num: int, prompt_q: tuple[int, ...], output_q: tuple[int, ...], max_len: int, seed: int):
    """Requests whose prompt and output lengths are drawn from the given evenly spaced quantiles
    (inverse CDF, linear between them), each fitting max_len."""
    rng = np.random.default_rng(seed)

    def draw(q: tuple[int, ...]) -> np.ndarray:  # stratified: one draw per 1/num of probability, shuffled
        u = (rng.permutation(num) + rng.random(num)) / num
        return np.rint(np.interp(u, np.linspace(0.0, 1.0, len(q)), q)).astype(int)

    prompts, outputs = draw(prompt_q), draw(output_q)

    def at(rate: float):
        reqs = random_requests(num, "1", "1", seed, ArrivalPlan(request_rate=rate))
        return [dataclasses.replace(r, num_prompt_tokens=int(p), max_tokens=int(min(o, max_len - p)))
                for r, p, o in zip(reqs, prompts, outputs)]
    return at


# -- 4. Capacity gain of chunked prefill under a TBT SLO -----------------------------------------------------------
def capacity_gain(quick: bool) -> list[dict[str, Any]]:
    """Sarathi-Serve abstract / section 5.1: capacity (the highest load at which P99 TBT stays under
    the SLO and scheduling delay is bounded) of Mistral-7B on one A100 improves by up to 2.6x over
    vLLM under the strict SLO. Our reading of the setup: vLLM = prefill-first scheduling with max
    batch 32/64/128 (best taken), Sarathi-Serve = chunked, token budget 512; strict P99 TBT SLO 0.1 s
    for Mistral-7B (our reading of its SLO table: strict = 5x a decode iteration's time); median
    scheduling delay <= 2 s; workload: openchat_sharegpt4-like chat lengths, approximated here by
    lognormal prompts (median 1024, sigma 0.8) and outputs (median 256, sigma 0.8) capped to the 8k
    context, Poisson arrivals."""
    m, hw = get_model("mistral-7b"), get_hardware("a100")
    n = 150 if quick else 300
    workload = lognormal_workload(n, 1024, 0.8, 256, 0.8, 8192, seed=0)
    slo = SLO("capacity", tbt_p99_s=0.1, max_queue_s=2.0)
    base = dict(max_model_len=8192)
    rates = {}
    for label, rc in [("prefill-first, max batch 32", RoleConfig(policy="prefill-first", max_num_seqs=32)),
                      ("prefill-first, max batch 64", RoleConfig(policy="prefill-first", max_num_seqs=64)),
                      ("prefill-first, max batch 128", RoleConfig(policy="prefill-first", max_num_seqs=128)),
                      ("chunked, budget 512", RoleConfig(policy="chunked", max_num_batched_tokens=512,
                                                         max_num_seqs=128))]:
        d = Deployment(m, hw, colocated=rc, **base)
        c = max_rate(d, workload, slo, start_rate=1.0, num_bisections=4 if quick else 6)
        rates[label] = c.rate
        print(f"  capacity {label}: {c.rate:.3g} req/s ({c.num_simulations} simulations)", file=sys.stderr)
    best_pf = max(v for k, v in rates.items() if k.startswith("prefill-first"))
    gain = rates["chunked, budget 512"] / best_pf if best_pf else float("inf")
    r = row("capacity_gain", "Mistral-7B, 1 x A100, strict P99 TBT 0.1 s: chunked (512) / best prefill-first", 2.6,
            gain, "x", "Sarathi-Serve (Agrawal et al., OSDI'24), abstract and section 5.1: up to 2.6x for Mistral-7B "
                       "on one A100 (strict SLO)", "capacities (req/s): " + ", ".join(f"{k} {v:.3g}"
                                                                                     for k, v in rates.items()))
    r["trend_right"] = gain > 1
    r["rates"] = rates
    return [r]


# -- 5. DistServe placement ----------------------------------------------------------------------------------
def bisect_rate_per_gpu(d: Deployment, workload: Any, slo: SLO, hi: float = 5.0, tol: float = 0.25) -> float:
    """DistServe's search (simdistserve): bisect the per-GPU rate in [0, max-per-gpu-rate] until
    hi - lo < tol; the highest rate that met the SLO."""
    lo = 0.0
    while hi - lo >= tol:
        mid = (lo + hi) / 2
        result = simulate(d, workload(mid * d.num_gpus), ArrivalPlan(self_timed=True), record_iterations=False)
        ok, _ = slo.check(result.requests)
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def distserve_motivation(quick: bool) -> list[dict[str, Any]]:
    """DistServe section 2.3, Figure 1 (our reading): a 13B model (OPT-13B) on one A100 80GB,
    input 512 and output 64 tokens, SLO P90 TTFT 0.4 s and P90 TPOT 0.04 s; the colocated system
    (vLLM) sustains 1.6 req/s of goodput on one GPU; disaggregated, 2 prefill GPUs + 1 decode GPU
    sustain 10 req/s, 3.3 req/s per GPU (2.1x). Ours: the same lengths, Poisson arrivals, 90%
    attainment of both SLOs, colocated prefill-first (vLLM-like) vs 2P:1D TP1 pools over NVLink."""
    m, hw = get_model("opt-13b"), get_hardware("a100")
    n = 200 if quick else 400
    workload = lambda rate: random_requests(n, "512", "64", 0, ArrivalPlan(request_rate=rate))  # noqa: E731
    slo = SLO("goodput", ttft_s=0.4, tpot_s=0.04, attainment=0.9)
    colo = Deployment(m, hw, colocated=RoleConfig(policy="prefill-first"), max_model_len=2048)
    disagg = Deployment(m, hw, "disagg", num_prefill=2, num_decode=1, prefill=RoleConfig(policy="prefill-first"),
                        decode=RoleConfig(), max_model_len=2048)
    r_colo = bisect_rate_per_gpu(colo, workload, slo, hi=20.0, tol=0.1)
    r_dis = bisect_rate_per_gpu(disagg, workload, slo, hi=20.0, tol=0.1)
    src = "DistServe (Zhong et al., OSDI'24), section 2.3 and Figure 1 (13B model, one A100, 512 in / 64 out)"
    a = row("distserve_motivation", "OPT-13B 512/64, TTFT 0.4 s, TPOT 0.04 s: colocated goodput per GPU", 1.6, r_colo,
            "req/s/GPU", src)
    b = row("distserve_motivation", "same, disaggregated 2P:1D (TP1): goodput per GPU", 3.3, r_dis, "req/s/GPU", src,
            f"gain disagg / colocated: ours {r_dis / r_colo:.2f}x, published 2.1x" if r_colo else "")
    b["trend_right"] = r_dis > r_colo
    return [a, b]


def placement(quick: bool) -> list[dict[str, Any]]:
    """DistServe's simulator README (github.com/LLMServe/DistServe simdistserve/README.md): OPT-13B,
    ShareGPT, one node of 4 x A100 80GB, DistServe's backend (disaggregated placements only), SLO
    TTFT 200 ms and TPOT 100 ms at 90% attainment, 300 requests, per-GPU rate bisected in [0, 5]
    to 0.25: best config prefill TP2 + decode TP1 (pp 1), 1.56 req/s per GPU. Ours: the same search
    space (P:D engine ratios and TP per phase within 4 GPUs, prefill engines batching whole prompts),
    KV over NVLink in the node, the same bisection of the per-GPU rate in [0, 5] to 0.25 (with the
    lognormal lengths guessed before, several placements predicted more than 5 and the search ran in
    [0, 20]; with DistServe's own lengths none comes near 5);
    ShareGPT as DistServe tokenized it for OPT-13B: lengths drawn from the quantiles of DistServe's
    own measured ShareGPT run (DISTSERVE_SHAREGPT_*_Q; mean prompt 780, mean output 176).

    The published best placement is not a physical one: simdistserve's simulate_dist.py (the stored
    LLMServe/DistServe versions) builds one WorkerConfig with TP_Decode=TP_Prefill for both pools, so
    its "tp_prefill=2, tp_decode=1" decodes at TP2 speed while counting the decode instance as one
    GPU. Our placement is compared with it as published, and this is said in the row's note."""
    m, hw = get_model("opt-13b"), get_hardware("a100")
    n = 150 if quick else 300
    workload = quantile_workload(n, DISTSERVE_SHAREGPT_PROMPT_Q, DISTSERVE_SHAREGPT_OUTPUT_Q, 2048, seed=0)
    slo = SLO("goodput", ttft_s=0.2, tpot_s=0.1, attainment=0.9)
    deps = candidates(m, hw, 4, modes=("disagg",), tps=(1, 2, 4), budgets=(2048,), max_pool=3,
                      base=dict(max_model_len=2048), prefill_policies=("prefill-first",))
    t0 = time.perf_counter()
    ranked = []
    for i, d in enumerate(deps):
        rate = bisect_rate_per_gpu(d, workload, slo)
        ranked.append((rate, d))
        print(f"  [{i + 1}/{len(deps)}] {d.describe()}: {rate:.3g} req/s/GPU ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    ranked.sort(key=lambda x: -x[0])
    best_rate, d = ranked[0]
    ours = f"{d.num_prefill}P TP{d.prefill.tp} + {d.num_decode}D TP{d.decode.tp}"
    placement_right = d.prefill.tp == 2 and d.decode.tp == 1 and d.num_prefill == 1 and d.num_decode == 1
    r = row("placement", "OPT-13B, 4 x A100, TTFT 0.2 s / TPOT 0.1 s at 90%: best per-GPU goodput", 1.56,
            best_rate, "req/s/GPU", "DistServe simdistserve README (LLMServe/DistServe): best config tp_prefill=2, "
                                    "tp_decode=1, 1.56 req/s per GPU",
            f"our best: {ours}; published best: 1P TP2 + 1D TP1 (simdistserve simulates that decode instance at "
            f"TP2: TP_Decode=TP_Prefill in its simulate_dist.py); same placement: {placement_right}; ranked: "
            + "; ".join(f"{x.num_prefill}P TP{x.prefill.tp}:{x.num_decode}D TP{x.decode.tp} {v:.3g}"
                        for v, x in ranked[:6]))
    r["trend_right"] = placement_right
    r["ranked"] = [{"deployment": x.describe(), "per_gpu": v} for v, x in ranked]
    return [r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per simulation (smoke run)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/sim_validation.json "
                                                "(sim_validation_quick.json with --quick)")
    ap.add_argument("--cases", default="kv_sizing,iteration_times,chunk_overhead,capacity_gain,distserve_motivation,"
                                       "placement")
    ns = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    out = ns.out or os.path.join(here, "results", "sim_validation_quick.json" if ns.quick else "sim_validation.json")
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in ns.cases.split(","):
        print(f"{case} ...", file=sys.stderr)
        fn = globals()[case]
        rows += fn(ns.quick) if case in ("capacity_gain", "placement", "distserve_motivation") else fn()
    params = {dev: default_params(get_hardware(dev)).to_json() for dev in ("a100", "h100")}
    ratios = [r["ratio"] for r in rows]
    report = {"benchmark": "sim_validation", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": ns.quick,
              "target": list(TARGET), "wall_s": time.perf_counter() - t0, "python": platform.python_version(),
              "rows": rows, "num_within_target": sum(r["within_target"] for r in rows), "num_rows": len(rows),
              "geomean_ratio": float(np.exp(np.mean(np.log(ratios)))),
              "cost_params": params}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    print(f"{'case':<16} {'published':>10} {'ours':>10} {'ratio':>6}  what")
    for r in rows:
        flag = "" if r["within_target"] else "  MISS"
        print(f"{r['case']:<16} {r['published']:>10.4g} {r['predicted']:>10.4g} {r['ratio']:>6.2f}  {r['what']}{flag}")
    print(f"{report['num_within_target']}/{len(rows)} within {TARGET}; written to {out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
