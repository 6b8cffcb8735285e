"""The README's table of line counts per package is docs/linecount.py's output (so it cannot go
stale), and the script counts lines as `wc -l` does."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("linecount", ROOT / "docs" / "linecount.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_table_is_the_scripts_output() -> None:
    lc = _script()
    shown = lc.readme_table((ROOT / "README.md").read_text(encoding="utf-8"))
    assert shown is not None, "README.md lost its linecount markers; see docs/linecount.py"
    assert shown == lc.table(), "README.md's line counts are stale: run `python docs/linecount.py --write`"


def test_counts_agree_with_wc() -> None:
    lc = _script()
    files = sorted(str(p) for p in (ROOT / "phaselab").rglob("*.py"))
    wc = subprocess.run(["wc", "-l", *files], capture_output=True, text=True, check=True).stdout.splitlines()
    total_wc = int(wc[-1].split()[0])
    assert sum(r[2] for r in lc.count()) == total_wc


MODULE_CAP = 500  # README: "no module may exceed 500 lines" (issue 33: split by seams, not at the cap)


def test_no_module_exceeds_the_cap() -> None:
    """Counted as `wc -l` counts, independently of the script: every module under phaselab/ stays
    within the cap the README states."""
    assert f"no module may exceed {MODULE_CAP} lines" in (ROOT / "README.md").read_text(encoding="utf-8")
    over = {}
    for p in sorted((ROOT / "phaselab").rglob("*.py")):
        with open(p, "rb") as f:
            n = f.read().count(b"\n")
        if n > MODULE_CAP:
            over[str(p.relative_to(ROOT))] = n
    assert not over, f"modules over {MODULE_CAP} lines (split them at a seam, docs/design.md): {over}"
