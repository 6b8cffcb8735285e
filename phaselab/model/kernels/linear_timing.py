"""The linear kernels timed on this CPU: what `--weights auto` and `--dtype auto` decide on
(linear_probe.py beside it decides). One-row products streamed over PROBE_BYTES of each
format's weights (beyond the caches, as a decode step reads them), the kernel against torch's GEMM
at 1..64 rows, the four-row pass against one row at a time, and the 256-row GEMM rate per dtype.
Runs take turns round after round and keep their best (best_in_turns): on a shared machine a
burst of other work hits one round of every run, not all of one. Results are cached per CPU,
kernel build, torch version, thread count and dtype under the kernel cache directory
(probe-*.json; delete them to measure again)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from phaselab import envs
from phaselab.model import kernels
from phaselab.model.kernels import qlinear
from phaselab.model.quant import BLOCK_BYTES, REPACKED, row_bytes

log = logging.getLogger(__name__)

PROBE_BYTES = 64 * 2**20
PROBE_SHAPE = (2048, 1024)  # (N, K) of one probe matrix; copies fill PROBE_BYTES
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64)
BATCHED_ROWS = 32  # the batched decode row count the resident-vs-tile and dtype choices look at
ROWS4_ROWS = (4, 8, 16, 32)  # row counts the four-row pass is timed at against one weight row at a time
_PROBE_VERSION = 6


def cpu_info() -> dict[str, Any]:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")}
    return {"model": model, "isa": isa, "kernel": qlinear.features() if qlinear.available() else {}}


def _cache_file(act_dtype: torch.dtype) -> Path:
    # the layout Q4_1 runs in (PHASELAB_Q4_REPACK) changes what the q path and its four-row pass measure
    key = json.dumps([_PROBE_VERSION, qlinear.build_id(), torch.__version__, torch.get_num_threads(),
                      str(act_dtype), cpu_info()["model"], qlinear.native_format("Q4_1", act_dtype),
                      not envs.AMX.off() and qlinear.features()["amx"]])
    return kernels.cache_dir() / f"probe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure(act_dtype: torch.dtype, use_cache: bool = True) -> dict[str, Any]:
    """The probe's figures for this CPU and dtype, from the cache or measured now (about a second)."""
    file = _cache_file(act_dtype)
    if use_cache and file.exists():
        try:
            return dict(json.loads(file.read_text()), cached=True)
        except (OSError, json.JSONDecodeError):
            pass
    t0 = time.perf_counter()
    dense = "BF16" if act_dtype == torch.bfloat16 else "F32"
    result = {"s_per_weight": _stream_costs(("Q4_1", dense, "torch"), act_dtype),
              "rows": {fmt: _rows_table(fmt, act_dtype) for fmt in ("Q4_1", "BF16", "F32")},
              "batched_stream": _batched_stream("Q4_1", act_dtype),
              "dtype": str(act_dtype).removeprefix("torch."), "load_avg": os.getloadavg()}
    result["rows4"] = _rows4_table(act_dtype)
    result["rows4_min"] = rows4_decision(result["rows4"])
    result["probe_s"] = round(time.perf_counter() - t0, 3)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, file)
    except OSError as e:
        log.warning("phaselab: could not cache the linear probe in %s (%s)", file, e)
    return dict(result, cached=False)


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """A weight of shape (n, k) in `fmt` with random values and sane block scales (probe, benchmarks)."""
    if fmt in ("F32", "BF16", "torch-f32", "torch-bf16"):
        dt = torch.bfloat16 if "BF16" in fmt.upper() else torch.float32
        return (torch.randn(n, k, generator=gen) * 0.02).to(dt)
    data = torch.randint(0, 256, (n, row_bytes(fmt, k)), dtype=torch.uint8, generator=gen)
    blocks = data.view(n, k // 32, BLOCK_BYTES[fmt])
    blocks[..., 0:2] = torch.full((n, k // 32, 1), 0.002, dtype=torch.float16).view(torch.uint8)
    if fmt == "Q4_1":
        blocks[..., 2:4] = torch.full((n, k // 32, 1), -0.015, dtype=torch.float16).view(torch.uint8)
    return data


def time_call(fn: Any, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def best_in_turns(runs: dict[str, Any], rounds: int) -> dict[str, float]:
    """The best time of each run over `rounds` rounds in which the runs take turns (each warmed up
    once first): on a shared machine a burst of other work then hits one round of every run, not
    all of one."""
    best = {name: time_call(run, reps=1) for name, run in runs.items()}
    for _ in range(rounds - 1):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _stream_costs(fmts: tuple[str, ...], act_dtype: torch.dtype, rounds: int = 5) -> dict[str, float]:
    """Seconds per weight of one-row products streaming PROBE_BYTES of each format's weights.

    The formats take turns, round after round, and each keeps its best round (best_in_turns)."""
    n, k = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    store = "BF16" if act_dtype == torch.bfloat16 else "F32"
    x = torch.randn(1, k).to(act_dtype)
    out = torch.empty(1, n, dtype=act_dtype)
    runs, sizes = {}, {}
    for fmt in fmts:
        one = random_weight(store if fmt == "torch" else fmt, n, k, gen)
        copies = max(1, PROBE_BYTES // (one.numel() * one.element_size()))
        ws = [one] + [one.clone() for _ in range(copies - 1)]
        sizes[fmt] = copies * n * k
        if fmt == "torch":
            runs[fmt] = lambda ws=ws: [F.linear(x, w) for w in ws]
        else:  # in the layout the kernel reads (Q4_1X where a layer re-lays Q4_1: qlinear.native_format)
            kf = qlinear.native_format(fmt, act_dtype)
            ws = ws if kf == fmt else [qlinear.repack(kf, w, n, k) for w in ws]
            scratch = torch.empty(max(1, qlinear.scratch_floats(kf, 1, k, act_dtype)))
            runs[fmt] = lambda ws=ws, kf=kf, scratch=scratch: [qlinear.linear(kf, w, n, k, x, out, scratch) for w in ws]
    best = best_in_turns(runs, rounds)
    return {fmt: best[fmt] / sizes[fmt] for fmt in fmts}


def _batched_stream(fmt: str, act_dtype: torch.dtype, rounds: int = 3) -> dict[str, float]:
    """Seconds per weight at BATCHED_ROWS rows over PROBE_BYTES of dense weights (beyond the
    caches, as a model's step is): the GEMM on resident dense copies vs widening `fmt` blocks into
    one tile before each GEMM. A matrix that stays in cache flatters the resident copy (measured
    on the AMD EPYC: 1.3x on one cached matrix, 1.03x on the bundled model's step)."""
    n, k = PROBE_SHAPE
    gen = torch.Generator().manual_seed(2)
    copies = max(1, PROBE_BYTES // (n * k * act_dtype.itemsize))
    blocks = [random_weight(fmt, n, k, gen) for _ in range(copies)]
    dense = [qlinear.dequant(fmt, w, n, k, torch.empty(n, k, dtype=act_dtype)) for w in blocks]
    tile = torch.empty(n, k, dtype=act_dtype)
    x = torch.randn(BATCHED_ROWS, k).to(act_dtype)
    runs = {"resident": lambda: [F.linear(x, w) for w in dense],
            "tile": lambda: [(qlinear.dequant(fmt, w, n, k, tile), F.linear(x, tile)) for w in blocks]}
    best = best_in_turns(runs, rounds)
    return {name: t / (copies * n * k) for name, t in best.items()}


def _rows4_formats(act_dtype: torch.dtype) -> tuple[str, ...]:
    """The kernel layouts with the four-weight-row pass at this activation dtype, as layers hold
    them (qlinear.native_format: Q4_1L in the AVX2 build): not Q4_1X (re-laid for vdpbf16ps) nor
    BF16 x bf16 on vdpbf16ps, which have their own loops."""
    feats = qlinear.features()
    if not (feats["avx512"] or feats["avx2"]):  # the pass is built with AVX-512 or AVX2 (qlinear_avx512.c, _avx2.c)
        return ()
    dp = act_dtype == torch.bfloat16 and qlinear.features()["avx512_bf16_dot"]
    kinds = [qlinear.native_format(f, act_dtype) for f in ("Q8_0", "Q4_0", "Q4_1", "BF16", "F32")]
    return tuple(f for f in kinds if f != "Q4_1X" and not (dp and f == "BF16"))


def _rows4_table(act_dtype: torch.dtype, rounds: int = 2) -> dict[str, dict[str, dict[str, float]]]:
    """Seconds per weight at each of ROWS4_ROWS, four weight rows per pass ("four") against one
    ("one"), over PROBE_BYTES / 2 of each format's weights (beyond the caches, as a step reads them);
    the two take turns, each keeping its best round (best_in_turns)."""
    n, k = PROBE_SHAPE
    gen = torch.Generator().manual_seed(3)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for fmt in _rows4_formats(act_dtype):
        before = qlinear.rows4_min(fmt)
        stored = REPACKED.get(fmt, fmt)
        one = random_weight(stored, n, k, gen)
        one = one if stored == fmt else qlinear.repack(fmt, one, n, k)
        copies = max(1, PROBE_BYTES // 2 // (one.numel() * one.element_size()))
        ws = [one] + [one.clone() for _ in range(copies - 1)]
        table[fmt] = {}
        try:
            for rows in ROWS4_ROWS:
                x = torch.randn(rows, k).to(act_dtype)
                out = torch.empty(rows, n, dtype=act_dtype)
                scratch = torch.empty(max(1, qlinear.scratch_floats(fmt, rows, k, act_dtype)))

                def run(start: int, ws=ws, x=x, out=out, scratch=scratch) -> None:
                    qlinear.set_rows4_min(fmt, start)
                    for w in ws:
                        qlinear.linear(fmt, w, n, k, x, out, scratch)

                best = best_in_turns({"four": lambda rows=rows: run(rows), "one": lambda: run(qlinear.ROWS4_OFF)},
                                      rounds)
                table[fmt][str(rows)] = {m: t / (copies * n * k) for m, t in best.items()}
        finally:
            qlinear.set_rows4_min(fmt, before)
    return table


def rows4_decision(table: dict[str, dict[str, dict[str, float]]]) -> dict[str, int]:
    """Per format: the smallest probed row count from which four weight rows per pass is faster at
    every larger probed count too; qlinear.ROWS4_OFF where it is not faster at the largest."""
    decision = {}
    for fmt, by_rows in table.items():
        start = qlinear.ROWS4_OFF
        for rows in sorted((int(r) for r in by_rows), reverse=True):
            if by_rows[str(rows)]["four"] >= by_rows[str(rows)]["one"]:
                break
            start = rows
        decision[fmt] = start
    return decision


def _rows_table(fmt: str, act_dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Seconds per call at each of CROSSOVER_ROWS on one PROBE_SHAPE weight stored in `fmt`: the
    native kernel, torch's GEMM on the weight widened per call into a tile (`tile`), and on a dense
    copy in the engine dtype (`resident`; `direct` when that is the stored weight itself)."""
    n, k = PROBE_SHAPE
    w = random_weight(fmt, n, k, torch.Generator().manual_seed(1))
    tile = torch.empty(n, k, dtype=act_dtype)
    direct = fmt == ("BF16" if act_dtype == torch.bfloat16 else "F32")
    dense = w if direct else qlinear.dequant(fmt, w, n, k, torch.empty(n, k, dtype=act_dtype))
    kf = qlinear.native_format(fmt, act_dtype)  # the kernel's layout next to a resident copy
    wk = w if kf == fmt else qlinear.repack(kf, w, n, k)
    table = {}
    for rows in CROSSOVER_ROWS:
        x = torch.randn(rows, k).to(act_dtype)
        out = torch.empty(rows, n, dtype=act_dtype)
        scratch = torch.empty(max(1, qlinear.scratch_floats(kf, rows, k, act_dtype)))
        t = {"native": time_call(lambda: qlinear.linear(kf, wk, n, k, x, out, scratch)),
             "resident": time_call(lambda: F.linear(x, dense))}
        t["tile"] = t["resident"] if direct else time_call(lambda: (qlinear.dequant(fmt, w, n, k, tile), F.linear(x, tile)))
        table[str(rows)] = t
    return table


def gemm_rates(use_cache: bool = True) -> dict[str, float]:
    """FLOP/s of torch's GEMM at 256 rows on a PROBE_SHAPE weight, fp32 and bf16. Cached."""
    key = json.dumps([_PROBE_VERSION, torch.__version__, torch.get_num_threads(), cpu_info()["model"], "dtype"])
    file = kernels.cache_dir() / f"probe-dtype-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if use_cache and file.exists():
        try:
            return json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            pass
    n, k = PROBE_SHAPE
    rates = {}
    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(n, k).to(dt)
        x = torch.randn(256, k).to(dt)
        rates[str(dt).removeprefix("torch.")] = 2 * 256 * n * k / time_call(lambda: F.linear(x, w), reps=5)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates))
        os.replace(tmp, file)
    except OSError:
        pass
    return rates
