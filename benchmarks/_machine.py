"""What the benchmarks record about the machine they ran on (every results file names its CPU)."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """/proc/cpuinfo's model name; else platform.processor(), else "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
