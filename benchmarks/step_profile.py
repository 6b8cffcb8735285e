"""Where one decode step goes (issue 18 item 5): shares of the step at batch 1, 8, 32, 64.

Times, per engine step, with perf_counter wrappers installed around the pieces (no profiler:
its own overhead would be a large share of a 20 ms step):

    linear      every linear layer and the LM head (PackedLinear / nn.Linear forwards)
    attention   paged attention (KV write + decode kernel; on the fused decode path, RoPE too)
    layers      a fused decode step's decoder layers in one native call (kernels.decode_layers: its
                linear layers, attention and norms inside; PHASELAB_DECODE_LAYERS=0 splits it into
                the parts above); linear then holds the LM head only
    forward     a decode-only step's whole forward in one native call (kernels.decode_forward: the
                embedding and RoPE rows, the layers, the final norm and the LM head), where the
                model's ends qualify; then linear, attention and layers are 0. `layers_ms` splits
                layers or forward by kernel kind (qkv, o, gate_up, down, attention, norm, silu_mul,
                and the forward's embed and head), timed in C
    sampling    the sampler
    model other the rest of the forward: embedding, norms, RoPE, SiLU*up, residual adds
    engine      everything else in step(): scheduling, input preparation, outputs, Python

Beside each profile: torch's read bandwidth (phaselab.engine.ceilings.read_bandwidth) measured
right before and after it, and the step against the issue's floor, the weights as stored / the
better of the two readings (`floor_ms`, `step_over_floor`; weights only, the KV cache not counted).

Configurations (`--configs`) are DTYPE/PATH[+BATCHED]: the linear path forced by PHASELAB_LINEAR
(q, bf16, fp32, torch; `auto`: what the start-up probe picks, as `phaselab serve` runs) and the
GEMM's weight above the native row count forced by PHASELAB_BATCHED (tile | resident). The JSON
records each engine's linear decision and weight memory. Every request has a 512-token context; the KV cache holds batch 64 without preemption (2 GiB in fp32). Writes JSON (`benchmarks/results/step_profile.json`)
with the load average beside each figure. Usage: `python benchmarks/step_profile.py [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _machine import write_json  # noqa: E402


def log(msg: str) -> None:
    print(f"[step_profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def wrap(self, key: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
        return timed


def profile(eng: Any, batch: int, steps: int, weight_bytes: int) -> dict[str, Any]:
    from phaselab.core.sampling_params import SamplingParams
    from phaselab.engine.ceilings import read_bandwidth
    from phaselab.model import llama
    from phaselab.model.linear import PackedLinear

    timers = Timers()
    model = eng.executor.model
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.forward = timers.wrap("linear", m.forward)
    if model.head is None:  # the torch path: nn.Linear and the LM head both call F.linear (once each)
        orig_linear = llama.F.linear
        llama.F.linear = timers.wrap("linear", orig_linear)
    orig_attn = llama.paged_attention
    llama.paged_attention = timers.wrap("attention", orig_attn)
    orig_fused = llama.kernels.decode_rope_attend  # the fused decode path: RoPE + KV write + attention
    llama.kernels.decode_rope_attend = timers.wrap("attention", orig_fused)
    orig_layers = llama.kernels.decode_layers  # every decoder layer of a fused decode step, one call
    llama.kernels.decode_layers = timers.wrap("layers", orig_layers)
    orig_forward = llama.kernels.decode_forward  # a decode-only step's whole forward, one call
    llama.kernels.decode_forward = timers.wrap("forward", orig_forward)
    model.forward = timers.wrap("model", model.forward)
    eng.executor.sampler.sample = timers.wrap("sampling", eng.executor.sampler.sample)
    try:
        g = torch.Generator().manual_seed(batch)
        for _ in range(batch):
            ids = torch.randint(100, eng.model_config.vocab_size - 100, (512,), generator=g).tolist()
            eng.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
        while True:  # prefill everything first
            eng.step()
            plan = eng.last_plan
            if plan is not None and plan.num_prefill_tokens == 0:
                break
        timers.t.clear()
        split_on = getattr(model, "decode_layers", False)
        # the runner takes (and zeroes) the same timers every step for the records; here the benchmark
        # reads their sums over all its steps, by kind, so the runner leaves them alone
        eng.executor.step_timers = False
        if split_on:
            llama.kernels.decode_layers_profile(True)
        bw_before = read_bandwidth()
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        n = 0
        for _ in range(steps):
            eng.step()
            n += 1
        total = time.perf_counter() - t0
        t = dict(timers.t)  # before the requests are run out below
        split = llama.kernels.decode_layers_profile(False) if split_on else {}
        bw_after = read_bandwidth()
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        llama.paged_attention = orig_attn
        llama.kernels.decode_rope_attend = orig_fused
        llama.kernels.decode_layers = orig_layers
        llama.kernels.decode_forward = orig_forward
        if model.head is None:
            llama.F.linear = orig_linear
    parts = {
        "linear": t.get("linear", 0.0),
        "attention": t.get("attention", 0.0),
        "layers": t.get("layers", 0.0),
        "forward": t.get("forward", 0.0),
        "model other": t.get("model", 0.0) - t.get("linear", 0.0) - t.get("attention", 0.0) - t.get("layers", 0.0)
        - t.get("forward", 0.0),
        "sampling": t.get("sampling", 0.0),
    }
    parts["engine"] = total - t.get("model", 0.0) - t.get("sampling", 0.0)
    floor_s = weight_bytes / max(bw_before, bw_after)
    return {"batch": batch, "steps": n, "step_ms": round(total / n * 1e3, 2),
            "read_bandwidth_gbs": [round(bw_before / 1e9, 2), round(bw_after / 1e9, 2)],
            "floor_ms": round(floor_s * 1e3, 3), "step_over_floor": round(total / n / floor_s, 3),
            "ms": {k: round(v / n * 1e3, 2) for k, v in parts.items()},
            "share": {k: round(v / total, 3) for k, v in parts.items()},
            # inside the one native layers call: each kernel kind's wall time per step
            "layers_ms": {k: round(v / n * 1e3, 3) for k, v in split.items()},
            "load_avg": [load0, os.getloadavg()[0]]}


def main() -> None:
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine
    from phaselab.model.kernels.linear_timing import cpu_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--configs", nargs="+", default=["float32/q", "bfloat16/q", "bfloat16/q+resident", "bfloat16/auto",
                                                     "bfloat16/torch", "float32/torch"],
                    help="DTYPE/PATH[+BATCHED]: PATH forced by PHASELAB_LINEAR (auto: the start-up probe "
                         "decides), BATCHED (tile | resident) by PHASELAB_BATCHED")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "step_profile.json"))
    args = ap.parse_args()
    steps = 6 if args.quick else 16
    from phaselab.model import kernels

    result: dict[str, Any] = {"cpu": cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "profiles": {},
                              "kernel_threads": kernels.pool_description(),
                              "fused_decode": os.environ.get("PHASELAB_FUSED_DECODE", "1") != "0",
                              "fused_timed_as": "attention",  # decode_rope_attend is wrapped with paged_attention
                              "native_elementwise": os.environ.get("PHASELAB_NATIVE_ELEMENTWISE", "1") != "0",
                              "decode_layers": os.environ.get("PHASELAB_DECODE_LAYERS", "1") != "0"}
    for cfg in args.configs:
        # DTYPE/PATH[+BATCHED]: PATH forced through PHASELAB_LINEAR ("auto": the start-up probe
        # decides, as `phaselab serve` does), BATCHED through PHASELAB_BATCHED (tile | resident)
        dtype, _, rest = cfg.partition("/")
        path, _, batched = rest.partition("+")
        env = {"PHASELAB_LINEAR": path if path != "auto" else None, "PHASELAB_BATCHED": batched or None}
        saved = {k: os.environ.pop(k, None) for k in env}
        os.environ.update({k: v for k, v in env.items() if v})
        try:
            eng = LLMEngine(EngineArgs(dtype=dtype, kv_cache_memory="2GiB" if dtype == "float32" else "1GiB", max_model_len=1024, max_num_seqs=128))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        s = eng.linear_summary
        result.setdefault("linear", {})[cfg] = {
            "decision": eng.linear.summary(), "max_native_rows": eng.linear.max_native_rows,
            "batched": s.get("batched"), "weight_bytes": s["weight_bytes"], "memory_bytes": s.get("memory_bytes", s["weight_bytes"])}
        log(f"{cfg}: {eng.linear.summary()}; weights {s['weight_bytes'] / 1e6:.1f} MB as stored, "
            f"{s.get('memory_bytes', s['weight_bytes']) / 1e6:.1f} MB held")
        for b in args.batches:
            # batch 1's steps are short: more of them (64, the context 512-576 tokens)
            r = profile(eng, b, steps if args.quick or b > 1 else 64, s["weight_bytes"])
            result["profiles"].setdefault(cfg, []).append(r)
            log(f"{cfg} batch {b}: {r['step_ms']} ms/step, {r['step_over_floor']:.2f}x the {r['floor_ms']:.2f} ms floor of "
                f"the weights at {max(r['read_bandwidth_gbs']):.1f} GB/s; "
                + ", ".join(f"{k} {v:.0%}" for k, v in r["share"].items()) + f"; load {r['load_avg'][1]:.1f}")
            if r["layers_ms"]:
                log(f"{cfg} batch {b}: inside layers (ms/step) "
                    + ", ".join(f"{k} {v:.2f}" for k, v in r["layers_ms"].items()))
        del eng
    write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
