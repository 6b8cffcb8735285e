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
   to the one that stores fewer bytes.

Above a row count the native kernel loses to torch's GEMM (batched decode, prefill). The probe
times, at 1..64 rows on one model-sized matrix, the kernel, the GEMM on a weight widened per call
into a tile, and the GEMM on a dense weight kept resident. `--weights auto` keeps the resident
copy (`batched` = "resident": more memory, recorded in config.json) when it beats the tile at
BATCHED_ROWS by more than the tie factor, timed over PROBE_BYTES of weights as a step streams them; `--weights quantized` always widens per call ("tile":
the blocks are all it holds). `max_native_rows` is the largest row count at which the kernel
still beats the chosen GEMM (counting up from one row; a near-tie does not end the count, a clear loss
does: `_crossover`). `PHASELAB_BATCHED=tile|resident` forces the choice, `PHASELAB_NATIVE_ROWS=N` the
row count (a rerun of a recorded run pins both, and the four-row pass, to what the run used:
phaselab/experiments/diagnose_verify.py).

How far ahead the Q4_1X kernel prefetches its weight rows (`prefetch_bytes`) is measured once the
model is loaded, on its own layers (kernels/prefetch_probe.py); the decision records it. The timings
themselves are kernels/linear_timing.py's.

`--dtype auto` is chosen on what both phases run, in both dtypes: the best linear path's cost
per weight at one row and at BATCHED_ROWS rows (decode) and the 256-row GEMM rate (prefill); the
geometric mean of each dtype's three ratios to the faster one decides, ties within 10% going to
bf16, whose KV cache is half the bytes.

The timings are cached per CPU, kernel build, torch version, thread count and engine dtype under
the kernel cache directory (`$PHASELAB_CACHE_DIR/kernels/probe-*.json`); delete them to re-measure.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from phaselab import envs
from phaselab.errors import ConfigError
from phaselab.model.kernels import qlinear
from phaselab.model.kernels.linear_timing import BATCHED_ROWS, CROSSOVER_ROWS, PROBE_SHAPE, cpu_info, gemm_rates, measure
from phaselab.model.linear import BATCHED, DEFAULT_MAX_NATIVE_ROWS, PATHS

log = logging.getLogger(__name__)

WEIGHT_OPTIONS = ("auto", "quantized", "dequantized")
TIE = 1.25  # a path within this factor of the fastest counts as tied; the smallest storage wins
DTYPE_TIE = 1.10
# N: four weight rows at a time from N activation rows, every format; "off": never; or per format,
# "Q4_0=32,Q8_0=off" (the others keep the kernel's default), as config.json's linear.rows4_min records it
# N: the native kernel runs up to N activation rows, the GEMM above (0: the GEMM from one row)


@dataclass
class LinearDecision:
    path: str  # one of PATHS
    reason: str
    max_native_rows: int = DEFAULT_MAX_NATIVE_ROWS
    batched: str = "tile"  # the GEMM's dense weight above max_native_rows: linear.BATCHED
    probe: dict[str, Any] = field(default_factory=dict)  # measured figures (auto) or {}
    cpu: dict[str, Any] = field(default_factory=dict)
    dtype_reason: str = ""  # how the engine dtype was chosen (set by the engine)
    layouts: dict[str, int] = field(default_factory=dict)  # layers re-laid for the kernel (set by the engine)
    # per format, the activation rows from which the kernel reads four weight rows per pass
    # (qlinear.set_rows4_min; qlinear.ROWS4_OFF: never); {} leaves the kernel's built-in default
    rows4_min: dict[str, int] = field(default_factory=dict)
    # bf16 activation rows from which the kernel runs on AMX tiles (qlinear.amx_min); 0: no AMX here
    amx_min: int = 0
    # bytes ahead the Q4_1X kernel prefetches its rows (qlinear.set_prefetch; prefetch_probe.choose); 0: the default
    prefetch_bytes: int = 0
    prefetch_probe: dict[str, float] = field(default_factory=dict)  # ms per streamed pass, by candidate

    def apply_rows4(self) -> None:
        """Set the kernel's four-row pass to this decision's, every format (the setting is
        process-wide: an earlier engine's must not linger; a format not in rows4_min gets the
        kernel's default)."""
        for fmt in qlinear.FORMAT_IDS:
            qlinear.set_rows4_min(fmt, self.rows4_min.get(fmt, 0))

    @property
    def keep_packed(self) -> bool:
        """Whether the loader should keep the GGUF blocks: the q path reads them; the bf16 / fp32
        paths widen them once (one rounding, not one into the engine dtype and another after)."""
        return self.path != "torch"

    @property
    def wide_rows(self) -> int:
        """Rows above which a forward leaves the one-row kernel for the batched GEMM, a cost step the
        cost models price apart (core/adaptive_budget.py, cost/record_fit.py); 0 when every layer runs through torch."""
        return self.max_native_rows if self.path != "torch" else 0

    def summary(self) -> str:
        isa = ",".join(k for k, v in self.cpu.get("isa", {}).items() if v) or "none"
        dtype = f"dtype {self.dtype_reason}; " if self.dtype_reason else ""
        layouts = "".join(f", {n} layers' blocks re-laid as {f}" for f, n in self.layouts.items())
        if self.rows4_min:
            layouts += ", four weight rows per pass " + ", ".join(
                f"{f} {'never' if r >= qlinear.ROWS4_OFF else f'from {r} rows'}" for f, r in self.rows4_min.items())
        if self.amx_min and self.path == "q":
            layouts += f", AMX tiles from {self.amx_min} bf16 rows"
        if self.prefetch_bytes:
            layouts += f", Q4_1X rows prefetched {self.prefetch_bytes} B ahead"
        return (f"{dtype}linear path {self.path} ({self.reason}; native <= {self.max_native_rows} rows{layouts}, "
                f"then GEMM on a {self.batched} weight); "
                f"CPU {self.cpu.get('model', '?')}, ISA {isa}")


