"""`phaselab plan --verify` (issue 17): the planned configurations run for real on this machine,
predicted next to measured. The truth of the measured column is the real runs' own request records
(requests.jsonl of each run directory), counted here from their raw timestamps; how close the
prediction comes is the benchmark's business (a loaded machine moves it), not this test's: here,
that the table and the exit code say what the numbers are, and that each configuration ran as many
times as asked, its median run counting."""

from __future__ import annotations

import json
import statistics

import pytest

from phaselab.cli import main

TTFT_S, TBT_S = 3.0, 0.5


def _count(path):
    """Requests meeting both SLOs and the run's span, from the record's raw stamps: TTFT = first
    token sent - arrival, TPOT = first to last token sent over the gaps between them."""
    reqs = [json.loads(line) for line in open(path, encoding="utf-8")]
    good = 0
    for r in reqs:
        sent = r["token_sent_ns"]
        if r["finish_reason"] not in ("stop", "length") or not sent:
            continue
        ttft = (sent[0] - r["arrived_ns"]) / 1e9
        tpot = (sent[-1] - sent[0]) / 1e9 / (len(sent) - 1) if len(sent) > 1 else 0.0
        good += ttft <= TTFT_S and tpot <= TBT_S
    span = (max(r["finished_ns"] for r in reqs) - min(r["arrived_ns"] for r in reqs)) / 1e9
    return len(reqs), good, span


@pytest.mark.timeout(300)
def test_plan_verify_runs_the_plan_and_reports_measured_next_to_predicted(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--hardware", "cpu", "--slo-ttft-ms", str(TTFT_S * 1e3), "--slo-tbt-ms", str(TBT_S * 1e3),
                 "--num-prompts", "6", "--input-len", "uniform:16:32", "--output-len", "uniform:3:5",
                 "--budgets", "32", "--max-num-seqs", "8", "--bisections", "1", "--verify", "--verify-top", "2",
                 "--verify-runs", "3", "--verify-dir", str(tmp_path / "runs"), "--result-json", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())["verify"]
    rows = result["rows"]
    assert len(rows) == 2 and result["cpu"]  # the results name the CPU they were measured on
    # the calibration is bounded by this host's ceilings, measured in this run, not the catalog's `cpu`
    # entry (another session's CPU): the hardware it names is the measured one, with its CPU
    hw = result["hardware"]
    assert hw["name"] == "measured-cpu" and hw["peak_flops"] > 0 and hw["mem_bandwidth"] > 0
    assert hw["sources"]["peak_flops"].startswith("measured: phaselab.engine.ceilings on ")
    assert result["cpu"].split()[0] in hw["sources"]["peak_flops"]
    for i, row in enumerate(rows, start=1):
        counts = [_count(tmp_path / "runs" / f"rank-{i}" / f"run-{j}" / "requests.jsonl") for j in (1, 2, 3)]
        assert [n for n, _, _ in counts] == [row["num_requests"]] * 3 == [6] * 3  # every planned request ran, 3 times
        assert [r["attainment"] for r in row["runs"]] == pytest.approx([good / n for n, good, _ in counts])
        assert [r["goodput"] for r in row["runs"]] == pytest.approx([good / span for _, good, span in counts], rel=1e-9)
        assert row["attainment_measured"] == pytest.approx(statistics.median(good / n for n, good, _ in counts))
        assert row["goodput_measured"] == pytest.approx(statistics.median(good / span for _, good, span in counts),
                                                        rel=1e-9)
        error = (row["goodput_measured"] - row["goodput_predicted"]) / row["goodput_predicted"]
        assert row["within_tolerance"] == (abs(error) <= 0.2)
        assert row["configuration"] in text
    assert "goodput pred" in text and "goodput meas" in text and "runs (median above)" in text
    if all(r["within_tolerance"] for r in rows):
        assert code == 0 and "verify passed" in text
    else:
        assert code == 3 and "VERIFY FAILED" in text


def test_plan_verify_rejects_zero_runs_before_loading_anything(capsys):
    code = main(["plan", "--hardware", "cpu", "--slo-ttft-ms", "1000", "--slo-tbt-ms", "100", "--verify",
                 "--verify-runs", "0"])
    err = capsys.readouterr().err
    assert code != 0 and "--verify-runs must be >= 1 (got 0)" in err
    assert "loading the bundled model" not in err
