"""Where a prefill goes, per prefill attention path (issue 18): linear layers, attention, the glue.

    python benchmarks/prefill_profile.py [--prompts 32] [--len 512] [--paths auto dpbf16 torch]

The bundled model (`--dtype auto`), N random prompts of L tokens each with max_tokens=1 (so the
run is their prefill, in the scheduler's chunks) after a short warm-up, once per
PHASELAB_PREFILL_ATTN value, each in its own process (the path is read when the engine starts),
the paths in turns over --rounds, each keeping its best round. Times are perf_counter wrappers
around PackedLinear.forward and the native calls (prefill_attend, rope_write_kv, add_rms_norm,
silu_mul); under `torch` the attention is inside the rest. Writes JSON naming the CPU.
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


def log(msg: str) -> None:
    print(f"[prefill_profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child(prompts: int, length: int) -> dict:
    import random

    from phaselab import LLM
    from phaselab.core.sampling_params import SamplingParams
    from phaselab.model import kernels
    from phaselab.model.linear import PackedLinear

    llm = LLM(dtype="auto")
    rng = random.Random(0)
    batch = [[rng.randint(100, 20000) for _ in range(length)] for _ in range(prompts)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t: dict[str, float] = {}

    def wrap(owner: object, name: str, key: str) -> None:
        orig = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                t[key] = t.get(key, 0.0) + time.perf_counter() - t0
        setattr(owner, name, timed)

    wrap(PackedLinear, "forward", "linear")
    for name in ("prefill_attend", "rope_write_kv", "add_rms_norm", "silu_mul"):
        wrap(kernels, name, name)
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    total = time.perf_counter() - t0
    return {"total_s": total, "tokens_per_s": prompts * length / total, "parts_s": t,
            "prefill_mode": kernels.prefill_mode(), "prefill_features": kernels.prefill_features()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--paths", nargs="+", default=["auto", "dpbf16", "torch"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "prefill_profile.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(child(ns.prompts, ns.len)))
        return 0
    sys.path.insert(0, str(HERE))
    from _machine import cpu_model, write_json

    best: dict[str, dict] = {}
    rounds: dict[str, list[float]] = {p: [] for p in ns.paths}
    for r in range(ns.rounds):
        for path in ns.paths:
            env = dict(os.environ, PHASELAB_PREFILL_ATTN=path, PYTHONPATH=str(ROOT))
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            log(f"round {r + 1}/{ns.rounds}: {path} ({ns.prompts} x {ns.len} tokens)")
            res = subprocess.run([sys.executable, __file__, "--child", "--prompts", str(ns.prompts), "--len", str(ns.len)],
                                 env=env, capture_output=True, text=True, check=True)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            rounds[path].append(round(got["total_s"], 3))
            parts = ", ".join(f"{k} {v:.2f}" for k, v in got["parts_s"].items())
            log(f"  {path}: {got['total_s']:.2f} s, {got['tokens_per_s']:.0f} tok/s ({parts})")
            if path not in best or got["total_s"] < best[path]["total_s"]:
                best[path] = got
    out = {"benchmark": "prefill_profile", "cpu": cpu_model(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "load_avg": os.getloadavg(), "prompts": ns.prompts, "len": ns.len, "rounds_s": rounds, "best": best}
    write_json(ns.out, out)
    log(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
