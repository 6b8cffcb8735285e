"""Batched rows on AMX tiles against the dot-product loops and torch's GEMM (kernels/qlinear_amx.c, issue 18).

    python benchmarks/amx_rows.py [--rows 1 2 4 8 16 32 64] [--rounds 5]

The bundled model's layer shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 as
Q4_1X, the layout a bf16 engine re-lays Q4_1 into on AVX512-BF16; the head 49152x576 as Q8_0, as
stored), bf16 activations and outputs, two threads (the kernel pool), per call:

    amx    qlinear with amx_min 1: 16 weight rows widened to bf16 in L1, TDPBF16PS
    dot    qlinear with AMX off: the vdpbf16ps / AVX-512 dot-product loops
    torch  F.linear on the weight widened to bf16 once (resident), torch's oneDNN GEMM

Eight copies of each weight per timing (a call streams its weight from memory, as a decode step
does), the three taking turns round by round, each keeping its best round. Reported: microseconds
per call and each path's ratio to amx. The JSON names the CPU; on a CPU without AMX it says so and
times dot and torch only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _machine import cpu_model, write_json  # noqa: E402

SHAPES = {"qkv": ("Q4_1X", 960, 576), "o": ("Q4_1X", 576, 576), "gate_up": ("Q4_1X", 3072, 576),
          "down": ("Q4_1X", 576, 1536), "head": ("Q8_0", 49152, 576)}


def log(msg: str) -> None:
    print(f"[amx_rows {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "amx_rows.json"))
    ns = ap.parse_args()

    from phaselab.model import quant
    from phaselab.model.kernels import qlinear
    from phaselab.model.kernels.linear_timing import random_weight

    torch.set_num_threads(ns.threads)
    if not qlinear.available():
        log(f"native kernel unavailable: {qlinear.unavailable_reason()}")
        return 1
    feats = qlinear.features()
    amx = feats["amx"]
    if not amx:
        log("this CPU (or build) has no AMX tiles: timing dot and torch only")
    g = torch.Generator().manual_seed(0)
    cases: dict[str, dict] = {}
    for name, (fmt, n, k) in SHAPES.items():
        stored = "Q4_1" if fmt == "Q4_1X" else fmt
        ws = [random_weight(stored, n, k, g) for _ in range(8)]
        if fmt == "Q4_1X":
            ws = [qlinear.repack("Q4_1X", w, n, k) for w in ws]
        dense = [quant.dequantize_blocks(fmt, w, (n, k)).bfloat16() for w in ws]
        for m in ns.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            y = torch.empty(m, n, dtype=torch.bfloat16)
            scratch = torch.empty(max(1, qlinear.scratch_floats(fmt, m, k, torch.bfloat16)))

            def native(rows: int) -> None:
                qlinear.set_amx_min(fmt, rows)
                for w in ws:
                    qlinear.linear(fmt, w, n, k, x, y, scratch)

            runs = {"dot": lambda: native(qlinear.AMX_OFF), "torch": lambda: [F.linear(x, d) for d in dense]}
            if amx:
                runs = {"amx": lambda: native(1), **runs}
            best = {p: float("inf") for p in runs}
            for _ in range(ns.rounds):
                for p, fn in runs.items():
                    fn()  # warm (and the AMX setting in place)
                    t = time.perf_counter()
                    fn()
                    best[p] = min(best[p], (time.perf_counter() - t) / len(ws))
            row = {p: round(v * 1e6, 1) for p, v in best.items()}
            if amx:
                row.update({f"{p}/amx": round(best[p] / best["amx"], 2) for p in ("dot", "torch")})
            cases[f"{name} {n}x{k} {fmt} rows={m}"] = row
            log(f"{name} {n}x{k} {fmt} at {m} rows: " + ", ".join(f"{p} {v}" for p, v in row.items()))
        qlinear.set_amx_min(fmt, 0)
    out = {"benchmark": "amx_rows", "cpu": cpu_model(), "features": feats, "threads": ns.threads,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_avg": os.getloadavg(), "unit": "us per call",
           "cases": cases}
    write_json(ns.out, out)
    log(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
