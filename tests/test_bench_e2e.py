"""End to end: `phaselab bench` against `phaselab serve` on the bundled model (issue 6's acceptance).

A `random` and an `interference` run complete; for the same request ids the client's TTFT is at
least the server's (the client's clock starts earlier and stops later); token counts agree.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    record = tmp_path_factory.mktemp("server-run")
    port = _free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaselab", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--record", str(record), "--max-model-len", "2048"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"phaselab serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"phaselab serve not healthy after {STARTUP_TIMEOUT_S} s")
            time.sleep(0.5)
        yield base, proc, record
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _server_requests(base: str, proc: subprocess.Popen, record: Path) -> list:
    """The server's phase record: flushed on request, else written when it shuts down."""
    from phaselab.obs.rundir import read_run_dir

    flushed = httpx.post(base + "/record/flush", timeout=60).status_code == 200
    if not flushed:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return read_run_dir(record).requests


def _bench(base: str, *args: str) -> int:
    from phaselab.bench.bench_cli import main

    return main(["bench", "--base-url", base, "--disable-progress", *args])


def test_bench_against_phaselab_serve(server, tmp_path):
    base, proc, record = server
    rc = _bench(base, "--workload", "random", "--endpoint", "completions", "--num-prompts", "4",
                "--input-len", "uniform:16:64", "--output-len", "8", "--ignore-eos", "--concurrency", "2",
                "--num-warmups", "1", "--record", str(tmp_path / "random"), "--scrape-metrics")
    assert rc == 0
    rc = _bench(base, "--workload", "interference", "--num-streams", "2", "--stream-input-len", "40",
                "--stream-output-len", "24", "--ignore-eos", "--num-long-prompts", "1", "--long-input-len", "400",
                "--long-output-len", "2", "--long-start", "0.5", "--record", str(tmp_path / "interference"))
    assert rc == 0

    random_result = json.loads((tmp_path / "random" / "result.json").read_text())
    assert random_result["completed"] == 4 and random_result["failed"] == 0
    assert random_result["output_lens"] == [8] * 4 and random_result["output_tokens_from_usage"] == 4
    assert random_result["input_len_mismatches"] == 0
    assert random_result["server_metrics_diff"]["counters"]
    inter_result = json.loads((tmp_path / "interference" / "result.json").read_text())
    assert inter_result["completed"] == 3 and inter_result["input_len_mismatches"] == 0
    assert inter_result["interference"]["long_prompts"][0]["status"] == "ok"

    client = [json.loads(x) for d in ("random", "interference")
              for x in (tmp_path / d / "requests.jsonl").read_text().splitlines()]
    server_reqs = _server_requests(base, proc, record)

    def match(c: dict):
        ids = {c["request_id"], c.get("server_request_id")}
        hits = [s for s in server_reqs if s.request_id in ids
                or any(i and (i in s.request_id or s.request_id in i) for i in ids)]
        assert len(hits) == 1, f"{c['request_id']}: {len(hits)} server records match"
        return hits[0]

    for c in client:
        s = match(c)
        assert c["ttft_s"] >= s.ttft_s
        assert c["num_output_tokens"] == s.num_output_tokens == c["max_tokens"]
        assert c["num_prompt_tokens"] == s.num_prompt_tokens == c["num_prompt_tokens_requested"]
