"""Diagnosing another server from a real `phaselab bench --record` client run directory: the bench
drives the tests' fake OpenAI server (tests/_bench_fake_server.py), whose long prompts hold every
other stream while they wait for their first token (a prefill-first server, emulated). The
diagnosis reads the client run directory exactly as the bench wrote it."""

from __future__ import annotations

import json

import pytest

from phaselab.analysis.diagnose import diagnose, diagnosis_text, write_diagnosis
from tests._bench_fake_server import FakeOpenAIServer, Script

LONG_WAIT_S = 1.5


def _script(body: dict) -> Script:
    if len(str(body.get("prompt", ""))) > 1000:  # a long prompt: its "prefill" freezes the other streams
        return Script(first_delay_s=LONG_WAIT_S, gaps_s=[0.01], prefill_blocks_others=True)
    return Script(first_delay_s=0.02, gaps_s=[0.02] * 30)


def test_bench_client_run_of_an_interfering_server(tmp_path) -> None:
    from phaselab.bench.bench_cli import main

    with FakeOpenAIServer(_script) as srv:
        rc = main(["bench", "--base-url", srv.base_url, "--disable-progress", "--endpoint", "completions",
                   "--workload", "interference", "--num-streams", "3", "--stream-input-len", "16",
                   "--stream-output-len", "31", "--num-long-prompts", "1", "--long-input-len", "600",
                   "--long-output-len", "2", "--long-start", "0.2", "--record", str(tmp_path / "client"),
                   "--scrape-metrics"])
    assert rc == 0
    assert json.loads((tmp_path / "client" / "config.json").read_text())["source"] == "client"
    d = diagnose(tmp_path / "client")
    assert d.source == "client"
    assert d.top is not None and d.top.cause == "stall", d.account.shares
    # the longest stall is the long prompt's wait, as the client saw the streams' gaps
    assert d.top.key.value == pytest.approx(LONG_WAIT_S, rel=0.15)
    assert any("req-long-0" in g.culprits for g in d.stalls.gaps)
    assert "vLLM" in d.top.change or "chunk" in d.top.change
    assert any("no /metrics" in n for n in d.notes)  # the fake server exports neither phaselab's nor vLLM's names
    files = write_diagnosis(d, tmp_path / "client")
    assert files["html"].is_file()
    assert "requests waiting for their first token during the stalls" in diagnosis_text(d)
