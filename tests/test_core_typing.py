"""core/ type-checks under `mypy --strict` (issue 14): the pure-Python contract between the
scheduler, the runner, the simulator and the workers is typed, and the README's test command (which
CI runs) checks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_passes_mypy_strict() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "phaselab/core"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert "No module named mypy" not in r.stderr, "mypy is missing: pip install -e '.[test]' (it is a test extra)"
    assert r.returncode == 0, f"mypy --strict phaselab/core failed; fix the types it names:\n{r.stdout}{r.stderr}"