def has_gguf_blocks(model: str | None, checkpoint: Any = None) -> bool:
    """Whether the checkpoint (a loaded one, or the one at `model`) carries GGUF blocks."""
    if checkpoint is not None:
        from phaselab.model.quant import PackedTensor

        return any(isinstance(w, PackedTensor) for w in checkpoint.weights.values())
    if model is None:
        return True  # the bundled Q4_1 GGUF
    from phaselab.modelinfo.gguf import is_gguf_file

    path = os.path.abspath(os.path.expanduser(model))
    return os.path.isfile(path) and is_gguf_file(path)


def _dense_path(act_dtype: torch.dtype) -> str:
    return "bf16" if act_dtype == torch.bfloat16 else "fp32"


def _forced_batched() -> str | None:
    forced = envs.BATCHED.get()
    if forced and forced not in BATCHED:
        raise ConfigError(f"{envs.BATCHED.name}={forced!r} is not a choice; use one of {', '.join(BATCHED)} or unset it")
    return forced or None


def _forced_native_rows() -> int | None:
    forced = envs.NATIVE_ROWS.get()
    if not forced:
        return None
    try:
        rows = int(forced)
        if rows < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{envs.NATIVE_ROWS.name}={forced!r} is not a row count; give an integer >= 0 or unset it") from None
    return rows


def decide(weights: str, act_dtype: torch.dtype, is_gguf: bool) -> LinearDecision:
    """The path for a model (see module docstring); `is_gguf`: the checkpoint has GGUF blocks.
    envs.NATIVE_ROWS overrides max_native_rows on whichever native path is chosen."""
    decision = _decide(weights, act_dtype, is_gguf)
    rows = _forced_native_rows()
    if rows is not None and decision.path != "torch":
        decision.max_native_rows = rows
        decision.reason += f"; native rows forced by {envs.NATIVE_ROWS.name}"
    return decision


def _decide(weights: str, act_dtype: torch.dtype, is_gguf: bool) -> LinearDecision:
    if weights not in WEIGHT_OPTIONS:
        raise ConfigError(f"unknown weights option {weights!r}; choose one of {', '.join(WEIGHT_OPTIONS)}")
    cpu = cpu_info()
    forced = envs.LINEAR.get()
    forced_batched = _forced_batched()
    if forced:
        if forced not in PATHS:
            raise ConfigError(f"{envs.LINEAR.name}={forced!r} is not a linear path; use one of {', '.join(PATHS)} or unset it")
        if forced != "torch" and not qlinear.available():
            raise ConfigError(f"{envs.LINEAR.name}={forced} needs the native kernel, which is unavailable "
                              f"({qlinear.unavailable_reason()}); unset it or set {envs.LINEAR.name}=torch")
        return _with_rows4(LinearDecision(forced, f"forced by {envs.LINEAR.name}", batched=forced_batched or "tile", cpu=cpu),
                           {})
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
        batched = forced_batched or "tile"
        return _with_rows4(LinearDecision(path, "--weights quantized", _rows_for(path, batched, probe), batched, probe,
                                          cpu), probe)
    candidates = (["q"] if is_gguf else []) + [_dense_path(act_dtype), "torch"]
    # seconds per weight at one row; q is judged on Q4_1 (the bundled model's format)
    cost = {p: probe["s_per_weight"][_probe_format(p, act_dtype)] for p in candidates}
    best = min(cost.values())
    stored = {"q": 0, "bf16": 1, "fp32": 2, "torch": 1 if act_dtype == torch.bfloat16 else 2}
    path = min((p for p in candidates if cost[p] <= best * TIE), key=lambda p: stored[p])
    detail = ", ".join(f"{p} {cost[p] * 1e12:.0f} ps/weight" for p in candidates)
    batched = forced_batched or _batched_choice(path, probe)
    return _with_rows4(LinearDecision(path, f"measured at start-up: {detail}", _rows_for(path, batched, probe), batched,
                                      probe, cpu), probe)


