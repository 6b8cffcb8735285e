"""Linear paths of issue 18: GB/s per path and row count, decode batch-1 vs its floor, prefix prefill.

Three sections, one JSON (`benchmarks/results/linear.json` by default), naming the CPU:

1. `rows`: one pass over every linear layer of the bundled model (30 x qkv/o/gate_up/down, and
   the LM head) at 1, 2, 4, 8, 16, 32 activation rows, for each path: the native kernel over
   Q4_1 blocks (the file's own, and re-laid as Q4_1X for bf16 activations where the CPU has
   AVX512-BF16), over dense bf16 and fp32 rows, torch's F.linear (oneDNN/MKL)
   on dense bf16 and fp32, and Q4_1 widened per layer into a tile + torch's GEMM. GB/s = bytes of
   the weights as that path stores them / time. Paths are timed back to back in one process.
2. `decode`: the engine's decode step at batch 1 (512-token context) for each path, in ms and
   against its floor = (weights as stored + KV read) / read bandwidth (measured here with
   benchmarks/roofline.py's bandwidth()); also against the 16-bit floor (bf16 weights).
3. `prefix`: a 2000-token prefill cold vs after a 16-token prefix-cache hit, ms per new token.
4. `batched`: decode step time at --batches (default 1 8 32; 512-token contexts) for each of
   --configs, DTYPE/PATH[+BATCHED][:q4x0|:rows4at4] (PATH forced by PHASELAB_LINEAR, `auto` = the
   start-up probe's choice; BATCHED = tile | resident forced by PHASELAB_BATCHED; `:q4x0` keeps Q4_1
   in the file's layout, PHASELAB_Q4_REPACK=0, instead of Q4_1X; `:rows4at4` reads four weight rows
   per pass from 4 activation rows in every format, PHASELAB_ROWS4_MIN=4, the kernel's default before
   the probe chose it; that setting is process-wide, so each engine's is set again before its
   turn), engines taking turns round by
   round. The context is prefilled once per engine and its K/V copied into each batch
   (benchmarks/engine.py's PhaselabDecode), so a round costs no prefill. Beside the wall time, the
   process's CPU time per step (both threads): with the machine shared, it leaves out the time
   other jobs held the cores.

The machine may be shared: the load average is recorded beside every figure, and paths should
be compared as ratios within one run. Usage: `python benchmarks/linear.py [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _machine import write_json  # noqa: E402
from roofline import bandwidth  # noqa: E402

from phaselab import envs  # noqa: E402
from phaselab.model.kernels import qlinear  # noqa: E402
from phaselab.model.kernels.linear_timing import cpu_info, time_call  # noqa: E402
from phaselab.model.quant import PackedTensor  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32)


def log(msg: str) -> None:
    print(f"[linear {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_layers() -> tuple[list[PackedTensor], Any]:
    """The bundled model's linear weights as stored: fused qkv and gate_up per layer, o, down, head."""
    from phaselab.model.loader import load_checkpoint
    from phaselab.model.quant import cat_rows

    ckpt = load_checkpoint(None, torch.float32, keep_packed=True)
    w, cfg = ckpt.weights, ckpt.config
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(cat_rows([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        layers.append(w[p + "self_attn.o_proj.weight"])
        layers.append(cat_rows([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        layers.append(w[p + "mlp.down_proj.weight"])
    layers.append(w["model.embed_tokens.weight"])  # the tied LM head
    return layers, cfg


def run_rows(layers: list[PackedTensor], reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dense = {"F32": [p.dequantize(torch.float32).contiguous() for p in layers]}
    dense["BF16"] = [d.to(torch.bfloat16) for d in dense["F32"]]
    tile_elems = max(p.shape[0] * p.shape[1] for p in layers)
    for act in (torch.float32, torch.bfloat16):
        an = str(act).removeprefix("torch.")
        tile = torch.empty(tile_elems, dtype=act)
        for m in ROWS:
            xs = {p.shape[1]: torch.randn(m, p.shape[1]).to(act) for p in layers}
            scratch = torch.empty(3 * m * max(xs))  # >= qlinear.scratch_floats of any layout
            outs = [torch.empty(m, p.shape[0], dtype=act) for p in layers]

            def native(fmt: str, ws: list[torch.Tensor]) -> None:
                for p, w, o in zip(layers, ws, outs):
                    qlinear.linear(fmt, w, p.shape[0], p.shape[1], xs[p.shape[1]], o, scratch)

            def torch_linear(ws: list[torch.Tensor]) -> None:
                for p, w in zip(layers, ws):
                    F.linear(xs[p.shape[1]], w)

            def tiled() -> None:
                for p in layers:
                    t = tile[: p.shape[0] * p.shape[1]].view(p.shape)
                    qlinear.dequant(p.fmt, p.data, p.shape[0], p.shape[1], t)
                    F.linear(xs[p.shape[1]], t)

            def native_stored() -> None:  # each layer in its own format: Q4_1 layers, the Q8_0 head
                for p, o in zip(layers, outs):
                    qlinear.linear(p.fmt, p.data, p.shape[0], p.shape[1], xs[p.shape[1]], o, scratch)

            def native_relaid() -> None:  # as a resident-GEMM layer keeps them (qlinear.native_format)
                for p, o in zip(relaid, outs):
                    qlinear.linear(p.fmt, p.data, p.shape[0], p.shape[1], xs[p.shape[1]], o, scratch)

            q_bytes = sum(p.nbytes for p in layers)
            paths = {
                "native Q4_1 (+Q8_0 head)": (native_stored, q_bytes),
                "native bf16": (lambda: native("BF16", dense["BF16"]), 2 * sum(d.numel() for d in dense["F32"])),
                "native fp32": (lambda: native("F32", dense["F32"]), 4 * sum(d.numel() for d in dense["F32"])),
                # torch's matmul needs the weight in the activation dtype
                f"torch {an}": (lambda: torch_linear(dense["BF16" if act == torch.bfloat16 else "F32"]),
                                act.itemsize * sum(d.numel() for d in dense["F32"])),
                "Q4_1 tile + torch GEMM": (tiled, q_bytes),
            }
            relaid = [p if qlinear.native_format(p.fmt, act) == p.fmt else PackedTensor(
                qlinear.native_format(p.fmt, act), qlinear.repack(qlinear.native_format(p.fmt, act), p.data, *p.shape),
                p.shape) for p in layers]
            if any(r is not p for r, p in zip(relaid, layers)):
                paths["native Q4_1X (+Q8_0 head)"] = (native_relaid, q_bytes)
            row: dict[str, Any] = {"load_avg_before": os.getloadavg()[0]}
            for name, (fn, nbytes) in paths.items():
                t = time_call(fn, reps)
                row[name] = {"ms": round(t * 1e3, 3), "GBps": round(nbytes / t / 1e9, 2)}
            row["load_avg_after"] = os.getloadavg()[0]
            out.setdefault(an, {})[str(m)] = row
            log(f"{an} rows {m}: " + ", ".join(f"{k} {v['ms']:.1f} ms" for k, v in row.items() if isinstance(v, dict)))
    return out


def decode_engine(path: str, dtype: str) -> Any:
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine

    os.environ["PHASELAB_LINEAR"] = path
    try:
        return LLMEngine(EngineArgs(dtype=dtype, kv_cache_memory="256MiB", max_model_len=2400,
                                    max_num_batched_tokens=2400, enable_prefix_caching=True))
    finally:
        del os.environ["PHASELAB_LINEAR"]


def decode_step_ms(eng: Any, context: int, steps: int) -> list[float]:
    from phaselab.core.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(context)
    ids = torch.randint(100, eng.model_config.vocab_size - 100, (context,), generator=g).tolist()
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    eng.step()  # the prefill
    times = []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t) * 1e3)
    return times[1:]


def prefix_prefill(eng: Any, n_new: int, trials: int) -> dict[str, Any]:
    from phaselab.core.sampling_params import SamplingParams

    def prefill_ms(ids: list[int]) -> float:
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        while eng.has_unfinished_requests():
            eng.step()
        return dt * 1e3

    vocab = eng.model_config.vocab_size
    cold, warm = [], []
    for trial in range(trials):
        g = torch.Generator().manual_seed(1000 + trial)
        prefix = torch.randint(100, vocab - 100, (16,), generator=g).tolist()
        body = torch.randint(100, vocab - 100, (n_new,), generator=g).tolist()
        cold.append(prefill_ms(torch.randint(100, vocab - 100, (n_new,), generator=g).tolist()) / n_new)
        prefill_ms(prefix + [5])  # caches the 16-token block
        warm.append(prefill_ms(prefix + body) / n_new)
    return {"cold_ms_per_token": min(cold), "after_16_token_hit_ms_per_token": min(warm),
            "ratio": min(warm) / min(cold), "load_avg": os.getloadavg()[0]}


def batched_engine(cfg: str) -> Any:
    """DTYPE/PATH[+BATCHED] -> an engine with that linear path (see the module docstring)."""
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine

    dtype, _, rest = cfg.partition("/")
    rest, _, option = rest.partition(":")  # ":q4x0": Q4_1 blocks kept in the file's layout
    path, _, batched = rest.partition("+")
    env = {"PHASELAB_LINEAR": path if path != "auto" else None, "PHASELAB_BATCHED": batched or None,
           envs.Q4_REPACK.name: "0" if option == "q4x0" else None, envs.ROWS4_MIN.name: "4" if option == "rows4at4" else None}
    saved = {k: os.environ.pop(k, None) for k in env}
    os.environ.update({k: v for k, v in env.items() if v})
    try:
        kv = "1200MiB" if dtype == "float32" else "640MiB"
        return LLMEngine(EngineArgs(dtype=dtype, kv_cache_memory=kv, max_model_len=1024, max_num_seqs=64))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def run_batched(configs: list[str], batches: list[int], rounds: int, steps: int) -> dict[str, Any]:
    from types import SimpleNamespace

    from engine import PhaselabDecode

    out: dict[str, Any] = {}
    runners = {}
    for cfg in configs:
        eng = batched_engine(cfg)
        g = torch.Generator().manual_seed(512)
        ids = torch.randint(100, eng.model_config.vocab_size - 100, (512,), generator=g).tolist()
        runners[cfg] = PhaselabDecode(SimpleNamespace(engine=eng), ids, steps)
        s = eng.linear_summary
        out[cfg] = {"decision": eng.linear.summary(), "dtype": str(eng.dtype).removeprefix("torch."),
                    "max_native_rows": eng.linear.max_native_rows, "batched": s.get("batched"),
                    "weight_bytes": s["weight_bytes"], "memory_bytes": s.get("memory_bytes", s["weight_bytes"]),
                    "steps_ms": {str(b): [] for b in batches}, "cpu_ms": {str(b): [] for b in batches}, "load_avg": []}
        log(f"batched {cfg}: {eng.linear.summary()}; {s.get('memory_bytes', s['weight_bytes']) / 1e6:.1f} MB of weights held")
    for r in range(rounds):
        for b in batches:
            for cfg, run in runners.items():
                run.eng.linear.apply_rows4()  # process-wide: this engine's choice, not the last built's
                res = run.run(b)
                out[cfg]["steps_ms"][str(b)] += [t * 1e3 for t in res["step_s"]]
                out[cfg]["cpu_ms"][str(b)] += [t * 1e3 for t in res["cpu_s"]]
                out[cfg]["load_avg"].append(os.getloadavg()[0])
        log(f"batched: round {r + 1}/{rounds} done, load {os.getloadavg()[0]:.1f}")
    for cfg, o in out.items():
        o["ms_per_step_median"] = {b: round(sorted(t)[len(t) // 2], 2) for b, t in o["steps_ms"].items() if t}
        o["ms_p10"] = {b: round(sorted(t)[len(t) // 10], 2) for b, t in o["steps_ms"].items() if t}
        o["cpu_ms_per_step_median"] = {b: round(sorted(t)[len(t) // 2], 2) for b, t in o["cpu_ms"].items() if t}
        o["cpu_ms"] = {b: [round(x, 2) for x in t] for b, t in o["cpu_ms"].items()}
        o["load_avg_mean"] = round(sum(o["load_avg"]) / len(o["load_avg"]), 2)
        o["steps_ms"] = {b: [round(x, 2) for x in t] for b, t in o["steps_ms"].items()}
        log(f"batched {cfg}: median ms/step (CPU ms of the 2 threads) " + ", ".join(
            f"batch {b} {v} ({o['cpu_ms_per_step_median'].get(b)})" for b, v in o["ms_per_step_median"].items())
            + f" (load {o['load_avg_mean']})")
    for run in runners.values():
        run.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    ap.add_argument("--sections", nargs="+", default=["rows", "decode", "prefix", "batched"],
                    choices=["rows", "decode", "prefix", "batched"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batched section: batch sizes")
    ap.add_argument("--configs", nargs="+", default=["float32/q", "bfloat16/q+tile", "bfloat16/q+resident", "bfloat16/torch",
                                                     "auto/auto"],
                    help="batched section: DTYPE/PATH[+BATCHED] (auto = what the start-up probe picks)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "linear.json"))
    args = ap.parse_args()
    reps = 2 if args.quick else 5
    result: dict[str, Any] = {
        "cpu": cpu_info(), "cores": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform(),
        "threads": torch.get_num_threads(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "kernel_build": qlinear.build_id(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load_avg_at_start": os.getloadavg(),
    }
    log("measuring read bandwidth ...")
    bw = bandwidth(1 << 28 if args.quick else 1 << 30, 0.2)
    result["read_bandwidth_GBps"] = bw["read_bytes_per_s"] / 1e9
    if "rows" in args.sections:
        layers, _ = model_layers()
        result["rows"] = run_rows(layers, reps)
        del layers
    if "decode" in args.sections or "prefix" in args.sections:
        result["decode"], result["prefix"] = {}, {}
        configs = [("float32", "q"), ("float32", "fp32"), ("float32", "torch"),
                   ("bfloat16", "q"), ("bfloat16", "bf16"), ("bfloat16", "torch")]
        engines = {f"{d}/{p}": decode_engine(p, d) for d, p in configs}
        log("engines: " + "; ".join(f"{k}: {e.linear_summary['weight_bytes'] / 1e6:.1f} MB" for k, e in engines.items()))
        if "decode" in args.sections:
            # round robin: every engine decodes a few steps per round, so a burst of other work on
            # the shared machine lands on one round of each, not on all of one engine's steps
            rounds, per_round = (2, 8) if args.quick else (5, 12)
            steps: dict[str, list[float]] = {k: [] for k in engines}
            loads: dict[str, list[float]] = {k: [] for k in engines}
            for _ in range(rounds):
                for key, eng in engines.items():
                    steps[key] += decode_step_ms(eng, 512, per_round)
                    loads[key].append(os.getloadavg()[0])
            for key, eng in engines.items():
                dtype, path = key.split("/")
                s, cfg = eng.linear_summary, eng.model_config
                bpe = 4 if dtype == "float32" else 2
                kv_bytes = 512 * cfg.num_hidden_layers * 2 * cfg.kv_size * bpe
                times = sorted(steps[key])
                ms = times[len(times) // 2]
                floor = (s["weight_bytes"] + kv_bytes) / bw["read_bytes_per_s"] * 1e3
                result["decode"][key] = {
                    "ms_per_step_median": round(ms, 2), "ms_p10": round(times[len(times) // 10], 2),
                    "ms_min": round(times[0], 2), "steps": len(times), "weight_bytes": s["weight_bytes"],
                    "floor_ms": round(floor, 2), "vs_floor": round(ms / floor, 2),
                    "vs_floor_p10": round(times[len(times) // 10] / floor, 2),
                    "load_avg": round(sum(loads[key]) / len(loads[key]), 2), "kv_bytes": kv_bytes,
                    "kv16_bytes": kv_bytes * 2 // bpe,
                    "weights16_bytes": 2 * sum(p.numel() for p in eng.executor.model.parameters()) if path == "torch" else None,
                }
                log(f"decode {key}: median {ms:.1f} ms/step (p10 {times[len(times) // 10]:.1f}), floor {floor:.1f} ms "
                    f"({ms / floor:.2f}x), weights {s['weight_bytes'] / 1e6:.1f} MB, load {result['decode'][key]['load_avg']:.1f}")
            # the 16-bit floor: the same model with bf16 weights and a bf16 KV cache
            w16 = next((v["weights16_bytes"] for k, v in result["decode"].items() if k == "bfloat16/torch"), None)
            for v in result["decode"].values():
                if w16:
                    v["floor16_ms"] = round((w16 + v["kv16_bytes"]) / bw["read_bytes_per_s"] * 1e3, 2)
                    v["vs_floor16"] = round(v["ms_per_step_median"] / v["floor16_ms"], 2)
        if "prefix" in args.sections:
            for dtype in ("float32", "bfloat16"):
                result["prefix"][dtype] = p = prefix_prefill(engines[f"{dtype}/q"], 2000, 2 if args.quick else 4)
                log(f"prefix {dtype}: cold {p['cold_ms_per_token']:.3f} ms/token, after a 16-token hit "
                    f"{p['after_16_token_hit_ms_per_token']:.3f} ({p['ratio']:.2f}x)")
        del engines
    if "batched" in args.sections:
        result["batched"] = run_batched(args.configs, args.batches, rounds=2 if args.quick else 4,
                                        steps=6 if args.quick else 10)
    result["load_avg_at_end"] = os.getloadavg()
    write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
