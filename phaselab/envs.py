"""Every PHASELAB_* environment variable phaselab reads: its name, default and meaning, declared once.

The rule: a module reads a PHASELAB_* variable only through the EnvVar declared here
(`envs.KERNELS.off()`, `envs.LINEAR.get()`), and a module that sets one for a child process keys it
by `envs.X.name`; no other module spells such a name in a string (tests/test_envs.py checks it, and
that every name the docs mention is declared here). `python -m phaselab.envs` prints the table.

The variables are the knobs that are not options: switches that turn a native path off for a
comparison or a way out, forced choices of what a start-up probe would measure, and cache places.
Pure Python, no torch: readable before torch loads (the CLI fixes its thread settings first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # what get() returns when the variable is unset or empty
    meaning: str

    def get(self) -> str | None:
        """The value, or the default where the variable is unset or set to the empty string."""
        value = os.environ.get(self.name)
        return self.default if not value else value

    def raw(self) -> str | None:
        """The value as set (an empty string stays empty), None where unset: no default."""
        return os.environ.get(self.name)

    def off(self) -> bool:
        """Whether the variable turns its feature off: its value is "0" (unset or empty: the default)."""
        return self.get() == "0"


# the native kernels: whether they run, how they are built, and on which threads
KERNELS = EnvVar("PHASELAB_KERNELS", "1", "0: the torch fallback everywhere instead of the native kernels")
KERNEL_ISA = EnvVar("PHASELAB_KERNEL_ISA", "native",
                    "the instruction-set level the kernels are built for: native | avx2 | portable")
CACHE_DIR = EnvVar("PHASELAB_CACHE_DIR", None,
                   "where kernel builds and probe results (kernels/) and host ceilings (ceilings/) are cached; "
                   "unset: ~/.cache/phaselab")
POOL = EnvVar("PHASELAB_POOL", "1", "0: the kernels run on OpenMP's team instead of pool.c's workers")
POOL_SPIN_US = EnvVar("PHASELAB_POOL_SPIN_US", "200",
                      "microseconds the pool's workers stay awake after a call before they sleep")

# attention and the decoder layer: each native path's way back to torch's ops
DECODE_ATTN = EnvVar("PHASELAB_DECODE_ATTN", "auto", "the decode attention part kernel: auto | dpbf16 | c")
PREFILL_ATTN = EnvVar("PHASELAB_PREFILL_ATTN", "auto",
                      "the prefill attention path: auto | amx | dpbf16 | avx512 | c | torch")
FUSED_DECODE = EnvVar("PHASELAB_FUSED_DECODE", "1",
                      "0: a decode batch's RoPE, K/V write and attention as separate ops, not one call per layer")
NATIVE_ELEMENTWISE = EnvVar("PHASELAB_NATIVE_ELEMENTWISE", "1",
                            "0: torch's residual add + RMSNorm and SiLU * up instead of elementwise.c")
DECODE_LAYERS = EnvVar("PHASELAB_DECODE_LAYERS", "1",
                       "0: the Python layer loop instead of one native call for a decode-only step")
STEP_TIMERS = EnvVar("PHASELAB_STEP_TIMERS", "1",
                     "0: no attention / linear / elementwise timers inside the native decode call (the split "
                     "iterations.jsonl records)")

# linear layers: each forces what the start-up probe would otherwise measure (unset: measured)
LINEAR = EnvVar("PHASELAB_LINEAR", None, "the linear path: q | bf16 | fp32 | torch (unset: --weights, else the probe)")
BATCHED = EnvVar("PHASELAB_BATCHED", None,
                 "the weight batched rows' GEMM reads: tile (widened per call) | resident (a dense copy)")
NATIVE_ROWS = EnvVar("PHASELAB_NATIVE_ROWS", None,
                     "N: the native kernel runs up to N activation rows, the GEMM above (0: the GEMM from one row)")
ROWS4_MIN = EnvVar("PHASELAB_ROWS4_MIN", None,
                   "N | off, or per format as Q4_0=32,Q8_0=off: the row count from which the kernel reads four "
                   "weight rows per pass")
PREFETCH_BYTES = EnvVar("PHASELAB_PREFETCH_BYTES", None,
                        "N >= 64: how far ahead the Q4_1X kernel prefetches rows (unset: measured at start-up)")
Q4_REPACK = EnvVar("PHASELAB_Q4_REPACK", "1",
                   "0: Q4_1 / Q8_0 weights kept in the file's layout, not re-laid as Q4_1X / Q4_1L / Q8_0L")
AMX = EnvVar("PHASELAB_AMX", "1", "0: no AMX tile products for batched rows even where the CPU has them")

# memory
HUGEPAGES = EnvVar("PHASELAB_HUGEPAGES", "1", "0: weights and KV cache on torch's memory, not on huge pages")

# measurement and diagnosis
CEILINGS_DIR = EnvVar("PHASELAB_CEILINGS_DIR", None,
                      "where measured host ceilings are cached; unset: $PHASELAB_CACHE_DIR/ceilings, else "
                      "${XDG_CACHE_HOME:-~/.cache}/phaselab/ceilings")
ROOFLINE = EnvVar("PHASELAB_ROOFLINE", None,
                  "a benchmarks/roofline.py JSON that diagnose judges runs against (after --roofline)")

# serving
API_KEY = EnvVar("PHASELAB_API_KEY", None, "the key `phaselab serve` requires when --api-key is not given")
WORKER = EnvVar("PHASELAB_WORKER", None,
                "set, not read: the name of a disaggregated worker's process (prefill-0), for ps e and "
                "/proc/PID/environ")

# the test suite
TEST_DTYPE = EnvVar("PHASELAB_TEST_DTYPE", None,
                    "tests: the dtype workload tests serve in, float32 | bfloat16 (unset: by the CPU's flags)")

ALL: tuple[EnvVar, ...] = (
    KERNELS, KERNEL_ISA, CACHE_DIR, POOL, POOL_SPIN_US,
    DECODE_ATTN, PREFILL_ATTN, FUSED_DECODE, NATIVE_ELEMENTWISE, DECODE_LAYERS, STEP_TIMERS,
    LINEAR, BATCHED, NATIVE_ROWS, ROWS4_MIN, PREFETCH_BYTES, Q4_REPACK, AMX,
    HUGEPAGES,
    CEILINGS_DIR, ROOFLINE,
    API_KEY, WORKER,
    TEST_DTYPE,
)


def table() -> str:
    """ALL as a plain text table: name, default ("-" where none), meaning."""
    rows = [("name", "default", "meaning")] + [(v.name, v.default or "-", v.meaning) for v in ALL]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{n:<{width[0]}}  {d:<{width[1]}}  {m}".rstrip() for n, d, m in rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