def _with_rows4(decision: LinearDecision, probe: dict[str, Any]) -> LinearDecision:
    """Set, for every format, the row count from which the kernel reads four weight rows per pass:
    forced by envs.ROWS4_MIN, else the probe's `rows4_min` (rows4_decision), else the kernel's default
    (a path forced by envs.LINEAR runs no probe)."""
    forced = envs.ROWS4_MIN.get()
    if forced:
        decision.rows4_min = parse_rows4(forced)
    else:
        decision.rows4_min = dict(probe.get("rows4_min") or {})
    if qlinear.available():  # on the torch path too: no earlier engine's setting lingers in the process
        decision.apply_rows4()
        amx = qlinear.amx_min("Q8_0")  # one setting for every format (PHASELAB_AMX=0: AMX_OFF)
        decision.amx_min = amx if qlinear.features()["amx"] and 0 < amx < qlinear.AMX_OFF else 0
    return decision


def parse_rows4(text: str) -> dict[str, int]:
    """envs.ROWS4_MIN's value as {format: rows4_min}: "N" or "off" for every format, or per format
    "FMT=N|off,..." (rows4_text writes it)."""
    def rows(value: str) -> int:
        try:
            n = qlinear.ROWS4_OFF if value == "off" else int(value)
            if n < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{envs.ROWS4_MIN.name}={text!r}: {value!r} is not a row count; give an integer >= 1 or "
                              "'off', for every format or per format as Q4_0=32,Q8_0=off") from None
        return n
    if "=" not in text:
        return {fmt: rows(text.strip()) for fmt in qlinear.FORMAT_IDS}
    out = {}
    for item in text.split(","):
        fmt, _, value = item.partition("=")
        fmt = fmt.strip()
        if fmt not in qlinear.FORMAT_IDS:
            raise ConfigError(f"{envs.ROWS4_MIN.name}={text!r}: unknown format {fmt!r}; use one of {', '.join(qlinear.FORMAT_IDS)}")
        out[fmt] = rows(value.strip())
    return out


def rows4_text(rows4_min: dict[str, int]) -> str:
    """`rows4_min` as envs.ROWS4_MIN's per-format value (parse_rows4 reads it back)."""
    return ",".join(f"{f}={'off' if r >= qlinear.ROWS4_OFF else r}" for f, r in rows4_min.items())


def _batched_choice(path: str, probe: dict[str, Any]) -> str:
    """resident when the GEMM on a kept dense weight beats widening per call by more than TIE at
    BATCHED_ROWS (the q path; a dense path in the engine dtype reads its own weight either way)."""
    if path != "q":
        return "tile"
    t = probe["batched_stream"]
    return "resident" if t["resident"] * TIE < t["tile"] else "tile"


def _probe_format(path: str, act_dtype: torch.dtype) -> str:
    if path == "q":
        return "Q4_1"
    if path == "torch":
        return "torch"
    return "BF16" if path == "bf16" else "F32"


def crossover_table(path: str, batched: str, probe: dict[str, Any]) -> tuple[dict[str, dict[str, float]], str] | None:
    """The probe's per-row timings for `path`'s format and the GEMM the kernel hands over to above
    max_native_rows: on the stored weight (dense path in the engine dtype) "resident", else `batched`
    (resident or tile). None when the probe has no table for it."""
    fmt = {"q": "Q4_1", "bf16": "BF16", "fp32": "F32"}.get(path)
    table = probe.get("rows", {}).get(fmt)
    if not table:
        return None
    direct = fmt == {"bfloat16": "BF16", "float32": "F32"}.get(probe.get("dtype", ""))
    return table, "resident" if batched == "resident" or direct else "tile"


