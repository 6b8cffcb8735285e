"""phaselab's engine speed next to Hugging Face transformers, in one process run, as ratios to the roofline.

    python benchmarks/engine.py                       # everything, bf16 and fp32 (tens of minutes)
    python benchmarks/engine.py --quick               # tiny sizes: a smoke run of every code path
    python benchmarks/engine.py --dtypes bfloat16 --sections decode --batches 1 32 --trials 5

Sections (--sections), each for every --dtypes, phaselab and transformers on the same weights (the
bundled GGUF, dequantized), trials interleaved (phaselab, transformers, phaselab, ...) so that drift
on a shared machine hits both; figures are medians of --trials with min/max:

  prefill  tokens/s of ONE forward pass that fills the cache with an N-token prompt (--prefill-lengths,
           default 128 512 2048 4096) and samples its last row. phaselab: the wall time of the engine
           step() (schedule + prepare + forward + sample + output handling; forward alone reported
           too); transformers: model(ids, use_cache=True, logits_to_keep=1), as its generate() runs
           a prefill. Also the achieved FLOP/s (modeled FLOPs, phaselab/cost/formulas.py) as a fraction of
           the measured layer-mix GEMM rate of that dtype (issue 9 target >= 85% at 512 and 2048).
  decode   ms per step at batch B (--batches, default 1 8 32 64) with --context (512) tokens cached
           per request: the median of --decode-steps (16) consecutive steps. The context is prefilled
           once; phaselab copies its K/V into B requests (LLMEngine.add_prefilled_request, the decode
           side of disaggregated serving), transformers repeats its DynamicCache B times, so a trial
           costs no B x 512 prefill. Ratios to the floor of exactly those steps (max of compute and
           bandwidth) and to the bandwidth floor alone (targets: batch 1 <= 1.5x the bandwidth floor,
           batch 32 <= 1.5x the floor) and the speedup over transformers (target >= 4x at 32).
  offline  a fixed workload: --offline-requests (64) prompts of --offline-prompt-len (512) random
           tokens, --offline-output-len (128) greedy tokens each, EOS ignored. phaselab:
           LLM.generate(all prompts); transformers: generate() batched (left padding, greedy,
           max_new_tokens = min_new_tokens = 128) in sub-batches of --hf-batch (default: all at
           once). Output tokens/s and wall time, ratio to the workload's floor (one prefill of all
           prompts + every decode step at full batch), speedup (target >= 8x).

Every run section also reports peak resident memory (ru_maxrss of the process, and the peak during
each engine's runs from /proc/self/status VmHWM, reset per run) and the KV cache: phaselab's budget
(allocated once) vs the most blocks in use, transformers' DynamicCache bytes (it grows on demand).

Floors come from benchmarks/roofline.py: --roofline JSON (default benchmarks/results/roofline.json;
run `python benchmarks/roofline.py` first in the same quiet window), else a quick measurement made
here (the JSON says which). The JSON (--out; default benchmarks/results/engine.json, with --quick
engine_quick.json so a smoke run never overwrites real figures) is rewritten after every section,
so a long run that is cut short keeps what it measured. Machine (CPU flags, threads, wait policy),
versions, phaselab's git commit and the load average before/after each section are in it too.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from roofline import Roofline, load_or_measure, plan_of

from phaselab import LLM, SamplingParams
from phaselab.engine_args import EngineArgs
from phaselab.core.timing import RequestMetrics
from phaselab.engine.engine import LLMEngine
from phaselab.engine.runner import kv_block_bytes
from phaselab.model.loader import load_checkpoint
from phaselab.modelinfo.bundled import default_model_path

SECTIONS = ("prefill", "decode", "offline")
BLOCK_SIZE = 16
FULL = {"prefill_lengths": [128, 512, 2048, 4096], "batches": [1, 8, 32, 64], "context": 512, "decode_steps": 16,
        "offline_requests": 64, "offline_prompt_len": 512, "offline_output_len": 128, "trials": 3}
QUICK = {"prefill_lengths": [32, 128], "batches": [1, 4], "context": 64, "decode_steps": 4,
         "offline_requests": 4, "offline_prompt_len": 64, "offline_output_len": 16, "trials": 2}
# issue 9's targets; checked where this run measured the figure (report every figure, met or not)
TARGETS = {
    "prefill_gemm_fraction_min": 0.85, "prefill_target_lengths": [512, 2048], "prefill_target_dtype": "bfloat16",
    "decode_floor_ratio_max": 1.5, "decode_floor_target_batches": [1, 32],
    "decode_floor_note": "batch 1 against the bandwidth floor (bytes / read bandwidth), batch 32 against the floor",
    "decode_speedup_min": 4.0, "decode_speedup_batch": 32,
    "offline_speedup_min": 8.0,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_s(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = max(0, round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "spread_pct": 100 * (max(xs) - min(xs)) / statistics.median(xs) if statistics.median(xs) else 0.0}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- machine, memory, progress ---------------------------------------------------------------------

def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model": model, "flags": {f: f in flags for f in wanted}}


def git_state() -> dict[str, Any]:
    root = os.path.join(HERE, "..")
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "phaselab"], capture_output=True,
                               text=True, timeout=10, check=False).stdout.strip()
        return {"commit": head, "phaselab_dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {}


def machine_info() -> dict[str, Any]:
    import transformers

    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu_info(), "cores": os.cpu_count(), "memory_bytes": mem_total, "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkldnn": torch.backends.mkldnn.is_available(),
        "torch_num_threads": torch.get_num_threads(), "torch_num_interop_threads": torch.get_num_interop_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_at_start": list(os.getloadavg()), "phaselab_git": git_state(),
    }


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
        return True
    except OSError:
        return False


class MemWatch:
    """Peak resident memory per engine within a section: VmHWM is reset before each run and read
    after it; ru_maxrss (never reset) is the process peak since it started."""

    def __init__(self) -> None:
        self.by_engine: dict[str, dict[str, int | None]] = {}
        self.reset_ok = True

    def run(self, engine: str, fn: Callable[[], Any]) -> Any:
        gc.collect()
        self.reset_ok = _reset_hwm() and self.reset_ok
        before = _status_bytes("VmRSS")
        out = fn()
        peak = _status_bytes("VmHWM") if self.reset_ok else None
        d = self.by_engine.setdefault(engine, {"rss_before_bytes": before, "peak_rss_bytes": None})
        if peak is not None and (d["peak_rss_bytes"] is None or peak > d["peak_rss_bytes"]):
            d["peak_rss_bytes"] = peak
            d["rss_before_bytes"] = before
            d["peak_increase_bytes"] = peak - before if before is not None else None
        return out

    def report(self) -> dict[str, Any]:
        return {"ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "rss_now_bytes": _status_bytes("VmRSS"),
                "per_engine": self.by_engine,
                "note": "per_engine: peak RSS (VmHWM, reset before each run) during that engine's runs of this "
                        "section, with both engines' weights resident; ru_maxrss: process peak since start"
                        + ("" if self.reset_ok else "; VmHWM reset unavailable, per-engine peaks missing")}


class Progress:
    """Progress with an ETA for one section. Units are weighted by their floor time, so the estimate
    learns the measured/floor ratio from the units done and applies it to the ones left."""

    def __init__(self, name: str, weights: list[float], guess_ratio: float = 4.0) -> None:
        self.name, self.total, self.done, self.n, self.i = name, sum(weights), 0.0, len(weights), 0
        self.t0 = time.perf_counter()
        log(f"[{name}] {self.n} runs; first guess {fmt_s(self.total * guess_ratio)} (floor x {guess_ratio:g})")

    def tick(self, weight: float, msg: str) -> None:
        self.done += weight
        self.i += 1
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done > 0 else float("nan")
        log(f"[{self.name}] {self.i}/{self.n} {msg}  | elapsed {fmt_s(el)}, ETA {fmt_s(eta)}")


# -- the engines -----------------------------------------------------------------------------------

def kv_blocks_needed(sizes: dict, sections: list[str]) -> int:
    need = [1]
    if "prefill" in sections:
        need.append(cdiv(max(sizes["prefill_lengths"]) + 2, BLOCK_SIZE))
    if "decode" in sections:  # the parked source of the K/V + the batch, each with its decode steps
        need.append((max(sizes["batches"]) + 1) * cdiv(sizes["context"] + sizes["decode_steps"] + 2, BLOCK_SIZE))
    if "offline" in sections:
        need.append(sizes["offline_requests"] * cdiv(sizes["offline_prompt_len"] + sizes["offline_output_len"] + 1,
                                                      BLOCK_SIZE))
    return max(need) + 8


def build_phaselab(dtype_name: str, sizes: dict, sections: list[str]) -> LLM:
    """One engine per dtype: KV sized for the largest section, max_model_len for the longest request,
    a token budget that runs the longest prefill as ONE forward pass; prefix caching off (random
    prompts share nothing; it keeps repeated trials from hitting the cache)."""
    dtype = getattr(torch, dtype_name)
    ckpt = load_checkpoint(None, dtype)
    config = ckpt.config
    num_blocks = kv_blocks_needed(sizes, sections)
    max_len = max(max(sizes["prefill_lengths"]) + 2, sizes["context"] + sizes["decode_steps"] + 4,
                  sizes["offline_prompt_len"] + sizes["offline_output_len"] + 2)
    if max_len > config.max_position_embeddings:
        raise SystemExit(f"requests of {max_len} tokens exceed the model's context ({config.max_position_embeddings})")
    args = EngineArgs(
        dtype=dtype_name, kv_cache_memory=num_blocks * kv_block_bytes(config, BLOCK_SIZE, dtype),
        block_size=BLOCK_SIZE, max_model_len=max_len, enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, max(sizes["prefill_lengths"])),
        max_num_seqs=max(128, max(sizes["batches"]), sizes["offline_requests"]),
    )
    return LLM.from_engine(LLMEngine(args, checkpoint=ckpt))


def kv_report(eng: LLMEngine, peak_blocks: int, kv_ptr: tuple[int, int]) -> dict[str, Any]:
    runner = eng.executor
    block_bytes = kv_block_bytes(eng.model_config, eng.cache_config.block_size, eng.dtype)
    ws = getattr(runner, "_workspace", None)
    return {"budget_bytes": runner.kv_cache_bytes, "budget_blocks": eng.cache_config.num_blocks,
            "peak_used_blocks": peak_blocks, "peak_used_bytes": peak_blocks * block_bytes,
            "peak_used_fraction": peak_blocks / eng.cache_config.num_blocks,
            "cache_tensor_unchanged": (runner.kv_caches.data_ptr(), runner.kv_caches.numel()) == kv_ptr,
            "decode_workspace_bytes": ws.numel() * ws.element_size() if ws is not None else 0}


def reset_records(eng: LLMEngine) -> None:
    eng.iterations.clear()
    eng.finished_requests.clear()


def hf_cache_bytes(cache: Any) -> int | None:
    try:
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    except AttributeError:
        return None


# -- prefill ---------------------------------------------------------------------------------------

def phaselab_prefill(llm: LLM, ids: list[int]) -> dict[str, float]:
    eng = llm.engine
    reset_records(eng)
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    eng.step()
    dt = time.perf_counter() - t0
    plan = eng.last_plan
    assert plan is not None and len(plan.scheduled) == 1 and plan.scheduled[0].num_tokens == len(ids), \
        "the prefill did not run as one forward pass"
    forward_s = eng.iterations[-1].forward_ns / 1e9 if eng.iterations else float("nan")
    while eng.has_unfinished_requests():
        eng.step()
    return {"step_s": dt, "forward_s": forward_s, "used_blocks": plan.num_used_blocks}


@torch.inference_mode()
def hf_prefill(model: Any, ids: list[int]) -> dict[str, float]:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    out = model(x, use_cache=True, logits_to_keep=1)
    out.logits[:, -1].argmax(-1)
    dt = time.perf_counter() - t0
    return {"step_s": dt, "kv_bytes": hf_cache_bytes(out.cache)}


def run_prefill(ctx: dict, dtype_name: str) -> dict[str, Any]:
    llm, hf, roof, config, args = ctx["llm"], ctx["hf"], ctx["roof"], ctx["config"], ctx["args"]
    eng = llm.engine if llm is not None else None
    kv_ptr = (eng.executor.kv_caches.data_ptr(), eng.executor.kv_caches.numel()) if eng else None
    mem, vocab = MemWatch(), config.vocab_size
    lengths = ctx["sizes"]["prefill_lengths"]
    floors = {n: roof.prefill_floor(config, n, dtype_name) for n in lengths}
    engines = ctx["engines"]
    weights = [floors[n]["floor_s"] for n in lengths for _ in range(args.warmup + args.trials) for _ in engines]
    prog = Progress(f"{dtype_name} prefill", weights)
    out: dict[str, Any] = {"what": "one forward pass filling the cache with an N-token prompt; tokens/s = N / time",
                           "phaselab_timing": "wall time of LLMEngine.step() (forward_s: the forward alone)",
                           "transformers_call": "model(ids, use_cache=True, logits_to_keep=1) + argmax",
                           "lengths": {}}
    peak_blocks, hf_kv = 0, 0
    for n in lengths:
        f = floors[n]
        rate_rows = roof.rate_rows(dtype_name, n)
        gemm = roof.rate_at(dtype_name)(n)
        res: dict[str, list] = {e: [] for e in engines}
        fwd: list[float] = []
        for t in range(-args.warmup, args.trials):
            ids = prompt_ids(1000 * (t + 10) + n, n, vocab)
            for e in engines:
                if e == "phaselab":
                    r = mem.run(e, lambda ids=ids: phaselab_prefill(llm, ids))
                    peak_blocks = max(peak_blocks, r["used_blocks"])
                else:
                    r = mem.run(e, lambda ids=ids: hf_prefill(hf, ids))
                    hf_kv = max(hf_kv, r["kv_bytes"] or 0)
                tag = "warm-up" if t < 0 else f"trial {t + 1}/{args.trials}"
                prog.tick(f["floor_s"], f"{e} {n} tokens {tag}: {n / r['step_s']:.0f} tok/s")
                if t >= 0:
                    res[e].append(r["step_s"])
                    if e == "phaselab":
                        fwd.append(r["forward_s"])
        entry: dict[str, Any] = {"floor": {**f, "gemm_rate_rows": rate_rows}}
        for e in engines:
            tps = [n / s for s in res[e]]
            achieved = [f["flops"] / s for s in res[e]]
            entry[e] = {"tokens_per_s": stats(tps), "seconds": stats(res[e]),
                        "achieved_flops_per_s": med(achieved),
                        "fraction_of_gemm_rate": med(achieved) / gemm,
                        "time_over_floor": med(res[e]) / f["floor_s"]}
        if "phaselab" in engines:
            entry["phaselab"]["forward_only_tokens_per_s"] = stats([n / s for s in fwd])
            entry["phaselab"]["forward_only_fraction_of_gemm_rate"] = f["flops"] / med(fwd) / gemm
        if len(engines) == 2:
            entry["ratio_phaselab_over_hf_tokens_per_s"] = (entry["phaselab"]["tokens_per_s"]["median"]
                                                             / entry["transformers"]["tokens_per_s"]["median"])
        out["lengths"][str(n)] = entry
        line = ", ".join(f"{e} {entry[e]['tokens_per_s']['median']:.0f} tok/s "
                         f"({100 * entry[e]['fraction_of_gemm_rate']:.0f}% of GEMM)" for e in engines)
        log(f"[{dtype_name} prefill] {n}: {line}; floor {f['floor_tokens_per_s']:.0f} tok/s")
    out["memory"] = mem.report()
    out["kv_cache"] = {}
    if eng is not None:
        out["kv_cache"]["phaselab"] = kv_report(eng, peak_blocks, kv_ptr)
    if "transformers" in engines:
        out["kv_cache"]["transformers"] = {
            "budget_bytes": None, "peak_used_bytes": hf_kv, "note": "DynamicCache: grows on demand, no budget"}
    return out


# -- decode ----------------------------------------------------------------------------------------

class PhaselabDecode:
    """A `context`-token prompt prefilled once and parked; each trial admits `batch` copies of its K/V."""

    def __init__(self, llm: LLM, ids: list[int], steps: int) -> None:
        eng = self.eng = llm.engine
        self.ids, self.steps, self.n = ids, steps, 0
        reset_records(eng)
        self.src = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True),
                                   prefill_only=True)
        while not eng.is_parked(self.src):
            eng.step()
        self.first_token = eng.tracked(self.src).request.output_token_ids[0]
        blocks = eng.parked_block_ids(self.src)
        kv = eng.executor.read_blocks(blocks)
        # add_prefilled_request's table covers the prompt's K/V (prompt + outputs but the last token)
        need = cdiv(len(ids), eng.cache_config.block_size)
        assert kv.shape[2] >= need, f"the parked prefill holds {kv.shape[2]} blocks, {need} expected"
        self.kv = kv[:, :, :need].contiguous()

    def run(self, batch: int) -> dict[str, Any]:
        eng = self.eng
        reset_records(eng)
        params = SamplingParams(temperature=0, max_tokens=self.steps + 1, ignore_eos=True)
        pending = set()
        for _ in range(batch):
            self.n += 1
            rid = f"decode-{self.n}"
            m = RequestMetrics(arrived_ns=time.monotonic_ns(), request_id=rid, num_prompt_tokens=len(self.ids),
                               worker=eng.worker)
            ok = eng.add_prefilled_request(rid, self.ids, [self.first_token], params, self.kv, m)
            assert ok, "the KV cache could not admit the decode batch"
            pending.add(rid)
        times, cpu, peak = [], [], 0
        for _ in range(self.steps + 8):  # the parked source counts as unfinished: wait for the batch only
            if not pending:
                break
            t0, c0 = time.perf_counter(), time.process_time()
            outs = eng.step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            plan = eng.last_plan
            peak = max(peak, plan.num_used_blocks if plan else 0)
            if plan is not None and plan.num_prefill_tokens == 0 and len(plan.scheduled) == batch and len(outs) == batch:
                times.append(dt)
                cpu.append(dc)
            pending -= {o.request_id for o in outs if o.finished}
        assert not pending, f"{len(pending)} decode requests did not finish in {self.steps + 8} steps"
        reset_records(eng)
        # cpu_s: the process's CPU time per step (all its threads): on a shared machine it leaves out
        # the time other processes held the cores, which the wall time counts
        return {"step_s": times, "cpu_s": cpu, "used_blocks": peak}

    def close(self) -> None:
        self.eng.release_parked(self.src)


class HFDecode:
    """The same prompt prefilled once; each trial repeats the DynamicCache `batch` times."""

    def __init__(self, model: Any, ids: list[int], steps: int) -> None:
        self.model, self.steps = model, steps
        with torch.inference_mode():
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        self.cache, self.first = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def run(self, batch: int) -> dict[str, Any]:
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(batch)
        nxt = self.first.repeat(batch, 1)
        times = []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            out = self.model(nxt, cache=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            cache = out.cache
        return {"step_s": times, "kv_bytes": hf_cache_bytes(cache), "final_length": cache.get_seq_length()}


def run_decode(ctx: dict, dtype_name: str) -> dict[str, Any]:
    llm, hf, roof, config, args, sizes = ctx["llm"], ctx["hf"], ctx["roof"], ctx["config"], ctx["args"], ctx["sizes"]
    engines, c, steps = ctx["engines"], sizes["context"], sizes["decode_steps"]
    mem = MemWatch()
    ids = prompt_ids(77, c, config.vocab_size)
    floors = {}
    for b in sizes["batches"]:
        per_step = [roof.decode_floor(config, b, c + k, dtype_name) for k in range(steps)]
        floors[b] = {"floor_s": statistics.mean(f["floor_s"] for f in per_step),
                     "memory_s": statistics.mean(f["memory_s"] for f in per_step),
                     "compute_s": statistics.mean(f["compute_s"] for f in per_step),
                     "bytes": statistics.mean(f["bytes"] for f in per_step),
                     "flops": statistics.mean(f["flops"] for f in per_step), "bound": per_step[0]["bound"],
                     "gemm_rate_rows": roof.rate_rows(dtype_name, b),
                     "contexts": f"{c}..{c + steps - 1} tokens cached before the step (every figure: the mean "
                                 "over the timed steps)",
                     "note": "floor = max(compute_s, memory_s); memory_s alone is the bandwidth floor (bytes / "
                             "read bandwidth); compute_s uses the GEMM rate measured at B rows, which at small B "
                             "is itself limited by streaming the weights"}
    weights = [steps * floors[b]["floor_s"] for b in sizes["batches"] for _ in range(args.warmup + args.trials)
               for _ in engines]
    prog = Progress(f"{dtype_name} decode", weights)
    runners: dict[str, Any] = {}
    eng = llm.engine if llm is not None else None
    kv_ptr = (eng.executor.kv_caches.data_ptr(), eng.executor.kv_caches.numel()) if eng else None
    if "phaselab" in engines:
        runners["phaselab"] = mem.run("phaselab", lambda: PhaselabDecode(llm, ids, steps))
    if "transformers" in engines:
        runners["transformers"] = mem.run("transformers", lambda: HFDecode(hf, ids, steps))
    out: dict[str, Any] = {"what": f"ms per decode step, batch B, {c}-token prompts already cached; median of "
                                   f"{steps} consecutive steps per trial, trials' medians summarized",
                           "context": c, "steps_per_trial": steps,
                           "how": "prompt prefilled once; phaselab admits B copies of its K/V "
                                  "(add_prefilled_request), transformers repeats its DynamicCache B times",
                           "batches": {}}
    peak_blocks, hf_kv = 0, 0
    for b in sizes["batches"]:
        f = floors[b]
        res: dict[str, list[float]] = {e: [] for e in engines}
        for t in range(-args.warmup, args.trials):
            for e in engines:
                r = mem.run(e, lambda e=e, b=b: runners[e].run(b))
                if e == "phaselab":
                    peak_blocks = max(peak_blocks, r["used_blocks"])
                    assert len(r["step_s"]) >= max(1, steps - 2), f"only {len(r['step_s'])} full-batch decode steps"
                else:
                    hf_kv = max(hf_kv, r["kv_bytes"] or 0)
                ms = 1e3 * med(r["step_s"])
                tag = "warm-up" if t < 0 else f"trial {t + 1}/{args.trials}"
                prog.tick(steps * f["floor_s"], f"{e} batch {b} {tag}: {ms:.1f} ms/step")
                if t >= 0:
                    res[e].append(ms)
        entry: dict[str, Any] = {"floor": {**f, "floor_ms": 1e3 * f["floor_s"],
                                           "bandwidth_floor_ms": 1e3 * f["memory_s"]}}
        for e in engines:
            entry[e] = {"ms_per_step": stats(res[e]), "time_over_floor": med(res[e]) / (1e3 * f["floor_s"]),
                        "time_over_bandwidth_floor": med(res[e]) / (1e3 * f["memory_s"]),
                        "tokens_per_s": b * 1e3 / med(res[e]),
                        "achieved_bytes_per_s": f["bytes"] / (med(res[e]) / 1e3),
                        "fraction_of_read_bandwidth": f["bytes"] / (med(res[e]) / 1e3) / roof.read_bandwidth}
        if len(engines) == 2:
            entry["speedup_phaselab_over_hf"] = entry["transformers"]["ms_per_step"]["median"] / \
                entry["phaselab"]["ms_per_step"]["median"]
        out["batches"][str(b)] = entry
        line = ", ".join(f"{e} {entry[e]['ms_per_step']['median']:.1f} ms ({entry[e]['time_over_floor']:.2f}x floor, "
                         f"{entry[e]['time_over_bandwidth_floor']:.2f}x bandwidth floor)" for e in engines)
        log(f"[{dtype_name} decode] batch {b}: {line}; floor {entry['floor']['floor_ms']:.1f} ms "
            f"({entry['floor']['bound']}-bound), bandwidth floor {entry['floor']['bandwidth_floor_ms']:.1f} ms")
    if "phaselab" in runners:
        runners["phaselab"].close()
    out["memory"] = mem.report()
    out["kv_cache"] = {}
    if eng is not None:
        out["kv_cache"]["phaselab"] = kv_report(eng, peak_blocks, kv_ptr)
    if "transformers" in engines:
        out["kv_cache"]["transformers"] = {"budget_bytes": None, "peak_used_bytes": hf_kv,
                                           "note": "DynamicCache at the end of the largest batch's trial"}
    return out


# -- offline workload --------------------------------------------------------------------------------

def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def phaselab_offline(llm: LLM, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    eng = llm.engine
    reset_records(eng)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == out_len for t in tokens), "a request produced fewer tokens than asked"
    its = eng.iterations
    r = {"wall_s": dt, "tokens": tokens, "used_blocks": max((it.num_blocks_used for it in its), default=0),
         "iterations": len(its), "preemptions": sum(len(it.preempted_request_ids) for it in its),
         "prefill_iterations": sum(1 for it in its if it.num_prefill_tokens)}
    reset_records(eng)
    return r


@torch.inference_mode()
def hf_offline(model: Any, prompts: list[list[int]], out_len: int, sub_batch: int, pad_id: int) -> dict[str, Any]:
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), sub_batch):
        part = prompts[i:i + sub_batch]
        ids, mask = left_pad(part, pad_id)
        seq = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                             max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=pad_id, use_cache=True)
        tokens += seq[:, ids.shape[1]:].tolist()
    dt = time.perf_counter() - t0
    assert all(len(t) == out_len for t in tokens)
    return {"wall_s": dt, "tokens": tokens}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(k)
    return {"identical_requests": sum(1 for x, y in zip(a, b) if x == y), "requests": len(a),
            "median_common_prefix_tokens": med(prefix), "min_common_prefix_tokens": min(prefix),
            "note": "greedy tokens, phaselab vs transformers, first trial; divergence at near-ties is expected, "
                    "more so in bf16 (correctness is the test suite's job, this is a sanity check)"}


def offline_floor(roof: Roofline, config, dtype_name: str, reqs: int, p: int, o: int) -> dict[str, Any]:
    pre = roof.plan_floor(config, plan_of([(0, p, True)] * reqs), dtype_name)
    dec = [roof.decode_floor(config, reqs, p + k, dtype_name)["floor_s"] for k in range(o - 1)]
    total = pre["floor_s"] + sum(dec)
    return {"floor_s": total, "prefill_floor_s": pre["floor_s"], "decode_floor_s": sum(dec),
            "floor_output_tokens_per_s": reqs * o / total,
            "how": "all prompts prefilled at the best-measured GEMM rate, then every decode step at full batch "
                   "(the first token of each request comes from its prefill)"}


def run_offline(ctx: dict, dtype_name: str) -> dict[str, Any]:
    llm, hf, roof, config, args, sizes = ctx["llm"], ctx["hf"], ctx["roof"], ctx["config"], ctx["args"], ctx["sizes"]
    engines = ctx["engines"]
    reqs, p, o = sizes["offline_requests"], sizes["offline_prompt_len"], sizes["offline_output_len"]
    sub = min(args.hf_batch or reqs, reqs)
    trials = args.offline_trials or args.trials
    mem = MemWatch()
    f = offline_floor(roof, config, dtype_name, reqs, p, o)
    prog = Progress(f"{dtype_name} offline", [f["floor_s"]] * trials * len(engines))
    pad_id = None
    if hf is not None:
        pad_id = hf.generation_config.pad_token_id
        if pad_id is None:
            pad_id = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0
    res: dict[str, list[float]] = {e: [] for e in engines}
    first: dict[str, list[list[int]]] = {}
    extra: dict[str, Any] = {}
    peak_blocks = 0
    eng = llm.engine if llm is not None else None
    kv_ptr = (eng.executor.kv_caches.data_ptr(), eng.executor.kv_caches.numel()) if eng else None
    for t in range(trials):
        prompts = [prompt_ids(500_000 + 1000 * t + i, p, config.vocab_size) for i in range(reqs)]
        for e in engines:
            if e == "phaselab":
                r = mem.run(e, lambda prompts=prompts: phaselab_offline(llm, prompts, o))
                peak_blocks = max(peak_blocks, r["used_blocks"])
                extra.setdefault("phaselab_iterations", []).append(r["iterations"])
                extra.setdefault("phaselab_prefill_iterations", []).append(r["prefill_iterations"])
                extra.setdefault("phaselab_preemptions", []).append(r["preemptions"])
            else:
                r = mem.run(e, lambda prompts=prompts: hf_offline(hf, prompts, o, sub, pad_id))
            first.setdefault(e, r["tokens"])
            res[e].append(r["wall_s"])
            prog.tick(f["floor_s"], f"{e} trial {t + 1}/{trials}: {r['wall_s']:.1f} s, "
                                    f"{reqs * o / r['wall_s']:.1f} output tok/s")
    out: dict[str, Any] = {
        "workload": {"requests": reqs, "prompt_tokens": p, "output_tokens": o, "greedy": True, "ignore_eos": True,
                     "prompts": "random token ids, the same for both engines in each trial"},
        "phaselab_call": "LLM.generate(all prompts, SamplingParams(temperature=0, max_tokens=O, ignore_eos=True))",
        "transformers_call": f"generate(do_sample=False, max_new_tokens=O, min_new_tokens=O), left padding, "
                             f"sub-batches of {sub}" + (" (not all at once: --hf-batch)" if sub < reqs else
                                                        " (all requests in one batch)"),
        "transformers_sub_batch": sub, "trials": trials, "floor": f}
    for e in engines:
        out[e] = {"wall_s": stats(res[e]), "output_tokens_per_s": stats([reqs * o / s for s in res[e]]),
                  "time_over_floor": med(res[e]) / f["floor_s"]}
    out.update(extra)
    if len(engines) == 2:
        out["speedup_phaselab_over_hf"] = med(res["transformers"]) / med(res["phaselab"])
        out["greedy_agreement"] = agreement(first["phaselab"], first["transformers"])
    line = ", ".join(f"{e} {out[e]['output_tokens_per_s']['median']:.1f} tok/s ({out[e]['time_over_floor']:.2f}x floor)"
                     for e in engines)
    log(f"[{dtype_name} offline] {line}")
    out["memory"] = mem.report()
    out["kv_cache"] = {}
    if eng is not None:
        out["kv_cache"]["phaselab"] = kv_report(eng, peak_blocks, kv_ptr)
    if "transformers" in engines:
        out["kv_cache"]["transformers"] = {
            "budget_bytes": None, "peak_used_bytes": sub * (p + o) * config.kv_bytes_per_token(
                torch.finfo(getattr(torch, dtype_name)).bits // 8),
            "note": "modeled: sub-batch x (prompt + output) tokens of DynamicCache (grows on demand, no budget)"}
    return out


# -- summary -----------------------------------------------------------------------------------------

def summarize(results: dict) -> dict[str, Any]:
    """Issue 9's targets next to what this run measured; `met` is None where a figure is missing."""
    rows: list[dict[str, Any]] = []
    T = TARGETS
    for dt, r in results["dtypes"].items():
        pre = r.get("prefill", {}).get("lengths", {})
        for n in T["prefill_target_lengths"]:
            e = pre.get(str(n), {}).get("phaselab")
            if e is not None:
                rows.append({"target": f"prefill {n}: >= {T['prefill_gemm_fraction_min']:.0%} of the GEMM rate",
                             "dtype": dt, "value": e["fraction_of_gemm_rate"],
                             "met": e["fraction_of_gemm_rate"] >= T["prefill_gemm_fraction_min"],
                             "binding": dt == T["prefill_target_dtype"]})
            ratio = pre.get(str(n), {}).get("ratio_phaselab_over_hf_tokens_per_s")
            if ratio is not None:
                rows.append({"target": f"prefill {n}: at least as fast as transformers", "dtype": dt, "value": ratio,
                             "met": ratio >= 1.0, "binding": dt == T["prefill_target_dtype"]})
        dec = r.get("decode", {}).get("batches", {})
        for b in T["decode_floor_target_batches"]:
            e = dec.get(str(b), {}).get("phaselab")
            if e is not None:
                # the issue: batch 1 against the bandwidth floor, batch 32 against the floor
                key, what = (("time_over_bandwidth_floor", "bandwidth floor") if b == 1 else ("time_over_floor", "floor"))
                rows.append({"target": f"decode batch {b}: <= {T['decode_floor_ratio_max']}x the {what}", "dtype": dt,
                             "value": e[key], "met": e[key] <= T["decode_floor_ratio_max"], "binding": True})
        s = dec.get(str(T["decode_speedup_batch"]), {}).get("speedup_phaselab_over_hf")
        if s is not None:
            rows.append({"target": f"decode batch {T['decode_speedup_batch']}: >= {T['decode_speedup_min']}x "
                                   "transformers", "dtype": dt, "value": s, "met": s >= T["decode_speedup_min"],
                         "binding": True})
        s = r.get("offline", {}).get("speedup_phaselab_over_hf")
        if s is not None:
            rows.append({"target": f"offline: >= {T['offline_speedup_min']}x transformers' output tokens/s",
                         "dtype": dt, "value": s, "met": s >= T["offline_speedup_min"], "binding": True})
    if results.get("quick"):
        for row in rows:
            row["binding"] = False  # tiny sizes: not the figures
    return {"targets": rows, "note": "binding: the issue states the target for this dtype and these sizes"}


