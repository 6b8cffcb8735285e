"""The bench against a fake OpenAI server with scripted delays (tests/_bench_fake_server.py).

The client's numbers are held against the script and against the server's own log of when it
wrote each event (same clock: time.monotonic_ns). The timing checks are tight (5 ms of delivery
on 127.0.0.1); a run on a machine too busy to meet them is repeated, up to ATTEMPTS times.

The fake server is a thread of this process, so every hand-off between it and the client waits
for the GIL: with CPython's default switch interval (5 ms) a hand-off alone can use the whole
delivery bound (CI once saw a request reach the server 6.41 ms after send, three times running).
The `_quick_gil_handoff` fixture shortens the interval for these tests, so what is measured is
the delivery on 127.0.0.1, not the interpreter's time slice.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import pytest

from phaselab.bench.sender import drive
from phaselab.workload.arrivals import ArrivalPlan
from phaselab.bench.bench_cli import main as bench_main
from phaselab.bench.client import ClientConfig, RequestRecord, RequestSpec, StreamingClient, new_record
from phaselab.bench.client_metrics import RequestResult, derive, summarize
from tests._bench_fake_server import FakeOpenAIServer, Script, ServedRequest

DELIVERY_S = 0.005  # server write -> client stamp, on 127.0.0.1
# client send stamp -> server stamp: the same hop, plus httpx building the request and checking a
# connection out of its pool (about 1 ms here, more on a slower CI machine)
SEND_S = 0.015
SLEEP_OVERSHOOT_S = 0.025  # asyncio.sleep on a loaded 2-core machine
ATTEMPTS = 5  # timing checks: a run on a machine too busy to meet them is repeated


@pytest.fixture(autouse=True)
def _quick_gil_handoff():
    """Server thread and client share the GIL: hand it over every 0.2 ms, not every 5 ms."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    yield
    sys.setswitchinterval(before)


async def _send_warm(base_url: str, specs: list[RequestSpec], endpoint: str = "chat") -> list[RequestRecord]:
    """One throwaway request opens the connection, then `specs` one by one on the warm pool."""
    async with StreamingClient(ClientConfig(base_url=base_url, model="fake-model", endpoint=endpoint)) as client:
        warm = RequestSpec("warm", "hi", 1)
        await client.send(warm, new_record(warm, time.monotonic_ns()))
        out = []
        for spec in specs:
            rec = new_record(spec, time.monotonic_ns())
            out.append(await client.send(spec, rec))
        return out


def _timing_errors(m: RequestResult, rec: RequestRecord, served: ServedRequest, script: Script) -> list[str]:
    """Where the client's numbers differ from what the server did (by more than the delivery on
    127.0.0.1), or the server from its script (by more than a sleep's overshoot)."""
    errors = []
    write_ns = served.token_write_ns
    if len(m.token_ns) != len(write_ns):
        return [f"{len(m.token_ns)} content chunks received, {len(write_ns)} sent"]
    for i, (got, sent) in enumerate(zip(m.token_ns, write_ns)):
        if not 0 <= (got - sent) / 1e9 < DELIVERY_S:
            errors.append(f"token {i}: received {(got - sent) / 1e6:.2f} ms after it was written")
    if not 0 <= (served.received_ns - rec.sent_ns) / 1e9 < SEND_S:
        errors.append(f"request reached the server {(served.received_ns - rec.sent_ns) / 1e6:.2f} ms after send")
    if m.ttft_s is not None and not 0 <= m.ttft_s - (write_ns[0] - rec.sent_ns) / 1e9 < DELIVERY_S:
        errors.append(f"TTFT {m.ttft_s * 1e3:.2f} ms vs first token written at {(write_ns[0] - rec.sent_ns) / 1e6:.2f} ms")
    server_gaps = [(b - a) / 1e9 for a, b in zip(write_ns, write_ns[1:])]
    for i, (got, sent) in enumerate(zip(m.itl_s, server_gaps)):
        if abs(got - sent) >= DELIVERY_S:
            errors.append(f"gap {i}: {got * 1e3:.2f} ms received vs {sent * 1e3:.2f} ms written")
    first_wait = (write_ns[0] - served.received_ns) / 1e9
    for what, got, want in [("first token", first_wait, script.first_delay_s),
                            *((f"gap {i}", g, w) for i, (g, w) in enumerate(zip(server_gaps, script.gaps_s)))]:
        if not want - 0.001 <= got <= want + SLEEP_OVERSHOOT_S:
            errors.append(f"server: {what} after {got * 1e3:.2f} ms, scripted {want * 1e3:.0f} ms")
    return errors