def _rows_for(path: str, batched: str, probe: dict[str, Any]) -> int:
    """max_native_rows from the probe (`_crossover`), or the default when it has no table."""
    found = crossover_table(path, batched, probe)
    return _crossover(*found) if found else DEFAULT_MAX_NATIVE_ROWS


def _crossover(table: dict[str, dict[str, float]], gemm: str) -> int:
    """The largest probed row count at which the kernel beat the GEMM, counting up from one row and
    stopping at the first one where it clearly lost (slower by more than TIE). A near-tie does not
    stop the count: at one row an F32 kernel and torch's GEMM on the same dense weight stream the
    same bytes, and the probe measured 278 against 261 us on an AVX2-only EPYC, where the kernel was
    then 1.8-4.2x faster at 2 to 32 rows; stopping there handed every decode to torch's GEMM, whose
    2-row step cost twice its 1-row one (a dense fp32 decode step at batch 2: 150 ms, at batch 1: 78)."""
    best = 0
    for rows in CROSSOVER_ROWS:
        native, other = table[str(rows)]["native"], table[str(rows)][gemm]
        if native > other * TIE:
            break
        if native <= other:
            best = rows
    return best


def auto_dtype(is_gguf: bool = True, native: bool = True, use_cache: bool = True) -> tuple[torch.dtype, str]:
    """dtype auto, chosen on what both phases run (module docstring): in each dtype, the best
    linear path's cost per weight at one row and at BATCHED_ROWS rows (decode; q only for GGUF
    files, native paths only when `native`: not under --weights dequantized) and the 256-row GEMM
    rate (prefill); the geometric mean of the three ratios to the faster dtype decides, ties within
    DTYPE_TIE going to bf16 (half the KV-cache bytes). Prefill counts because on a CPU without
    AVX512-BF16 or AMX torch's bf16 GEMM is emulated: on an AMD EPYC with AVX2 only it ran 19
    GFLOP/s against fp32's 124, a 512-token prompt 6x slower, while decode was within 10%."""
    native = native and qlinear.available()
    gemm = gemm_rates(use_cache)
    if not native:  # the torch path only: its GEMM decides, as it is what every row count runs
        bf16 = gemm["bfloat16"] >= 0.9 * gemm["float32"]
        reason = (f"auto: 256-row GEMM bf16 {gemm['bfloat16'] / 1e9:.0f} vs fp32 {gemm['float32'] / 1e9:.0f} GFLOP/s"
                  + (" (bf16 within 10% or faster)" if bf16 else " (fp32 faster)"))
        return (torch.bfloat16 if bf16 else torch.float32), reason
    n, k = PROBE_SHAPE
    cost: dict[str, tuple[float, float]] = {}
    for dt in (torch.float32, torch.bfloat16):
        probe = measure(dt, use_cache)
        fmts = (["Q4_1"] if is_gguf else []) + [_probe_format(_dense_path(dt), dt)]
        one = min(probe["s_per_weight"][f] for f in fmts + ["torch"])
        batched = min(t for f in fmts for t in probe["rows"][f][str(BATCHED_ROWS)].values()) / (n * k)
        cost[str(dt).removeprefix("torch.")] = (one, batched)
    best1 = min(c[0] for c in cost.values())
    best_b = min(c[1] for c in cost.values())
    best_gemm = max(gemm.values())
    score = {dt: ((c[0] / best1) * (c[1] / best_b) * (best_gemm / gemm[dt])) ** (1 / 3) for dt, c in cost.items()}
    bf16 = score["bfloat16"] <= score["float32"] * DTYPE_TIE
    detail = "; ".join(f"{dt} {c[0] * 1e12:.0f} ps/weight at 1 row, {c[1] * 1e12:.1f} at {BATCHED_ROWS} rows"
                       for dt, c in cost.items())
    reason = (f"auto: decode linear {detail}; 256-row GEMM bf16 {gemm['bfloat16'] / 1e9:.0f} vs fp32 "
              f"{gemm['float32'] / 1e9:.0f} GFLOP/s; both phases "
              + ("bf16 as fast or faster, within 10%" if bf16 else f"fp32 faster ({score['bfloat16'] / score['float32']:.2f}x)"))
    return (torch.bfloat16 if bf16 else torch.float32), reason


def to_json(decision: LinearDecision) -> dict[str, Any]:
    out = asdict(decision)
    del out["layouts"]  # config.json's linear summary has them ("kernel_layouts", from install)
    return out
