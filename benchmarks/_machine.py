"""What the benchmarks record about the machine they ran on (every results file names its CPU),
and how they write their results files."""

from __future__ import annotations

import json
import os
import platform
from typing import Any


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


def write_json(path: str, obj: Any, indent: int = 1) -> None:
    """A benchmark's results file: `obj` as JSON at `path`, its folder made if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
