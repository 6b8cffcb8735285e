"""Which linear path a model runs on this CPU: forced, asked for, or measured at start-up.

Order of precedence:

1. `PHASELAB_LINEAR=q|bf16|fp32|torch` forces a path (tests use it to cover every path on any
   machine);
2. `--weights dequantized` is the torch path (weights dequantized to the engine dtype at load,
   torch's matmuls: the behaviour before the native kernels); `--weights quantized` is the q path;
3. `--weights auto` (the default) measures. Candidates are the paths that compute exactly what the
   dequantized checkpoint in the engine dtype computes, up to summation order: q (GGUF files
   only), the dense native path of the engine dtype, and torch. The probe streams one-row
   matmuls over a 64 MiB buffer of each candidate's format (more than the caches hold: decode
   reads every weight from memory once per step) and turns the rate into seconds per weight;
   the fastest wins, near-ties (within 25%: the probe runs on shared, noisy machines too) going
   to the one that stores fewer bytes. It also finds
   the largest row count (of 2..64) at which the native kernel still beats widening the
   weight into a tile and calling torch's GEMM: the layers' `max_native_rows`.

Results are cached per CPU, kernel build, torch version, thread count and engine dtype under the
kernel cache directory (`$PHASELAB_CACHE_DIR/kernels/probe-*.json`); delete them to re-measure.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from phaselab.errors import ConfigError
from phaselab.model import kernels
from phaselab.model.kernels import qlinear
from phaselab.model.linear import DEFAULT_MAX_NATIVE_ROWS, ENV_VAR, PATHS
from phaselab.model.quant import BLOCK_BYTES, row_bytes

log = logging.getLogger(__name__)

WEIGHT_OPTIONS = ("auto", "quantized", "dequantized")
PROBE_BYTES = 64 * 2**20
PROBE_SHAPE = (2048, 1024)  # (N, K) of one probe matrix; copies fill PROBE_BYTES
CROSSOVER_ROWS = (2, 4, 8, 16, 32, 64)
TIE = 1.25  # a path within this factor of the fastest counts as tied; the smallest storage wins
_PROBE_VERSION = 2


@dataclass
class LinearDecision:
    path: str  # one of PATHS
    reason: str
    max_native_rows: int = DEFAULT_MAX_NATIVE_ROWS
    probe: dict[str, Any] = field(default_factory=dict)  # measured figures (auto) or {}
    cpu: dict[str, Any] = field(default_factory=dict)
    dtype_reason: str = ""  # how the engine dtype was chosen (set by the engine)

    @property
    def keep_packed(self) -> bool:
        """Whether the loader should keep the GGUF blocks: the q path reads them; the bf16 / fp32
        paths widen them once (one rounding, not one into the engine dtype and another after)."""
        return self.path != "torch"

    def summary(self) -> str:
        isa = ",".join(k for k, v in self.cpu.get("isa", {}).items() if v) or "none"
        dtype = f"dtype {self.dtype_reason}; " if self.dtype_reason else ""
        return (f"{dtype}linear path {self.path} ({self.reason}; native <= {self.max_native_rows} rows); "
                f"CPU {self.cpu.get('model', '?')}, ISA {isa}")


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


def has_gguf_blocks(model: str | None, checkpoint: Any = None) -> bool:
    """Whether the checkpoint (a loaded one, or the one at `model`) carries GGUF blocks."""
    if checkpoint is not None:
        from phaselab.model.quant import PackedTensor

        return any(isinstance(w, PackedTensor) for w in checkpoint.weights.values())
    if model is None:
        return True  # the bundled Q4_1 GGUF
    from phaselab.spec.gguf import is_gguf_file

    path = os.path.abspath(os.path.expanduser(model))
    return os.path.isfile(path) and is_gguf_file(path)


def _dense_path(act_dtype: torch.dtype) -> str:
    return "bf16" if act_dtype == torch.bfloat16 else "fp32"


def decide(weights: str, act_dtype: torch.dtype, is_gguf: bool) -> LinearDecision:
    """The path for a model (see module docstring); `is_gguf`: the checkpoint has GGUF blocks."""
    if weights not in WEIGHT_OPTIONS:
        raise ConfigError(f"unknown weights option {weights!r}; choose one of {', '.join(WEIGHT_OPTIONS)}")
    cpu = cpu_info()
    forced = os.environ.get(ENV_VAR)
    if forced:
        if forced not in PATHS:
            raise ConfigError(f"{ENV_VAR}={forced!r} is not a linear path; use one of {', '.join(PATHS)} or unset it")
        if forced != "torch" and not qlinear.available():
            raise ConfigError(f"{ENV_VAR}={forced} needs the native kernel, which is unavailable "
                              f"({qlinear.unavailable_reason()}); unset it or set {ENV_VAR}=torch")
        return LinearDecision(forced, f"forced by {ENV_VAR}", cpu=cpu)
    if weights == "dequantized":
        return LinearDecision("torch", "--weights dequantized", cpu=cpu)
    if not qlinear.available():
        if weights == "quantized":
            raise ConfigError(f"--weights quantized needs the native kernel, which is unavailable "
                              f"({qlinear.unavailable_reason()}); use --weights dequantized")
        return LinearDecision("torch", f"native kernel unavailable: {qlinear.unavailable_reason()}", cpu=cpu)
    probe = measure(act_dtype)
    if weights == "quantized":
        path = "q" if is_gguf else _dense_path(act_dtype)
        return LinearDecision(path, "--weights quantized", _rows_for(path, probe), probe, cpu)
    candidates = (["q"] if is_gguf else []) + [_dense_path(act_dtype), "torch"]
    # seconds per weight at one row; q is judged on Q4_1 (the bundled model's format)
    cost = {p: probe["s_per_weight"][_probe_format(p, act_dtype)] for p in candidates}
    best = min(cost.values())
    stored = {"q": 0, "bf16": 1, "fp32": 2, "torch": 1 if act_dtype == torch.bfloat16 else 2}
    path = min((p for p in candidates if cost[p] <= best * TIE), key=lambda p: stored[p])
    detail = ", ".join(f"{p} {cost[p] * 1e12:.0f} ps/weight" for p in candidates)
    return LinearDecision(path, f"measured at start-up: {detail}", _rows_for(path, probe), probe, cpu)


def _probe_format(path: str, act_dtype: torch.dtype) -> str:
    if path == "q":
        return "Q4_1"
    if path == "torch":
        return "torch"
    return "BF16" if path == "bf16" else "F32"


def _rows_for(path: str, probe: dict[str, Any]) -> int:
    return int(probe.get("max_native_rows", {}).get(path, DEFAULT_MAX_NATIVE_ROWS))


def _cache_file(act_dtype: torch.dtype) -> Path:
    key = json.dumps([_PROBE_VERSION, qlinear.build_id(), torch.__version__, torch.get_num_threads(),
                      str(act_dtype), cpu_info()["model"]])
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
    result = {"s_per_weight": _stream_costs(("Q4_1", "BF16" if act_dtype == torch.bfloat16 else "F32", "torch"), act_dtype),
              "max_native_rows": {}, "load_avg": os.getloadavg()}
    for path, fmt in (("q", "Q4_1"), ("bf16", "BF16"), ("fp32", "F32")):
        result["max_native_rows"][path] = _crossover(fmt, act_dtype)
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


def _time(fn: Any, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _stream_costs(fmts: tuple[str, ...], act_dtype: torch.dtype, rounds: int = 5) -> dict[str, float]:
    """Seconds per weight of one-row products streaming PROBE_BYTES of each format's weights.

    The formats take turns, round after round, and each keeps its best round: on a shared
    machine a burst of other work then hits one round of every format, not all of one."""
    n, k = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    store = "BF16" if act_dtype == torch.bfloat16 else "F32"
    x = torch.randn(1, k).to(act_dtype)
    out = torch.empty(1, n, dtype=act_dtype)
    scratch = torch.empty(k)
    runs, sizes = {}, {}
    for fmt in fmts:
        one = random_weight(store if fmt == "torch" else fmt, n, k, gen)
        copies = max(1, PROBE_BYTES // (one.numel() * one.element_size()))
        ws = [one] + [one.clone() for _ in range(copies - 1)]
        sizes[fmt] = copies * n * k
        if fmt == "torch":
            runs[fmt] = lambda ws=ws: [F.linear(x, w) for w in ws]
        else:
            runs[fmt] = lambda ws=ws, fmt=fmt: [qlinear.linear(fmt, w, n, k, x, out, scratch) for w in ws]
    best = {fmt: _time(run, reps=1) for fmt, run in runs.items()}
    for _ in range(rounds - 1):
        for fmt, run in runs.items():
            t = time.perf_counter()
            run()
            best[fmt] = min(best[fmt], time.perf_counter() - t)
    return {fmt: best[fmt] / sizes[fmt] for fmt in fmts}


def _crossover(fmt: str, act_dtype: torch.dtype) -> int:
    """Largest probed row count at which the native kernel beats tile widening + torch's GEMM."""
    n, k = PROBE_SHAPE
    w = random_weight(fmt, n, k, torch.Generator().manual_seed(1))
    tile = torch.empty(n, k, dtype=act_dtype)
    direct = fmt == ("BF16" if act_dtype == torch.bfloat16 else "F32")
    best = 1
    for rows in CROSSOVER_ROWS:
        x = torch.randn(rows, k).to(act_dtype)
        out = torch.empty(rows, n, dtype=act_dtype)
        scratch = torch.empty(rows * k)
        native = _time(lambda: qlinear.linear(fmt, w, n, k, x, out, scratch))
        if direct:
            gemm = _time(lambda: F.linear(x, w))
        else:
            gemm = _time(lambda: (qlinear.dequant(fmt, w, n, k, tile), F.linear(x, tile)))
        if native > gemm:
            break
        best = rows
    return best


