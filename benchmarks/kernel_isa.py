"""The small-row linear kernel (kernels/qlinear_*.c) per instruction-set build, against the bandwidth floor.

    python benchmarks/kernel_isa.py                                  # native and portable builds
    python benchmarks/kernel_isa.py --builds native avx2 --before /path/to/older/checkout

Each build runs in its own process (a process loads its kernel library once): PHASELAB_KERNEL_ISA
picks the build (native: -march=native, so AVX-512 where the CPU has it, else AVX2 + FMA + F16C
intrinsics; avx2; portable: plain C loops without AVX2/FMA/F16C). `--before DIR` adds the same
timings from another checkout of phaselab (its own kernel source, built -march=native), labelled
`before`, e.g. the commit before a kernel change. Builds take turns round by round (--rounds), each
case keeping its best round, so drift on a shared machine hits all of them.

Cases: the bundled model's layer shapes (qkv 960x576, gate_up 3072x576, down 576x1536, head
49152x576) in each --formats at 1, 4 and 16 activation rows (fp32 activations), eight copies of
each weight per timing so a call streams from memory as a decode step does. Reported: microseconds
per call, picoseconds per weight, and the ratio to the floor = stored bytes / read bandwidth
(measured in the child: sum of a 256 MiB array). The JSON names the CPU and its flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
BYTES_PER_WEIGHT = {"Q4_1": 20 / 32, "Q4_0": 18 / 32, "Q8_0": 34 / 32, "BF16": 2.0, "F32": 4.0}


def child(formats: list[str], rows: list[int], reps: int) -> dict:
    import torch

    from phaselab.model import kernels
    from phaselab.model.kernels import qlinear
    from phaselab.model.kernels.linear_timing import random_weight

    a = torch.empty(256 * 2**20 // 4).uniform_()
    bw = 0.0
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        bw = max(bw, a.numel() * 4 / (time.perf_counter() - t))
    del a
    g = torch.Generator().manual_seed(0)
    out: dict = {"isa": getattr(kernels, "kernel_isa", lambda: "native (no ISA setting)")(), "features": qlinear.features(), "read_GBps": bw / 1e9, "cases": {}}
    for fmt in formats:
        for name, (n, k) in SHAPES.items():
            ws = [random_weight(fmt, n, k, g) for _ in range(8)]
            for m in rows:
                x, y, scratch = torch.randn(m, k), torch.empty(m, n), torch.empty(m * k)
                best = float("inf")
                for _ in range(reps):
                    t = time.perf_counter()
                    for w in ws:
                        qlinear.linear(fmt, w, n, k, x, y, scratch)
                    best = min(best, (time.perf_counter() - t) / len(ws))
                floor = n * k * BYTES_PER_WEIGHT[fmt] / bw
                out["cases"][f"{fmt} {name} {m}"] = {"us": best * 1e6, "ps_per_weight": best / (n * k) * 1e12,
                                                     "x_floor": best / floor}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", nargs="+", default=["native", "portable"], help="PHASELAB_KERNEL_ISA values")
    ap.add_argument("--before", help="another phaselab checkout to time beside (built -march=native)")
    ap.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "BF16", "F32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "kernel_isa.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.formats, args.rows, args.reps)))
        return
    sys.path.insert(0, str(HERE))
    from _machine import cpu_model

    runs = [(b, b, ROOT) for b in args.builds] + ([("before", "native", Path(args.before))] if args.before else [])
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for label, isa, tree in runs:
            print(f"round {r + 1}/{args.rounds}: {label} ({isa} build of {tree}) ...", flush=True)
            env = {**os.environ, "PHASELAB_KERNEL_ISA": isa, "PYTHONPATH": str(tree),
                   "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
            if label == "before":  # its own kernel cache: never mistaken for this tree's build
                env["PHASELAB_CACHE_DIR"] = str(Path(env.get("TMPDIR", "/tmp")) / "phaselab-kernel-isa-before")
                env.pop("PHASELAB_KERNEL_ISA")
            cmd = [sys.executable, str(HERE / "kernel_isa.py"), "--child", "--formats", *args.formats,
                   "--rows", *map(str, args.rows), "--reps", str(args.reps)]
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                sys.exit(f"{label}: the timing process failed (fix it, or leave that build out):\n{proc.stderr[-2000:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            prev = best.setdefault(label, {**got, "cases": {}})
            prev["read_GBps"] = max(prev["read_GBps"], got["read_GBps"])
            for case, v in got["cases"].items():
                if case not in prev["cases"] or v["us"] < prev["cases"][case]["us"]:
                    prev["cases"][case] = v
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    result = {"cpu": cpu_model(), "isa_flags": [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx"))],
              "threads": os.environ.get("OMP_NUM_THREADS", "torch default"), "loadavg": list(os.getloadavg()),
              "builds": best}
    if args.before:
        commit = subprocess.run(["git", "-C", args.before, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        result["before_commit"] = commit.stdout.strip() or "unknown (not a git checkout)"
    Path(args.out).write_text(json.dumps(result, indent=1))
    labels = list(best)
    print(f"{result['cpu']} ({', '.join(result['isa_flags'])}); read bandwidth "
          + ", ".join(f"{lb} {best[lb]['read_GBps']:.1f} GB/s" for lb in labels))
    print(f"{'case':24s}" + "".join(f"{lb:>22s}" for lb in labels) + "   (ps/weight, x floor)")
    for case in best[labels[0]]["cases"]:
        cells = "".join(f"{best[lb]['cases'][case]['ps_per_weight']:>12.1f} {best[lb]['cases'][case]['x_floor']:>7.2f}x  "
                        for lb in labels if case in best[lb]["cases"])
        print(f"{case:24s}{cells}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