# -- main ----------------------------------------------------------------------------------------------

def write(results: dict, path: str) -> None:
    results["summary"] = summarize(results)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--engines", nargs="+", default=["phaselab", "transformers"], choices=["phaselab", "transformers"],
                    help="drop transformers for a quick look at phaselab alone (no ratios then)")
    ap.add_argument("--trials", type=int, default=None, help="timed trials per figure (default 3; --quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per prefill/decode figure")
    ap.add_argument("--offline-trials", type=int, default=None, help="trials of the offline workload (default --trials)")
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    ap.add_argument("--context", type=int, default=None, help="decode: tokens cached per request (default 512)")
    ap.add_argument("--decode-steps", type=int, default=None, help="decode steps timed per trial (default 16)")
    ap.add_argument("--offline-requests", type=int, default=None)
    ap.add_argument("--offline-prompt-len", type=int, default=None)
    ap.add_argument("--offline-output-len", type=int, default=None)
    ap.add_argument("--hf-batch", type=int, default=None,
                    help="offline: transformers generate() sub-batch (default: all requests in one batch)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's, all cores)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 trials: a smoke run of every code path")
    ap.add_argument("--roofline", default="benchmarks/results/roofline.json",
                    help="roofline JSON from benchmarks/roofline.py; measured quickly here when missing")
    ap.add_argument("--out", default=None, help="default benchmarks/results/engine.json (--quick: engine_quick.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = QUICK if args.quick else FULL
    sizes = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    args.trials = sizes["trials"]
    out_path = args.out or ("benchmarks/results/engine_quick.json" if args.quick else "benchmarks/results/engine.json")
    engines = [e for e in ("phaselab", "transformers") if e in args.engines]
    t_start = time.perf_counter()

    path = default_model_path()
    results: dict[str, Any] = {
        "benchmark": "engine", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": sys.argv, "quick": args.quick,
        "sizes": sizes, "sections": args.sections, "engines": engines, "warmup_runs": args.warmup,
        "machine": machine_info(), "model": path, "targets": TARGETS, "dtypes": {},
    }
    log(f"engine benchmark: dtypes {args.dtypes}, sections {args.sections}, engines {engines}, trials {args.trials}, "
        f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    hf_master = None
    if "transformers" in engines:
        from transformers import AutoModelForCausalLM

        log("loading transformers (GGUF dequantized, fp32) ...")
        t0 = time.perf_counter()
        hf_master = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                         dtype=torch.float32).eval()
        results["transformers"] = {"load_s": time.perf_counter() - t0,
                                   "attn_implementation": getattr(hf_master.config, "_attn_implementation", None),
                                   "note": "loaded once in fp32; the bf16 model is a cast copy (the same as "
                                           "from_pretrained(dtype=bfloat16) of the dequantized GGUF)"}
    roof: Roofline | None = None
    for dtype_name in args.dtypes:
        log(f"[{dtype_name}] loading phaselab ...")
        llm = build_phaselab(dtype_name, sizes, args.sections)
        config = llm.engine.model_config
        if roof is None:
            # no roofline JSON: a short measurement at the row counts this run needs (LM head skipped:
            # the floors use the layer mix); run benchmarks/roofline.py for the real one
            quick_roof = {"rows": [1, 4, 32, 128, 512], "min_time": 0.02, "bandwidth_bytes": 1 << 27}
            full_roof = {"rows": [1, 8, 32, 64, 128, 256, 512, 1024, 2048], "min_time": 0.05}
            roof = load_or_measure(args.roofline, config, tuple(args.dtypes), quick=True, log=log,
                                   include_lm_head=False, **(quick_roof if args.quick else full_roof))
            results["roofline"] = roof.summary()
        hf = None
        if hf_master is not None:
            hf = hf_master if dtype_name == "float32" else copy.deepcopy(hf_master).to(getattr(torch, dtype_name))
        if "phaselab" not in engines:
            llm_engine_cfg = None
        else:
            llm_engine_cfg = llm.engine.run_config()
        r: dict[str, Any] = {"phaselab_engine": llm_engine_cfg}
        results["dtypes"][dtype_name] = r
        ctx = {"llm": llm if "phaselab" in engines else None, "hf": hf, "roof": roof, "config": config,
               "args": args, "sizes": sizes, "engines": engines}
        for section in args.sections:
            la0, t0 = list(os.getloadavg()), time.perf_counter()
            r[section] = {"run_decode": run_decode, "run_prefill": run_prefill,
                          "run_offline": run_offline}[f"run_{section}"](ctx, dtype_name)
            r[section]["loadavg_before"], r[section]["loadavg_after"] = la0, list(os.getloadavg())
            r[section]["duration_s"] = time.perf_counter() - t0
            write(results, out_path)
            log(f"[{dtype_name} {section}] done in {fmt_s(r[section]['duration_s'])}; load average "
                f"{la0[0]:.2f} -> {r[section]['loadavg_after'][0]:.2f}; wrote {out_path}")
        del ctx, llm, hf
        gc.collect()
    results["duration_s"] = time.perf_counter() - t_start
    results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    write(results, out_path)
    log(f"wrote {out_path} after {fmt_s(results['duration_s'])}")
    for row in results["summary"]["targets"]:
        log(f"  {row['dtype']:>8}  {row['target']:<55} {row['value']:8.3f}  "
            f"{'met' if row['met'] else 'NOT met'}{'' if row['binding'] else ' (not binding)'}")


if __name__ == "__main__":
    main()