def test_ttft_itl_and_stall_are_the_scripted_ones():
    gaps = [0.03, 0.03, 0.03, 0.25, 0.03, 0.03]
    script = Script(first_delay_s=0.12, gaps_s=gaps)
    for attempt in range(ATTEMPTS):
        with FakeOpenAIServer(script) as srv:
            (rec,) = asyncio.run(_send_warm(srv.base_url, [RequestSpec("r1", "hello", 7)]))
            served = srv.served[-1]
        m = derive(rec, rec.scheduled_ns, stall_factor=3.0)
        assert m.status == "ok" and m.output_tokens_source == "usage" and m.num_output_tokens == 7
        errors = _timing_errors(m, rec, served, script)
        # so TTFT is the scripted wait plus only the request's trip on a warm connection, and the
        # gaps are the scripted ones, each within DELIVERY_S + SLEEP_OVERSHOOT_S
        if not script.first_delay_s - 0.001 <= m.ttft_s <= script.first_delay_s + SLEEP_OVERSHOOT_S + 2 * DELIVERY_S:
            errors.append(f"TTFT {m.ttft_s * 1e3:.2f} ms, scripted {script.first_delay_s * 1e3:.0f} ms")
        if m.itl_s != pytest.approx(gaps, abs=SLEEP_OVERSHOOT_S + DELIVERY_S):
            errors.append(f"gaps {[round(g * 1e3, 2) for g in m.itl_s]} ms")
        if m.max_gap_s != pytest.approx(0.25, abs=SLEEP_OVERSHOOT_S + DELIVERY_S):
            errors.append(f"longest gap {m.max_gap_s * 1e3:.2f} ms")
        if m.e2e_s != pytest.approx((served.done_ns - rec.sent_ns) / 1e9, abs=DELIVERY_S):
            errors.append(f"E2E {m.e2e_s * 1e3:.2f} ms vs done {(served.done_ns - rec.sent_ns) / 1e6:.2f} ms after send")
        print(f"attempt {attempt + 1}: TTFT {m.ttft_s * 1e3:.2f} ms, gaps "
              f"{', '.join(f'{g * 1e3:.2f}' for g in m.itl_s)} ms" + (f"; off: {'; '.join(errors)}" if errors else ""))
        if not errors:
            break
    else:
        pytest.fail("timing off in every attempt; the last one:\n" + "\n".join(errors))
    assert m.num_stalls == 1
    assert m.tpot_s == pytest.approx((m.e2e_s - m.ttft_s) / 6)
    # the role-only chunk the server sent first did not count as the first token
    assert m.num_chunks == 7 and m.server_request_id == "chatcmpl-r1"
    # the request asked for usage and forwarded its id
    assert served.body["stream_options"] == {"include_usage": True} and served.headers["x-request-id"] == "r1"


def test_server_that_omits_usage():
    script = Script(first_delay_s=0.04, gaps_s=[0.02] * 4, honor_usage=False)
    for _ in range(ATTEMPTS):
        with FakeOpenAIServer(script) as srv:
            recs = asyncio.run(_send_warm(srv.base_url, [RequestSpec("r1", "hello", 5), RequestSpec("r2", "x", 5)],
                                          endpoint="completions"))
            served = srv.served[-2:]
        ms = [derive(r, recs[0].scheduled_ns) for r in recs]
        for m in ms:
            assert m.status == "ok" and m.output_tokens_source == "chunks" and m.num_output_tokens == 5
        errors = [e for m, r, s in zip(ms, recs, served) for e in _timing_errors(m, r, s, script)]
        if not errors:
            break
    else:
        pytest.fail("timing off in every attempt; the last one:\n" + "\n".join(errors))
    assert served[-1].path == "/v1/completions" and served[-1].body["prompt"] == "x"
    r = summarize(ms, 1.0)
    assert r["output_tokens_from_chunks"] == 2 and r["output_tokens_from_usage"] == 0
    assert r["total_output_tokens"] == 10


