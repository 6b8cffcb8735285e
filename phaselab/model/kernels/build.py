"""Building the native kernels: the compiler, its flags per instruction-set level, and a cache of
builds keyed by what decides them.

Builds live under `$PHASELAB_CACHE_DIR` (default `~/.cache/phaselab`) in `kernels/`, keyed by the
sources' hash, the compiler, the flags and the CPU's flags; concurrent processes (disaggregated
workers) race safely: each compiles to a private temp file, then renames it into place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from phaselab import envs

# The parts of -ffast-math that let the compiler vectorize the reductions, spelled out: -ffast-math
# itself (like -Ofast and -funsafe-math-optimizations) makes gcc link crtfastmath.o into the shared
# object, whose constructor sets flush-to-zero / denormals-are-zero for the WHOLE process on load,
# changing torch's and numpy's arithmetic too (tests/test_kernels.py checks that loading keeps them).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC", "-mprefer-vector-width=512"]
# PHASELAB_KERNEL_ISA: "native" (default) builds for this CPU's best instruction set; "avx2" and
# "portable" leave out AVX-512 (and, for portable, AVX2/FMA/F16C too) so that tests and benchmarks
# run the lower paths of every kernel on any CPU that has them
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"]}


def cache_dir() -> Path:
    root = envs.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "phaselab")
    return Path(root) / "kernels"


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def kernel_isa() -> str:
    """The instruction-set level the kernels are built for (envs.KERNEL_ISA; "native" unless forced)."""
    isa = envs.KERNEL_ISA.raw()
    if isa is None:  # unset: the default; set but empty is an error, as any other unknown level
        isa = str(envs.KERNEL_ISA.default)
    if isa not in ISA_FLAGS:
        raise ValueError(f"{envs.KERNEL_ISA.name}={isa!r}: use one of {', '.join(ISA_FLAGS)}")
    return isa


def flags() -> list[str]:
    return [*FLAGS, *ISA_FLAGS[kernel_isa()]]


def build_key(source: Path | tuple[Path, ...], cc: str) -> str:
    """Hash of what decides a build: the sources, the compiler, the flags and the CPU's features."""
    src = b"".join(p.read_bytes() for p in (source if isinstance(source, tuple) else (source,)))
    return hashlib.sha256(src + cc.encode() + " ".join(flags()).encode() + cpu_flags().encode()).hexdigest()[:16]


def build(cc: str, source: Path | tuple[Path, ...], name: str | None = None) -> Path:
    """Compile `source` (one file, or several linked into one library; headers listed for the
    build key only) once per build key, into `name`-<key>.so (name: the first source's)."""
    sources = tuple(p for p in (source if isinstance(source, tuple) else (source,)) if p.suffix == ".c")
    out = cache_dir() / f"{name or sources[0].stem}-{build_key(source, cc)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags(), "-o", tmp, *map(str, sources), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            names = " ".join(p.name for p in sources)
            raise RuntimeError(f"{cc} failed on {names}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key yields the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
