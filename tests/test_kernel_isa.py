"""Every instruction-set path of the native kernels, on whatever CPU runs the suite.

The kernels are compiled with -march=native, so a machine exercises only its own best path: an
AVX-512 machine never runs the AVX2 loops that an AMD Zen 3 serves with, and neither runs the
portable C. PHASELAB_KERNEL_ISA builds the lower paths on any CPU that has their instructions;
here each one runs the kernels' reference tests (float64 matmuls, torch's attention and
elementwise ops) in a fresh process (a process loads its kernel library once). A path is skipped
only when this CPU lacks its instructions, and says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phaselab import envs
from phaselab.model import kernels
from phaselab.model.kernels import build, qlinear

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/test_qlinear.py", "tests/test_kernels.py", "tests/test_elementwise.py",
                "tests/test_attention_prefill.py"]


def _cpu_has(*flags: str) -> bool:
    have = set(build.cpu_flags().split())
    return all(f in have for f in flags)


def test_built_for_the_requested_isa():
    """What this process's kernel reports matches what it was asked to build (and the CPU)."""
    if not qlinear.available():
        pytest.skip(f"native kernel unavailable: {qlinear.unavailable_reason()}")
    isa, f = kernels.kernel_isa(), qlinear.features()
    if isa == "portable":
        assert not (f["avx512"] or f["avx2"] or f["avx512_bf16_dot"]), f
    elif isa == "avx2":
        assert f["avx2"] and not f["avx512"], f
    else:
        assert f["avx512"] == _cpu_has("avx512f", "avx512bw"), f
        assert f["avx2"] == (not f["avx512"] and _cpu_has("avx2", "fma", "f16c")), f


def test_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv(envs.KERNEL_ISA.name, "sse9")
    with pytest.raises(ValueError, match="PHASELAB_KERNEL_ISA"):
        kernels.kernel_isa()


@pytest.mark.slow
@pytest.mark.parametrize(("isa", "needs"), [("avx2", ("avx2", "fma", "f16c")), ("portable", ())])
def test_kernel_reference_tests_pass_on_each_isa(isa, needs):
    if not _cpu_has(*needs):
        pytest.skip(f"this CPU lacks {', '.join(needs)}: the {isa} path cannot run here")
    env = {**os.environ, envs.KERNEL_ISA.name: isa}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                           *KERNEL_TESTS, "tests/test_kernel_isa.py::test_built_for_the_requested_isa"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"{envs.KERNEL_ISA.name}={isa}: the kernel tests failed:\n{tail}"
    assert " passed" in tail and "error" not in tail.lower().split("passed")[-1], tail
