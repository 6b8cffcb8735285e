"""core/ and cost/ type-check under `mypy --strict` (issues 14 and 33): the pure-Python contract
between the scheduler, the runner, the simulator and the workers is typed, so is the cost package
the scheduler prices with (its Protocols in cost/shapes.py are checked against core's classes where
core passes them in), and the README's test command (which CI runs) checks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_and_cost_pass_mypy_strict() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "phaselab/core", "phaselab/cost"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert "No module named mypy" not in r.stderr, "mypy is missing: pip install -e '.[test]' (it is a test extra)"
    assert r.returncode == 0, f"mypy --strict phaselab/core phaselab/cost failed; fix the types it names:\n{r.stdout}{r.stderr}"