def auto_dtype(use_cache: bool = True) -> tuple[torch.dtype, str]:
    """dtype auto: bf16 when torch's bf16 GEMM (AMX, AVX512-BF16 ...) measures at least 0.9x as
    fast as fp32 at 256 rows on a model-sized matrix (ties go to bf16: half the KV-cache bytes),
    else fp32. Cached like the linear probe."""
    key = json.dumps([_PROBE_VERSION, torch.__version__, torch.get_num_threads(), cpu_info()["model"], "dtype"])
    file = kernels.cache_dir() / f"probe-dtype-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    rates = None
    if use_cache and file.exists():
        try:
            rates = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            rates = None
    if rates is None:
        n, k = PROBE_SHAPE
        rates = {}
        for dt in (torch.float32, torch.bfloat16):
            w = torch.randn(n, k).to(dt)
            x = torch.randn(256, k).to(dt)
            rates[str(dt).removeprefix("torch.")] = 2 * 256 * n * k / _time(lambda: F.linear(x, w), reps=5)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(rates))
            os.replace(tmp, file)
        except OSError:
            pass
    bf16 = rates["bfloat16"] >= 0.9 * rates["float32"]
    reason = (f"auto: 256-row GEMM bf16 {rates['bfloat16'] / 1e9:.0f} vs fp32 {rates['float32'] / 1e9:.0f} GFLOP/s"
              + (" (bf16 within 10% or faster)" if bf16 else " (fp32 faster)"))
    return (torch.bfloat16 if bf16 else torch.float32), reason


def to_json(decision: LinearDecision) -> dict[str, Any]:
    return asdict(decision)
