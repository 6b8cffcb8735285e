"""`phaselab compare --quick` end to end, and its HTML pages in a real browser.

The compare runs once per module in a subprocess (it starts Ray for the disaggregated run); the
browser checks open report.html, timeline.html and one diagnosis.html in headless Chromium
(Debian's package, installed here when absent: `apt-get update && apt-get install -y chromium`,
which needs root; no skip: a missing browser fails with the reason). A page passes when its
scripts ran (the timelines mark themselves data-rendered="yes" and count the shapes they drew), the
console shows no error, the page's own error trap (<pre id="js-errors">) stayed empty, and the
tables are there. Screenshots are kept in tests/artifacts/ (ignored by git: the directory carries a
.gitignore of its own).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ARTIFACTS = Path(__file__).parent / "artifacts"
# --quick: budgets L/2 and L/8 of 768-token prompts, and the adaptive budget at its default target
CONFIG_DIRS = ("prefill-first", "chunked-384", "chunked-96", "adaptive-200ms")
RUN_FILES = ("config.json", "requests.jsonl", "iterations.jsonl", "trace.json",
             "diagnosis.md", "diagnosis.html", "diagnosis.json")


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "quick"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-m", "phaselab.experiments.compare_cli", "compare", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, f"compare --quick failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return out, r.stdout, r.stderr


def _disagg_usable() -> bool:
    from phaselab.experiments.compare import disagg_available

    return disagg_available()[0]


def test_compare_quick_writes_every_promised_file(compare_run):
    out, stdout, stderr = compare_run
    for name in ("report.html", "summary.md", "summary.txt", "summary.json", "timeline.png", "timeline.html"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    configs = list(CONFIG_DIRS) + (["disagg-1p1d"] if _disagg_usable() else [])
    for workload in ("interference", "sweep"):
        for c in configs:
            run = out / f"{workload}-{c}"
            for f in RUN_FILES:
                assert (run / f).is_file(), run / f
    summary = json.loads((out / "summary.json").read_text())
    assert [c["name"] for c in summary["configs"]] == configs
    for c in summary["configs"]:
        for w in ("interference", "sweep"):
            assert c["workloads"][w]["top"]["cause"]
            assert sum(c["workloads"][w]["time_shares"].values()) == pytest.approx(1.0)
    if not _disagg_usable():
        assert any("disaggregated 1P1D left out" in n for n in summary["notes"])
    # the side-by-side table and the top diagnosis of each, on the terminal; progress on stderr
    assert "interference: side by side" in stdout and "sweep: side by side" in stdout
    for label in ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "max stall", "output throughput",
                  "KV transferred", "KV transfer bandwidth", "busy fraction", "top cause"):
        assert label in stdout, label
    assert "top diagnosis of each" in stdout and "worked if" in stdout
    assert "loading the bundled model" in stderr and "done in" in stderr
    print(f"compare --quick wall time: {summary['wall_s']:.1f} s")


def test_prefill_first_interference_stalls_the_streams(compare_run):
    """The point of the interference workload: prefill-first freezes the streams for a whole long
    prefill; a smaller chunk budget shortens the longest gap."""
    out, _, _ = compare_run
    summary = {c["name"]: c for c in json.loads((out / "summary.json").read_text())["configs"]}
    pf = summary["prefill-first"]["workloads"]["interference"]
    small = summary["chunked-96"]["workloads"]["interference"]
    assert pf["top"]["cause"] == "stall"
    assert small["summary"]["max_stall_s"] < pf["summary"]["max_stall_s"]


def test_compare_shows_predicted_vs_measured(compare_run):
    """Each fixed-budget chunked configuration is predicted from the prefill-first run and set against
    its own run: on the terminal and in summary.json, with both sides of every figure. Chunking
    shortens the streams' longest gap: predicted and measured alike (the measured one from the runs'
    own records, the predicted one from the simulation)."""
    out, stdout, _ = compare_run
    data = json.loads((out / "summary.json").read_text())
    preds = {p["config"]: p for p in data["predictions"] if p["workload"] == "interference"}
    assert set(preds) == {"chunked-384", "chunked-96"}, data.get("prediction_notes")
    assert "predicted vs measured, from the prefill-first run" in stdout
    runs = {c["name"]: c["workloads"]["interference"]["summary"] for c in data["configs"]}
    for name, p in preds.items():
        assert p["flags"] == f"--policy chunked --max-num-batched-tokens {name.split('-')[1]}"
        itl = p["figures"]["itl_p99_s"]
        assert itl["predicted_change"] < 0 and itl["measured_change"] < 0, (name, itl)
        # the measured side is the configuration's own run, the baseline the prefill-first run's
        assert itl["measured"] == pytest.approx(runs[name]["itl_p99_s"], rel=1e-6)
        assert itl["baseline"] == pytest.approx(runs["prefill-first"]["itl_p99_s"], rel=1e-6)
        print(f"{name}: ITL p99 predicted {itl['predicted_change']:+.0%}, measured {itl['measured_change']:+.0%}")


# -- the browser ------------------------------------------------------------------------------------------------
def ensure_chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    if shutil.which("apt-get") is None:
        pytest.fail("chromium is not installed and apt-get is not available to install it (Debian's `chromium` "
                    "package is needed for the browser check of the HTML report)")
    if os.geteuid() != 0:
        pytest.fail("chromium is not installed and installing it needs root: run `apt-get update && apt-get install "
                    "-y chromium` as root, then rerun")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"])
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
        if r.returncode != 0:
            pytest.fail(f"installing Debian's chromium failed at `{' '.join(cmd)}` (exit {r.returncode}):\n"
                        f"{(r.stdout + r.stderr)[-3000:]}")
    path = shutil.which("chromium")
    if not path:
        pytest.fail("`apt-get install chromium` succeeded but no chromium binary is on PATH")
    return path


def headless(chromium: str, page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000",
               *extra, page.resolve().as_uri()]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def console_errors(stderr: str) -> list[str]:
    lines = [x for x in stderr.splitlines() if ":CONSOLE" in x]
    return [x for x in lines if re.search(r"Uncaught|Error|error", x.split("]", 1)[-1])]


def check_page(chromium: str, page: Path, shot: str, width: int = 1400, height: int = 2400) -> str:
    dom_run = headless(chromium, page, "--dump-dom")
    assert dom_run.returncode == 0, dom_run.stderr[-3000:]
    dom = dom_run.stdout
    errors = console_errors(dom_run.stderr)
    assert not errors, "JavaScript errors in the console:\n" + "\n".join(errors)
    trap = re.search(r'<pre id="js-errors"[^>]*>(.*?)</pre>', dom, re.S)
    assert trap is not None and trap.group(1).strip() == "", f"the page's error trap caught: {trap and trap.group(1)}"
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")
    target = ARTIFACTS / shot
    shot_run = headless(chromium, page, f"--screenshot={target}", f"--window-size={width},{height}",
                        "--hide-scrollbars")
    assert shot_run.returncode == 0, shot_run.stderr[-3000:]
    assert target.is_file() and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return dom


def _rendered_timelines(dom: str) -> list[int]:
    """Shape counts of every timeline root that its script finished drawing."""
    roots = re.findall(r'<div id="[^"]+" class="tl-root"[^>]*>', dom)
    shapes = []
    for tag in roots:
        assert 'data-rendered="yes"' in tag, f"a timeline did not render: {tag}"
        shapes.append(int(re.search(r'data-shapes="(\d+)"', tag).group(1)))  # type: ignore[union-attr]
    return shapes


def test_report_renders_in_a_browser(compare_run):
    chromium = ensure_chromium()
    out, _, _ = compare_run
    dom = check_page(chromium, out / "report.html", "compare-report.png")
    shapes = _rendered_timelines(dom)
    assert len(shapes) == 1 and shapes[0] > 50  # one shared-axis timeline of every configuration
    assert dom.count('<table class="compare">') == 2  # interference and sweep, side by side
    assert dom.count("<svg") >= 1 and 'class="tl-stall"' in dom  # prefill-first's stalls are drawn
    assert 'id="timeline-png"' in dom and "data:image/png;base64," in dom
    for label in ("prefill-first (unchunked)", "chunked, budget 384", "chunked, budget 96", "top diagnosis of each"):
        assert label in dom


def test_timeline_and_diagnosis_pages_render_in_a_browser(compare_run):
    chromium = ensure_chromium()
    out, _, _ = compare_run
    dom = check_page(chromium, out / "timeline.html", "compare-timeline.png", height=1400)
    assert _rendered_timelines(dom)[0] > 50
    dom = check_page(chromium, out / "interference-prefill-first" / "diagnosis.html", "diagnosis.png", height=2000)
    assert "Ranked causes" in dom and '<table class="ranking">' in dom and "Worked if:" in dom