def test_failed_incomplete_and_tokenless_requests():
    scripts = {
        "ok": Script(first_delay_s=0.01, gaps_s=[0.01]),
        "http500": Script(status=500),
        "cut": Script(first_delay_s=0.01, gaps_s=[0.01] * 5, cut_after=2),
        "error-event": Script(first_delay_s=0.01, gaps_s=[0.01] * 5, error_event_after=1),
        "no-tokens": Script(zero_tokens=True),
    }
    with FakeOpenAIServer(lambda body: scripts[body["messages"][0]["content"]]) as srv:
        specs = [RequestSpec(k, k, 8) for k in scripts]

        async def run() -> list[RequestRecord]:
            async with StreamingClient(ClientConfig(base_url=srv.base_url, model="m")) as client:
                return await drive(specs, client.send, ArrivalPlan(concurrency=5))

        recs = asyncio.run(run())
    ms = {m.request_id: m for m in (derive(r, 0) for r in recs)}
    assert ms["ok"].status == "ok" and ms["ok"].num_output_tokens == 2
    assert ms["http500"].status == "failed" and "HTTP 500" in ms["http500"].error and "scripted failure" in ms["http500"].error
    assert ms["cut"].status == "incomplete" and ms["cut"].num_chunks == 2 and ms["cut"].e2e_s is None
    assert ms["error-event"].status == "failed" and ms["error-event"].error == "scripted mid-stream error"
    assert ms["no-tokens"].status == "ok" and ms["no-tokens"].ttft_s is None and ms["no-tokens"].num_output_tokens == 0
    r = summarize(list(ms.values()), 1.0)
    assert (r["completed"], r["failed"], r["incomplete"], r["completed_without_tokens"]) == (2, 2, 1, 1)


def _words(body: dict) -> int:
    """The fake server's token count: one per word (the prompt builder's words are single tokens;
    completions on the bundled tokenizer add no BOS)."""
    return len(body["prompt"].split(" "))


def test_cli_random_run_writes_results_and_a_run_directory(tmp_path):
    from phaselab.obs.rundir import read_run_dir

    script = Script(first_delay_s=0.02, gaps_s=[0.01] * 3)
    with FakeOpenAIServer(script, prompt_tokens=_words) as srv:
        rc = bench_main([
            "bench", "--base-url", srv.base_url, "--endpoint", "completions", "--workload", "random",
            "--num-prompts", "6", "--input-len", "uniform:20:60", "--output-len", "4", "--concurrency", "2",
            "--num-warmups", "2", "--seed", "3", "--goodput", "ttft:5000", "tpot:5000", "--percentiles", "50,99.9",
            "--record", str(tmp_path / "run"), "--result-json", str(tmp_path / "result.json"),
            "--requests-jsonl", str(tmp_path / "requests.jsonl"), "--scrape-metrics", "--disable-progress",
        ])
        assert srv.max_in_flight <= 2 and len(srv.served) == 8
    assert rc == 0
    result = json.loads((tmp_path / "result.json").read_text())
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "latencies", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99.9_ttft_ms",
                "mean_tpot_ms", "p50_itl_ms", "median_e2el_ms", "errors"):
        assert key in result, key
    assert result["completed"] == 6 and result["num_warmups"] == 2 and result["model"] == "fake-model"
    assert result["input_len_mismatches"] == 0 and all(20 <= n <= 60 for n in result["input_lens"])
    assert result["output_lens"] == [4] * 6 and result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["server_metrics_diff"]["counters"]["fake_requests_total"] == 6  # warm-ups excluded
    # the run directory reads back through the project's reader
    run = read_run_dir(tmp_path / "run")
    assert run.config["source"] == "client" and run.config["format"] == "phaselab-run" and run.iterations == []
    assert run.config["bench"]["num_prompts"] == 6 and "api_key" not in run.config["bench"]
    assert len(run.requests) == 8
    lines = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [x["warmup"] for x in lines] == [True] * 2 + [False] * 6
    measured = [x for x in lines if not x["warmup"]]
    assert [x["ttft_s"] for x in measured] == pytest.approx(result["ttfts"])
    for x, rm in zip(lines, run.requests):
        assert rm.ttft_s == pytest.approx(x["ttft_s"]) and rm.itl_s == pytest.approx(x["itl_s"])
        assert rm.num_output_tokens == 4 and x["output_tokens_source"] == "usage"
    assert (tmp_path / "run" / "server_metrics_after.prom").read_text().startswith("# HELP")
    assert (tmp_path / "requests.jsonl").read_text() == (tmp_path / "run" / "requests.jsonl").read_text()


