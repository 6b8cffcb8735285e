"""Is a batch-1 decode step bound by memory or by the linear kernel's own arithmetic? (issue 18)

    python benchmarks/kernel_ceiling.py [--rounds 3] [--out benchmarks/results/kernel_ceiling.json]

The issue's batch-1 target is a floor of bytes / read bandwidth: it assumes the kernel computes
faster than memory delivers. This measures whether it does on the machine at hand, with the
engine's own weights as `phaselab serve` lays them out (the bundled model, bf16, `--weights auto`:
the layers' blocks re-laid as the probe chose, the head as stored), each call straight through
the kernel's C entry point (no Python layer around it):

    resident   the same matrix called again and again: after the first call it is in the caches
               (gate_up is 1.1 MB, a core's L2 is 1-2 MB), so the time is the kernel's arithmetic:
               its compute ceiling, in GB/s of weights as stored; at 1 thread and at 2
    streamed   every layer's matrices and the head in a decode step's order (96 MB), as one step
               reads them; at 2 threads
    read       torch's sum of a 256 MiB array (what phaselab.engine.ceilings and the issue's floor
               call the read bandwidth), and the floor of the streamed bytes at that rate

A compute ceiling below or near the read bandwidth means the step cannot reach its bandwidth floor
by streaming better: the products must get cheaper per weight. Every figure is best of --rounds
rounds, the cases taking turns; the JSON names the CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _machine import cpu_model, write_json  # noqa: E402

KINDS = ("qkv", "o", "gate_up", "down", "head")


def log(msg: str) -> None:
    print(f"[kernel_ceiling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine_matrices():
    """{kind: [PackedLinear per layer]} of the bundled model as served (bf16, weights auto)."""
    from phaselab.engine_args import EngineArgs
    from phaselab.engine.engine import LLMEngine

    engine = LLMEngine(EngineArgs(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512))
    model = engine.executor.model
    layers = model.model.layers
    mats = {"qkv": [x.self_attn.qkv_proj for x in layers], "o": [x.self_attn.o_proj for x in layers],
            "gate_up": [x.mlp.gate_up_proj for x in layers], "down": [x.mlp.down_proj for x in layers],
            "head": [model.head]}
    return engine, mats


def matrix(layer, max_bytes: int | None = None) -> tuple[str, torch.Tensor, int, int]:
    """(format, bytes, rows, in_features) of a PackedLinear's weight as stored; with `max_bytes`,
    only its first rows, about that many bytes of them (rows are stored one after another)."""
    data = layer.packed.data.view(torch.uint8).reshape(-1)
    n = layer.out_features
    if max_bytes is not None:
        row_bytes = data.numel() // n
        n = min(n, max(16, max_bytes // row_bytes))
        data = data[: n * row_bytes]
    return layer.packed.fmt, data, n, layer.in_features


class Calls:
    """Prepared kernel calls, one per matrix (`matrix`): the C function and its arguments, bound once."""

    def __init__(self, matrices: list[tuple[str, torch.Tensor, int, int]]) -> None:
        from phaselab.model.kernels import qlinear

        self.fn = qlinear._lib_or_raise().qlinear
        self.keep, self.args, self.bytes = [], [], 0
        scratch = torch.empty(1 << 20)
        for fmt, data, n, k in matrices:
            x = torch.randn(1, k).bfloat16()
            y = torch.empty(1, n, dtype=torch.bfloat16)
            need = qlinear.scratch_floats(fmt, 1, k, torch.bfloat16)
            assert need <= scratch.numel(), need
            self.keep += [x, y]
            self.args.append((qlinear.FORMAT_IDS[fmt], data.data_ptr(), n, k, x.data_ptr(), 1, 1,
                              scratch.data_ptr(), None, y.data_ptr(), 1, 1))
            self.bytes += data.numel()
        self.keep.append(scratch)

    def seconds(self, min_s: float = 0.05) -> float:
        """Seconds for one pass over every call (the fastest of passes filling `min_s`)."""
        fn, args = self.fn, self.args
        for a in args:
            assert fn(*a) == 0
        best, t_end = float("inf"), time.perf_counter() + min_s
        while True:
            t = time.perf_counter()
            for a in args:
                fn(*a)
            best = min(best, time.perf_counter() - t)
            if time.perf_counter() > t_end:
                return best


def main() -> None:
    from phaselab.engine.ceilings import read_bandwidth
    from phaselab.model.kernels.linear_timing import cpu_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "kernel_ceiling.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    log("loading the bundled model as `phaselab serve` does (bf16, weights auto) ...")
    engine, mats = engine_matrices()
    layouts = {k: v[0].packed.fmt for k, v in mats.items()}
    # the head resident: its first 1 MB of rows (the whole head is 30 MB); the layers: layer 0's
    resident = {k: Calls([matrix(v[0], 1 << 20 if k == "head" else None)]) for k, v in mats.items()}
    step = Calls([matrix(m) for i in range(len(mats["qkv"])) for m in (mats["qkv"][i], mats["o"][i],
                                                                        mats["gate_up"][i], mats["down"][i])]
                 + [matrix(mats["head"][0])])
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for kind, calls in resident.items():
                key = f"resident {kind} {threads}t"
                best[key] = min(best.get(key, float("inf")), calls.seconds())
        torch.set_num_threads(2)
        best["streamed step 2t"] = min(best.get("streamed step 2t", float("inf")), step.seconds(0.5))
        best["read"] = min(best.get("read", float("inf")), 1 / read_bandwidth())
        log(f"round {r + 1}/{args.rounds}: streamed step {best['streamed step 2t'] * 1e3:.2f} ms, read "
            f"{1 / best['read'] / 1e9:.1f} GB/s")
    read = 1 / best["read"]
    rows = {}
    for kind, calls in resident.items():
        rows[kind] = {"format": layouts[kind], "resident_bytes": calls.bytes,
                      **{f"resident_GBps_{t}t": calls.bytes / best[f"resident {kind} {t}t"] / 1e9 for t in (1, 2)}}
        log(f"{kind:8s} {layouts[kind]:6s} resident {calls.bytes / 1e6:5.2f} MB: "
            f"{rows[kind]['resident_GBps_1t']:5.1f} GB/s on 1 thread, {rows[kind]['resident_GBps_2t']:5.1f} on 2")
    step_s = best["streamed step 2t"]
    result = {"benchmark": "kernel_ceiling", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu_model(),
              "cpu_info": cpu_info(), "linear": engine.linear.summary(), "rounds": args.rounds,
              "read_GBps": read / 1e9, "resident": rows,
              "streamed_step": {"bytes": step.bytes, "ms": step_s * 1e3, "GBps": step.bytes / step_s / 1e9,
                                "floor_ms_at_read": step.bytes / read * 1e3}}
    log(f"streamed: a step's {step.bytes / 1e6:.1f} MB of weights in {step_s * 1e3:.2f} ms "
        f"({step.bytes / step_s / 1e9:.1f} GB/s); floor at the read bandwidth ({read / 1e9:.1f} GB/s) "
        f"{step.bytes / read * 1e3:.2f} ms")
    write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
