"""Measured attribution of decode time: weights, K/V reads and per-step overhead, from the run's
own decode-only iterations, not from modeled byte shares.

Two measurements, the first wherever it exists:

- **timed** (`method="timers"`): the engine's native decode call times its own kernels every step
  (iterations.jsonl's attention_ns / linear_ns / elementwise_ns, docs/run-directory.md); a step's K/V
  share is its attention time over its duration, the weights' its linear time, the rest overhead.
  Needs no spread in batch or history: one batch at one context length is split as well as any.
- **regression** (`method="regression"`), where no timer exists (a run of another server read from
  outside, the Python decode path), below:

    step_s = a + b * batch + c * context_tokens          (least absolute deviations, a, b, c >= their floors)
              │     │            └─ K/V reads: c per token of history a decode attends to
              │     └─ per sequence in the batch (sampling, per-token compute): overhead
              └─ per step: the weights (read once per step) + fixed per-step overhead

The cost model is the prior and the bound: with a measured roofline, the K/V cost per token cannot
be below the K/V bytes memory must move per token of history (`kv_bytes_per_token`, less the re-reads
of blocks a shared prefix gives several sequences of one step: a cache serves those) / bandwidth,
and the step cannot be below `weight_bytes / bandwidth`;
the weights' part of `a` is that floor (bytes / measured bandwidth, capped at `a`), the rest of `a`
is per-step overhead. Every coefficient carries its 95% interval from the fit's residuals.

Not separable (said, not guessed) when the run lacks the spread: too few decode steps, the history
moves in lockstep with the batch (then K/V and per-sequence cost are one column), or the fit pins
the K/V part of a step only to worse than +-15% of the step (95%). Steps beyond 4 robust sigmas
of the first fit (a shared machine's stalls) are dropped before the final fit. The accounting then leaves decode time unsplit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from phaselab.analysis.stats import t975
from phaselab.core.timing import IterationRecord

MIN_STEPS = 10
MAX_KV_UNCERTAINTY = 0.15  # the K/V part's 95% half-width, as a share of the mean step: beyond, not separable
MAX_COLLINEARITY = 0.97  # |corr(batch, context)| above this: the two cannot be told apart


@dataclass(frozen=True)
class DecodeAttribution:
    separable: bool
    reason: str  # why not, when not separable
    num_steps: int
    per_step_s: float = 0.0  # a
    per_seq_s: float = 0.0  # b
    per_kv_token_s: float = 0.0  # c
    ci: tuple[float, float, float] = (math.inf, math.inf, math.inf)  # 95% half-widths of a, b, c
    weights_s: float = 0.0  # the part of a the weights explain (bytes / bandwidth, at most a)
    rmse_s: float = 0.0
    r2: float = 0.0
    shares: dict[str, float] | None = None  # weights / kv / overhead of the decode steps' time
    bounded: bool = False  # the floors of a measured roofline were applied
    method: str = "regression"  # "timers": the steps' own kernel timers; "regression": the fit above
    mean_kv_fraction: float = 0.0  # timers: the K/V share of the timed steps (a step without timers gets it)

    def predict(self, batch: float, context: float) -> float:
        return self.per_step_s + self.per_seq_s * batch + self.per_kv_token_s * context

    def kv_fraction(self, rec: IterationRecord) -> float:
        """Measured share of this iteration's time that its K/V reads explain."""
        if self.method == "timers":
            if rec.attention_ns is not None and rec.end_ns > rec.start_ns:
                return min(1.0, rec.attention_ns / (rec.end_ns - rec.start_ns))
            return self.mean_kv_fraction
        ctx = sum(c.context_len for c in rec.chunks if not c.is_prefill)
        total = self.predict(rec.num_decode_tokens, ctx)
        return min(1.0, self.per_kv_token_s * ctx / total) if total > 0 else 0.0

    def describe(self) -> str:
        """Which measurement split the decode time, in words."""
        if self.method == "timers":
            return f"the engine's own kernel timers of {self.num_steps} decode steps (MEASURED)"
        return (f"a fit of {self.num_steps} decode steps' times against batch and history (MEASURED, regression: "
                "no kernel timers in this run)")


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0, for a handful of columns: every subset of free columns (the
    others at 0), the best feasible one."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(b @ b)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (sol < 0).any():
            continue
        x = np.zeros(k)
        x[cols] = sol
        err = float(np.sum((a @ x - b) ** 2))
        if err < best_err:
            best, best_err = x, err
    return best


