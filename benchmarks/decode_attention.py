"""Decode attention per layer call: the part kernels side by side (kernels/paged_decode.c, issue 18).

    python benchmarks/decode_attention.py [--shapes 1x768 8x512 32x512] [--rounds 3]
        [--compare-source OLD_paged_decode.c]

The bundled model's heads (9 query, 3 KV, 64 wide, blocks of 16), a bf16 cache with scattered
blocks, q exactly bf16 (as the bf16 model's RoPE leaves it), two threads (the kernel pool). Each
timing cycles through enough copies of the cache (30, a step's layers; fewer for the largest
batches) that every call streams its context from memory, as a decode step does. Paths:

    c        PHASELAB_DECODE_ATTN=c: the float32 loops in 128-token parts
    dpbf16   PHASELAB_DECODE_ATTN=dpbf16: vdpbf16ps scores (skipped without AVX512-BF16)
    compare  paged_decode from another source file (e.g. an older commit's:
             git show ca381d4:phaselab/model/kernels/paged_decode.c > /tmp/old.c), built alone

The paths take turns round by round; each keeps its best round. Microseconds per call, written as
JSON with the CPU named (`benchmarks/results/decode_attention.json`).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _machine import write_json  # noqa: E402

from phaselab.model import kernels  # noqa: E402
from phaselab.model.kernels import build  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def log(msg: str) -> None:
    print(f"[decode_attention {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_compare(source: Path) -> ctypes.CDLL:
    """`source` compiled alone with the kernels' flags, its pool hook set to phaselab's pool."""
    out = Path(tempfile.mkdtemp()) / "compare.so"
    include = Path(kernels.__file__).with_name("simd.h").parent
    subprocess.run([build.compiler() or "cc", *build.flags(), f"-I{include}", "-o", str(out), str(source), "-lm"],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = kernels._load().paged_decode.argtypes
    lib.paged_decode_set_pool.argtypes = [ctypes.c_void_p]
    lib.paged_decode_set_pool(kernels.pool_address())
    return lib


def measure(batch: int, context: int, rounds: int, compare: ctypes.CDLL | None) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    per = -(-context // BS)
    blocks = batch * per + 4
    copies = 30 if batch <= 8 else 8  # a step's layers; at 32 x 512 eight copies are already 100 MB
    caches = [torch.randn(2, blocks, BS, KVH, D, generator=g).to(torch.bfloat16) for _ in range(copies)]
    tables = torch.randperm(blocks, generator=g)[: batch * per].view(batch, per).contiguous()
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, H, D, generator=g).bfloat16().float()
    out = torch.empty(batch, H, D)
    lib = kernels._load()
    paths: dict[str, tuple[ctypes.CDLL, str | None]] = {"c": (lib, "c")}
    if kernels.decode_features().get("avx512_bf16_dot"):
        paths["dpbf16"] = (lib, "dpbf16")
    if compare is not None:
        paths["compare"] = (compare, None)
    best: dict[str, float] = {}
    calls = 200 if batch <= 8 else 60
    for _ in range(rounds):
        for name, (fn_lib, mode) in paths.items():
            if mode is not None:
                kernels.set_decode_attn(mode)
            fn = fn_lib.paged_decode

            def call(i: int) -> None:
                c = caches[i % copies]
                rc = fn(q.data_ptr(), c[0].data_ptr(), c[1].data_ptr(), 1, tables.data_ptr(), per, lens.data_ptr(),
                        out.data_ptr(), batch, H, KVH, D, BS, D**-0.5)
                assert rc == 0, rc
            for i in range(copies):
                call(i)
            t = time.perf_counter()
            for i in range(calls):
                call(i)
            us = (time.perf_counter() - t) / calls * 1e6
            best[name] = min(best.get(name, us), us)
    kernels.set_decode_attn(kernels.decode_attn_mode())
    return {k: round(v, 1) for k, v in best.items()}


def main() -> None:
    from phaselab.model.kernels.linear_timing import cpu_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x768", "8x512", "32x512"], help="BATCHxCONTEXT")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-source", type=Path, default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "decode_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        sys.exit(f"the native kernels are unavailable: {kernels.unavailable_reason()}")
    compare = build_compare(args.compare_source) if args.compare_source else None
    result = {"benchmark": "decode_attention", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu_info(),
              "threads": args.threads, "heads": {"H": H, "KVH": KVH, "D": D, "BS": BS},
              "compare_source": str(args.compare_source) if args.compare_source else None, "us_per_call": {}}
    for shape in args.shapes:
        b, ctx = (int(x) for x in shape.split("x"))
        r = measure(b, ctx, args.rounds, compare)
        result["us_per_call"][shape] = r
        log(f"batch {b} x {ctx} tokens: " + ", ".join(f"{k} {v} us" for k, v in r.items()))
    write_json(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
