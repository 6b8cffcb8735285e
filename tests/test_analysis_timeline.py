"""Timelines from synthetic run directories: the lanes, the PNG, the self-contained HTML page, the CLI."""

from __future__ import annotations

import json
import re

import pytest

from phaselab.analysis.timeline import build_timeline, load_timeline, render_png, render_timeline_page, write_timeline
from phaselab.obs.rundir import write_run_dir
from tests.test_analysis_accounting import disagg_run, stall_run


@pytest.fixture
def two_runs(tmp_path):
    a, b = stall_run(), disagg_run()
    write_run_dir(tmp_path / "a", a.requests, a.iterations, a.config)
    write_run_dir(tmp_path / "b", b.requests, b.iterations, b.config)
    return tmp_path / "a", tmp_path / "b"


def test_lanes_and_marks() -> None:
    t = build_timeline(stall_run(), "stall")
    assert [w["name"] for w in t["workers"]] == ["engine-0"]
    assert len(t["workers"][0]["iters"]) == len(stall_run().iterations)
    assert [r["id"] for r in t["requests"]][:4] == [f"stream-{i}" for i in range(4)]
    streams = [r for r in t["requests"] if r["id"].startswith("stream")]
    for r in streams:  # every stream's stall is marked, with the request that caused it
        assert any(s[3] == 1 and "long-0" in s[4] for s in r["stalls"])
        assert len(r["tokens"]) == r["out"]
    long = next(r for r in t["requests"] if r["id"] == "long-0")
    assert len(long["chunks"]) == 1 and long["chunks"][0][2] == 800
    assert t["end"] > 0 and t["t0_ns"] == 0


def test_disagg_lanes_show_the_transfer() -> None:
    t = build_timeline(disagg_run(), "disagg")
    assert [(w["name"], w["role"]) for w in t["workers"]] == [("p0", "prefill"), ("d0", "decode")]
    for r in t["requests"]:
        q, start, end, admitted, nbytes = r["transfer"]
        assert q <= start < end <= admitted and nbytes > 0


def test_png_and_html_of_two_runs_on_one_axis(two_runs, tmp_path) -> None:
    png, page = write_timeline(list(two_runs), tmp_path / "t.png", tmp_path / "t.html", ["prefill-first", "disagg"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>")
    # self-contained: no external script, stylesheet or image
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="https?:', text)
    data = json.loads(re.search(r'<script type="application/json" id="timeline-data">(.*?)</script>',
                                text, re.S).group(1))  # type: ignore[union-attr]
    assert [d["title"] for d in data] == ["prefill-first", "disagg"]
    assert "phaselabTimeline(" in text


def test_many_requests_are_capped(tmp_path) -> None:
    from tests.test_analysis_accounting import Req, SynthEngine

    run = SynthEngine(max_num_seqs=8).run_data([Req(f"r{i}", i, 16, 2) for i in range(150)])
    t = build_timeline(run, "many")
    assert len(t["requests"]) == 120 and t["omitted_requests"] == 30
    assert render_png([t], tmp_path / "many.png").stat().st_size > 5000
    assert 'class="tl-root"' in render_timeline_page([t])


def test_timeline_cli(two_runs) -> None:
    from phaselab.analysis.diagnose_cli import main

    a, b = two_runs
    assert main(["timeline", str(a), str(b)]) == 0
    assert (a / "timeline.png").is_file() and (a / "timeline.html").is_file()
    assert load_timeline(a)["title"].startswith("a (prefill-first")
    assert main(["timeline", str(a), "--title", "only one", "--title", "two", "--title", "three"]) == 2
