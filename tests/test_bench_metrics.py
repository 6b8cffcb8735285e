"""Metric derivation on hand-made timestamp series: phaselab.bench.client_metrics / client.parse_stream."""

from __future__ import annotations

import json

import numpy as np
import pytest

from phaselab.bench.client import RequestRecord
from phaselab.bench.client_metrics import derive, describe, interference_report, is_good, parse_goodput, summarize
from phaselab.bench.bench_report import metrics_diff, summary_rows
from phaselab.workload.lengths import LengthDist, WorkloadError

MS = 1_000_000  # ns


def chat_chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
    delta: dict = {"role": "assistant", "content": ""} if role else {}
    if text is not None:
        delta["content"] = text
    return "data: " + json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def usage_chunk(prompt: int, completion: int) -> str:
    return "data: " + json.dumps({"id": "chatcmpl-1", "choices": [],
                                  "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})


def record(events: list[tuple[int, str]], *, sent_ms: int = 0, end_ms: int | None = None, status: int | None = 200,
           exception: str | None = None, transport_failure: bool = False, rid: str = "r", group: str = "default",
           scheduled_ms: int | None = None, n_prompt: int | None = 10) -> RequestRecord:
    """A raw record: (arrival ms, SSE line) events after a send at `sent_ms`; t0 = 0."""
    rec = RequestRecord(request_id=rid, group=group, warmup=False, num_prompt_tokens_requested=n_prompt, max_tokens=16,
                        scheduled_ns=(scheduled_ms if scheduled_ms is not None else sent_ms) * MS)
    rec.sent_ns = sent_ms * MS
    rec.status_code = status
    rec.lines = [line for _, line in events]
    rec.line_ns = [t * MS for t, _ in events]
    done = [t for t, line in events if line == "data: [DONE]"]
    rec.end_ns = (done[0] if done else (end_ms if end_ms is not None else (events[-1][0] if events else sent_ms))) * MS
    rec.exception = exception
    rec.is_transport_failure = transport_failure
    return rec


def stream(token_ms: list[int], *, usage: tuple[int, int] | None = None, done_ms: int | None = None,
           role_ms: int | None = None) -> list[tuple[int, str]]:
    ev: list[tuple[int, str]] = []
    if role_ms is not None:
        ev.append((role_ms, chat_chunk(None, role=True)))
    ev += [(t, chat_chunk(f" t{i}")) for i, t in enumerate(token_ms)]
    last = token_ms[-1] if token_ms else (role_ms or 0)
    ev.append((last, chat_chunk(None, finish="length")))
    if usage is not None:
        ev.append((last, usage_chunk(*usage)))
    ev.append((done_ms if done_ms is not None else last, "data: [DONE]"))
    return ev


def test_normal_stream_ttft_itl_tpot_e2e_and_stalls():
    # sent at 0; role chunk at 5 (not a token); tokens at 100, 130, 160, 400, 430; [DONE] at 440
    rec = record(stream([100, 130, 160, 400, 430], usage=(10, 5), done_ms=440, role_ms=5))
    m = derive(rec, t0_ns=0, stall_factor=3.0)
    assert m.status == "ok" and m.error is None
    assert m.ttft_s == pytest.approx(0.100)
    assert m.itl_s == pytest.approx([0.030, 0.030, 0.240, 0.030])
    assert m.e2e_s == pytest.approx(0.440)
    assert m.tpot_s == pytest.approx((0.440 - 0.100) / 4)
    assert m.num_output_tokens == 5 and m.output_tokens_source == "usage" and m.num_chunks == 5
    assert m.num_prompt_tokens == 10
    assert m.max_gap_s == pytest.approx(0.240) and m.median_gap_s == pytest.approx(0.030)
    assert m.num_stalls == 1 and m.stall_s == pytest.approx(0.210)
    assert m.finish_reason == "length" and m.server_request_id == "chatcmpl-1"


def test_stall_threshold_is_relative_to_the_streams_own_median():
    slow_steady = derive(record(stream([100 + 200 * i for i in range(6)])), 0, stall_factor=3.0)
    assert slow_steady.num_stalls == 0 and slow_steady.max_gap_s == pytest.approx(0.2)
    assert derive(record(stream([100, 110, 120, 150, 160])), 0, stall_factor=2.0).num_stalls == 1
    assert derive(record(stream([100, 110, 120, 150, 160])), 0, stall_factor=3.5).num_stalls == 0


def test_single_token_output():
    m = derive(record(stream([80], usage=(10, 1), done_ms=90)), 0)
    assert m.status == "ok"
    assert m.ttft_s == pytest.approx(0.080) and m.e2e_s == pytest.approx(0.090)
    assert m.itl_s == [] and m.tpot_s is None
    assert m.max_gap_s is None and m.num_stalls == 0
    # vLLM's goodput rule: fewer than two tokens -> TPOT counts as 0
    assert is_good(m, {"tpot": 1.0, "ttft": 100.0})
    assert not is_good(m, {"ttft": 79.0})


def test_usage_omitted_counts_content_chunks_and_says_so():
    m = derive(record(stream([50, 60, 70])), 0)
    assert m.num_output_tokens == 3 and m.output_tokens_source == "chunks"
    assert m.num_prompt_tokens == 10  # falls back to what was built
    assert m.tpot_s == pytest.approx((0.070 - 0.050) / 2)


def test_usage_counts_tokens_that_share_a_chunk():
    # a server that bundles tokens: 3 chunks carried 6 tokens; TPOT uses the server's count
    m = derive(record(stream([50, 60, 70], usage=(10, 6))), 0)
    assert m.num_output_tokens == 6 and m.num_chunks == 3
    assert m.tpot_s == pytest.approx((0.070 - 0.050) / 5)
    assert m.itl_s == pytest.approx([0.010, 0.010])


def test_completions_endpoint_chunks():
    ev = [(t, "data: " + json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": txt, "finish_reason": fin}]}))
          for t, txt, fin in [(40, "a", None), (55, "", None), (70, "b", "stop")]]
    ev.append((71, "data: [DONE]"))
    m = derive(record(ev), 0)
    assert m.num_chunks == 2 and m.itl_s == pytest.approx([0.030]) and m.finish_reason == "stop"


def test_failed_http_status():
    rec = record([], status=500, end_ms=3)
    rec.error_body = '{"error": {"message": "boom"}}'
    m = derive(rec, 0)
    assert m.status == "failed" and "HTTP 500" in m.error and "boom" in m.error
    assert m.ttft_s is None and m.e2e_s is None and m.num_output_tokens == 0


def test_failed_connection():
    m = derive(record([], status=None, exception="ConnectError: refused", transport_failure=True), 0)
    assert m.status == "failed" and m.error == "ConnectError: refused"


def test_error_event_before_first_token_is_a_failure_without_ttft():
    ev = [(20, chat_chunk(None, role=True)), (30, 'data: {"error": {"message": "engine died", "code": 500}}'),
          (31, "data: [DONE]")]
    m = derive(record(ev), 0)
    assert m.status == "failed" and m.error == "engine died" and m.ttft_s is None


def test_completed_without_any_token():
    m = derive(record([(20, chat_chunk(None, role=True)), (25, chat_chunk(None, finish="stop")),
                       (26, usage_chunk(10, 0)), (26, "data: [DONE]")]), 0)
    assert m.status == "ok" and m.ttft_s is None and m.num_output_tokens == 0
    assert m.e2e_s == pytest.approx(0.026)
    assert not is_good(m, {"ttft": 1e9})  # no first token cannot meet a TTFT SLO
    assert is_good(m, {"e2el": 100})


def test_cut_stream_is_incomplete_with_the_transport_error():
    ev = stream([50, 60, 70])[:3]  # three tokens, no finish, no [DONE]
    m = derive(record(ev, exception="RemoteProtocolError: peer closed connection", end_ms=75), 0)
    assert m.status == "incomplete" and "peer closed" in m.error
    assert m.ttft_s == pytest.approx(0.050) and m.itl_s == pytest.approx([0.010, 0.010])  # kept per request
    assert m.e2e_s is None


def test_stream_ending_without_done_or_finish_is_incomplete():
    m = derive(record([(50, chat_chunk("x"))], end_ms=60), 0)
    assert m.status == "incomplete" and "before [DONE]" in m.error


def test_client_queue_time_and_start():
    m = derive(record(stream([150]), sent_ms=100, scheduled_ms=40), t0_ns=20 * MS)
    assert m.client_queue_s == pytest.approx(0.060) and m.start_s == pytest.approx(0.080)
    assert m.ttft_s == pytest.approx(0.050)


def _run() -> list:
    return [
        derive(record(stream([100, 130, 160, 400, 430], usage=(10, 5), done_ms=440), rid="a"), 0),
        derive(record(stream([200, 220], usage=(20, 2), done_ms=230), rid="b"), 0),
        derive(record(stream([50], usage=(5, 1), done_ms=60), rid="c"), 0),
        derive(record([], status=503, end_ms=1, rid="d"), 0),
        derive(record(stream([50, 60])[:2], exception="ReadTimeout: timed out", end_ms=90, rid="e"), 0),
    ]


def test_summarize_uses_vllm_keys_and_only_successful_requests():
    ms = _run()
    r = summarize(ms, duration_s=2.0, percentiles=(50, 99, 99.9), goodput={"ttft": 150, "tpot": 100})
    assert (r["completed"], r["failed"], r["incomplete"], r["num_requests"]) == (3, 1, 1, 5)
    assert r["total_input_tokens"] == 35 and r["total_output_tokens"] == 8
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["total_token_throughput"] == pytest.approx(43 / 2)
    # good: a (ttft 100, tpot 85) and c (ttft 50, tpot 0); b has ttft 200
    assert r["request_goodput"] == pytest.approx(1.0)
    ttfts = np.array([0.100, 0.200, 0.050]) * 1000
    assert r["mean_ttft_ms"] == pytest.approx(ttfts.mean())
    assert r["median_ttft_ms"] == pytest.approx(100.0)
    assert r["std_ttft_ms"] == pytest.approx(ttfts.std())
    assert r["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert r["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99.9))
    itls = [30, 30, 240, 30, 20]  # every gap of the successful requests, pooled
    assert r["mean_itl_ms"] == pytest.approx(np.mean(itls)) and r["max_itl_ms"] == pytest.approx(240)
    assert r["mean_tpot_ms"] == pytest.approx(np.mean([85.0, 30.0]))
    assert r["median_e2el_ms"] == pytest.approx(230.0)
    assert r["total_stalls"] == 1
    # per-request lists in request order, None where undefined
    assert r["ttfts"][3] is None and r["latencies"][4] is None and r["output_lens"] == [5, 2, 1, 0, 0]
    assert r["statuses"] == ["ok", "ok", "ok", "failed", "incomplete"]
    assert r["errors"][4] == "ReadTimeout: timed out"
    assert any("HTTP 503" in e for e in r["errors_summary"])
    json.dumps(r)  # serializable as is
    assert summary_rows(r)  # the terminal table renders from it


def test_summarize_empty_and_zero_duration():
    r = summarize([], duration_s=0.0)
    assert r["completed"] == 0 and r["request_throughput"] is None and r["mean_ttft_ms"] is None


def test_groups_are_summarized_separately():
    ms = [derive(record(stream([100, 110]), group="stream", rid="s"), 0),
          derive(record(stream([300]), group="long", rid="l"), 0)]
    r = summarize(ms, 1.0)
    assert set(r["groups"]) == {"stream", "long"}
    assert r["groups"]["long"]["mean_ttft_ms"] == pytest.approx(300)
    assert "ttfts" not in r["groups"]["long"]


def test_interference_report_finds_the_gap_that_overlaps_the_long_prefill():
    # a stream with 20 ms gaps, except one 200 ms gap (400 -> 600) while a long prompt waited
    # from 380 (sent) to 590 (first token)
    tokens = [20 * i for i in range(1, 21)] + [600 + 20 * i for i in range(10)]
    s = derive(record(stream(tokens), group="stream", rid="s"), 0)
    long_ = derive(record(stream([590, 600]), sent_ms=380, group="long", rid="l"), 0)
    rep = interference_report([s, long_], stall_factor=3.0)
    (row,) = rep["long_prompts"]
    assert row["ttft_ms"] == pytest.approx(210) and row["max_stream_gap_ms"] == pytest.approx(200)
    assert row["num_streams_stalled"] == 1
    assert rep["median_stream_gap_outside_long_prefills_ms"] == pytest.approx(20)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
            parse_goodput(bad)


def test_describe_keys():
    d = describe([0.001, 0.003], (50, 90), "x")
    assert d == {"mean_x_ms": 2.0, "median_x_ms": 2.0, "std_x_ms": 1.0, "p50_x_ms": 2.0,
                 "p90_x_ms": pytest.approx(2.8), "max_x_ms": 3.0}


def test_metrics_diff():
    before = ("# TYPE reqs_total counter\nreqs_total{reason=\"stop\"} 3\n"
              "# TYPE ttft_seconds histogram\nttft_seconds_bucket{le=\"1.0\"} 2\nttft_seconds_bucket{le=\"+Inf\"} 3\n"
              "ttft_seconds_count 3\nttft_seconds_sum 1.5\n# TYPE running gauge\nrunning 1\n")
    after = ("# TYPE reqs_total counter\nreqs_total{reason=\"stop\"} 7\n"
             "# TYPE ttft_seconds histogram\nttft_seconds_bucket{le=\"1.0\"} 5\nttft_seconds_bucket{le=\"+Inf\"} 7\n"
             "ttft_seconds_count 7\nttft_seconds_sum 3.5\n# TYPE running gauge\nrunning 0\n# TYPE new counter\nnew_total 2\n")
    d = metrics_diff(before, after)
    assert d["counters"]['reqs_total{reason="stop"}'] == 4
    assert d["counters"]['ttft_seconds_bucket{le="1.0"}'] == 3
    assert d["counters"]["ttft_seconds_count"] == 4 and d["counters"]["new_total"] == 2
    assert d["gauges"]["running"] == {"before": 1.0, "after": 0.0}
    assert d["histogram_means"]["ttft_seconds"] == pytest.approx(0.5)


def test_length_dist():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("256").sample(rng, 3) == [256, 256, 256]
    u = LengthDist.parse("uniform:10:20").sample(rng, 2000)
    assert min(u) == 10 and max(u) == 20
    c = LengthDist.parse("choice:8,64").sample(rng, 100)
    assert set(c) == {8, 64}
    ln = LengthDist.parse("lognormal:100:0.5").sample(rng, 20000)
    assert np.median(ln) == pytest.approx(100, rel=0.03)
    assert min(LengthDist.parse("normal:2:50").sample(rng, 1000)) >= 1
    assert str(LengthDist.parse("uniform:10:20")) == "uniform:10:20"
    for bad in ("abc", "uniform:5", "uniform:9:3", "normal:1:2:3", "choice:"):
        with pytest.raises(WorkloadError):
            LengthDist.parse(bad)