def _least_absolute(a: np.ndarray, y: np.ndarray, floors: np.ndarray, iterations: int = 40) -> np.ndarray:
    """min sum |a x - y| with x >= floors (iteratively reweighted least squares, each step the
    bounded least squares above). Absolute rather than squared residuals: a burst of load on a
    shared machine slows a run of consecutive steps, which moves a mean but not a median (two
    clusters of steps fit by medians, as a controlled experiment compares them)."""
    b = y - a @ floors
    x = _nonneg_lstsq(a, b)
    eps = 1e-6 * max(float(np.median(np.abs(b))), 1e-12)
    for _ in range(iterations):
        w = 1.0 / np.sqrt(np.maximum(np.abs(b - a @ x), eps))
        nxt = _nonneg_lstsq(a * w[:, None], b * w)
        if np.allclose(nxt, x, rtol=1e-7, atol=0.0):
            x = nxt
            break
        x = nxt
    return x + floors


def _not(reason: str, n: int) -> DecodeAttribution:
    return DecodeAttribution(False, reason, n)


def attribute_decode(steps: list[IterationRecord], bandwidth: float | None, kv_bytes_per_token: float | None,
                     ) -> DecodeAttribution:
    """`steps`: decode-only iterations. `bandwidth`: a MEASURED memory bandwidth (bytes/s) to bound
    the coefficients from below, or None (then only >= 0)."""
    n = len(steps)
    if n < MIN_STEPS:
        return _not(f"only {n} decode-only steps (at least {MIN_STEPS} are needed)", n)
    y = np.array([r.duration_s for r in steps])
    batch = np.array([float(r.num_decode_tokens) for r in steps])
    ctx = np.array([float(sum(c.context_len for c in r.chunks)) for r in steps])
    if np.ptp(ctx) == 0:
        return _not("the history per step never varies", n)
    use_batch = bool(np.ptp(batch) > 0)
    if use_batch and abs(float(np.corrcoef(batch, ctx)[0, 1])) > MAX_COLLINEARITY:
        return _not("the history grows in lockstep with the batch: K/V reads and per-sequence cost are one column", n)
    weight_bytes = float(np.mean([r.modeled.weight_bytes for r in steps]))
    floors = np.zeros(3)
    if bandwidth:
        floors[0] = weight_bytes / bandwidth
        if kv_bytes_per_token:
            floors[2] = kv_bytes_per_token / bandwidth
    cols = [np.ones(n), batch, ctx] if use_batch else [np.ones(n), ctx]
    fl = floors if use_batch else floors[[0, 2]]
    a = np.column_stack(cols)
    x = _least_absolute(a, y, fl)
    resid = y - a @ x
    # a shared machine stalls a step now and then: drop steps beyond 4 robust sigmas, fit again
    mad = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    keep = np.abs(resid) <= 4 * mad if mad > 0 else np.ones(n, dtype=bool)
    if keep.sum() >= MIN_STEPS and not keep.all():
        a, y, ctx, n = a[keep], y[keep], ctx[keep], int(keep.sum())
        x = _least_absolute(a, y, fl)
        resid = y - a @ x
    df = max(1, n - len(cols))
    sigma = math.sqrt(float(resid @ resid) / df)
    try:
        cov = np.linalg.inv(a.T @ a) * sigma**2
        half = t975(df) * np.sqrt(np.maximum(np.diag(cov), 0.0))
    except np.linalg.LinAlgError:
        return _not("the steps do not determine the three costs (singular fit)", n)
    if use_batch:
        (pa, pb, pc), (ha, hb, hc) = x, half
    else:
        (pa, pc), (ha, hc) = x, half
        pb, hb = 0.0, math.inf  # folded into the per-step cost: the batch never changed
    uncertain = hc * float(ctx.mean()) / float(y.mean())
    if uncertain > MAX_KV_UNCERTAINTY:
        return _not(f"the K/V part of a step is known only to +-{uncertain:.0%} of the step (95%): the history "
                    f"varies too little ({float(np.ptp(ctx) / ctx.mean()):.0%} spread) for the noise", n)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(resid @ resid) / ss_tot if ss_tot > 0 else 1.0
    weights = min(pa, floors[0]) if bandwidth else 0.0
    total = float(y.sum())
    kv = pc * float(ctx.sum())
    shares = {"weights": float(weights * n / total), "kv": float(kv / total)}
    shares["overhead"] = max(0.0, 1.0 - shares["weights"] - shares["kv"])
    return DecodeAttribution(True, "", n, float(pa), float(pb), float(pc), (float(ha), float(hb), float(hc)),
                             float(weights), math.sqrt(float(resid @ resid) / n), r2, shares, bool(bandwidth))