def test_cli_interference_run_sees_the_streams_freeze(tmp_path):
    """The streams' gaps outside the long prompts' prefills are the scripted 20 ms (within a sleep's
    overshoot), and each long prompt's scripted 150 ms prefill freezes both streams. A run on a
    machine too busy for the timing bounds is repeated, up to ATTEMPTS times, each run judged alone."""
    stream = Script(first_delay_s=0.02, gaps_s=[0.02] * 34)
    long_ = Script(first_delay_s=0.15, gaps_s=[0.01], prefill_blocks_others=True)

    def script(body: dict) -> Script:
        return long_ if len(body["messages"][0]["content"].split(" ")) > 200 else stream

    for attempt in range(ATTEMPTS):
        out = tmp_path / f"r{attempt}.json"
        with FakeOpenAIServer(script) as srv:
            rc = bench_main([
                "bench", "--base-url", srv.base_url, "--workload", "interference", "--num-streams", "2",
                "--stream-input-len", "40", "--stream-output-len", "35", "--num-long-prompts", "2",
                "--long-input-len", "300", "--long-output-len", "2", "--long-start", "0.15", "--long-interval", "0.3",
                "--result-json", str(out), "--disable-progress",
            ])
        assert rc == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 4 and set(result["groups"]) == {"stream", "long"}
        inter = result["interference"]
        assert inter["num_streams"] == 2 and len(inter["long_prompts"]) == 2
        errors = []
        median = inter["median_stream_gap_outside_long_prefills_ms"]
        if median != pytest.approx(20, abs=SLEEP_OVERSHOOT_S * 1e3):
            errors.append(f"median stream gap {median:.2f} ms, scripted 20 ms")
        for row in inter["long_prompts"]:
            # the scripted 150 ms wait only lengthens on a slow machine: these hold in every run
            assert row["status"] == "ok" and row["max_stream_gap_ms"] >= 140 and row["ttft_ms"] >= 150, row
            if row["num_streams_stalled"] != 2:
                errors.append(f"a long prompt stalled {row['num_streams_stalled']} streams, not 2")
        stalls = result["groups"]["stream"]["total_stalls"]
        if stalls < 4:
            errors.append(f"{stalls} stalls of the streams")
        print(f"attempt {attempt + 1}: median stream gap {median:.2f} ms; long prompts: " + "; ".join(
            f"longest stream gap {r['max_stream_gap_ms']:.1f} ms, TTFT {r['ttft_ms']:.1f} ms"
            for r in inter["long_prompts"]) + f"; {stalls} stalls" + (f"; off: {'; '.join(errors)}" if errors else ""))
        if not errors:
            break
    else:
        pytest.fail("timing off in every attempt; the last one:\n" + "\n".join(errors))


def test_cli_errors_are_friendly(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    assert bench_main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--disable-progress"]) == 2
    assert "is the server up?" in capsys.readouterr().err
    assert bench_main(["bench", "--goodput", "itl:5", "--model", "m"]) == 2
    assert "NAME:MILLISECONDS" in capsys.readouterr().err
    assert bench_main(["bench", "--concurrency", "2", "--request-rate", "3", "--model", "m"]) == 2


def _mock_client(handler) -> StreamingClient:  # type: ignore[no-untyped-def]
    import httpx

    client = StreamingClient(ClientConfig(base_url="http://test", model="m", endpoint="completions"))
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return client


_SSE = (b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n')


def test_stale_pooled_connection_is_resent_once():
    """A server that closes each connection after a streamed reply (llama-server) leaves a dead
    socket in the pool: the POST on it gets no response; the client resends once and says so."""
    import httpx

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=_SSE, headers={"content-type": "text/event-stream"})

    async def run() -> RequestRecord:
        async with _mock_client(handler) as client:
            spec = RequestSpec("r1", "hi", 2)
            return await client.send(spec, new_record(spec, time.monotonic_ns()))

    rec = asyncio.run(run())
    assert len(calls) == 2 and json.loads(calls[1].content)["prompt"] == "hi"
    assert rec.exception is None and rec.status_code == 200 and rec.stale_connection_retries == 1
    assert rec.lines[-1] == "data: [DONE]" and len(rec.line_ns) == 3


def test_no_response_twice_fails_the_request_without_a_third_try():
    import httpx

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    async def run() -> RequestRecord:
        async with _mock_client(handler) as client:
            spec = RequestSpec("r1", "hi", 2)
            return await client.send(spec, new_record(spec, time.monotonic_ns()))

    rec = asyncio.run(run())
    assert len(calls) == 2
    assert rec.is_transport_failure and "RemoteProtocolError" in (rec.exception or "")
    assert rec.stale_connection_retries == 1