TIMED_SHARE = 0.5  # at least this share of a worker's decode steps timed: its split comes from the timers


def timed_attribution(steps: list[IterationRecord]) -> DecodeAttribution:
    """The split the steps' own kernel timers measured: K/V reads = attention, weights = the linear
    layers, overhead = the rest (elementwise kernels, Python, scheduling, sampling, output)."""
    timed = [r for r in steps if r.has_split]
    total_ns = sum(r.end_ns - r.start_ns for r in timed)
    attn = sum(r.attention_ns or 0 for r in timed)
    linear = sum(r.linear_ns or 0 for r in timed)
    ctx = sum(c.context_len for r in timed for c in r.chunks)
    kv = attn / total_ns if total_ns > 0 else 0.0
    shares = {"weights": linear / total_ns if total_ns > 0 else 0.0, "kv": kv}
    shares["overhead"] = max(0.0, 1.0 - shares["weights"] - kv)
    n = len(timed)
    return DecodeAttribution(True, "", n, per_step_s=linear / 1e9 / n if n else 0.0,
                             per_kv_token_s=attn / 1e9 / ctx if ctx else 0.0, ci=(0.0, 0.0, 0.0),
                             weights_s=linear / 1e9 / n if n else 0.0, shares=shares, method="timers",
                             mean_kv_fraction=kv)


def attribute_workers(iterations: list[IterationRecord], bandwidth: float | None) -> dict[str, DecodeAttribution]:
    """One attribution per worker, from its own decode-only iterations (a disaggregated run's
    prefill workers have none and get a 'not separable'): the kernel timers where most of its steps
    carry them, else the regression."""
    by_worker: dict[str, list[IterationRecord]] = {}
    for r in iterations:
        if r.num_prefill_tokens == 0 and r.num_decode_tokens > 0:
            by_worker.setdefault(r.worker, []).append(r)
    out = {}
    for w, steps in by_worker.items():
        if sum(r.has_split for r in steps) >= max(1, TIMED_SHARE * len(steps)):
            out[w] = timed_attribution(steps)
            continue
        ctx = sum(c.context_len for r in steps for c in r.chunks)
        # the floor counts what memory must move: a block several sequences of a step share (a
        # cached prefix) once, not once per reader (a 32-way shared prefix measured 25% below
        # the per-reader floor at 28 GB/s)
        unique = sum(r.modeled.kv_read_bytes - r.modeled.kv_repeat_read_bytes for r in steps)
        kv_per_token = unique / ctx if ctx else None
        out[w] = attribute_decode(steps, bandwidth, kv_per_token)
    return out
