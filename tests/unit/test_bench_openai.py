"""The OpenAI mode of ``slipstream bench`` without a server: SSE parsing, the per-request
timings, vLLM's TPOT and goodput, prompt synthesis, settings, and the load loops driven
against a fake client."""

from __future__ import annotations

import asyncio
import csv
import json
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from slipstream.bench.cli import bench
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.openai.client import SseParser, StreamState
from slipstream.bench.openai.report import CSV_FIELDS, level_row
from slipstream.bench.openai.requests import build_requests, read_prompts, synthetic_prompt
from slipstream.bench.openai.results import (
    LevelMeasurement,
    OpenAIBenchResult,
    RequestResult,
    level_result,
    meets_slos,
    tpot_s,
)
from slipstream.bench.openai.runner import LevelRun, ProgressListener, _probe, request_result
from slipstream.bench.openai.settings import OpenAIBenchSettings, TokenRange, parse_goodput
from slipstream.reports import write_csv_rows, write_json


def _chunk(**choice: object) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, **choice}]}) + b"\n\n"


CHAT_STREAM = (
    _chunk(delta={"role": "assistant", "content": ""}, finish_reason=None)
    + _chunk(delta={"content": "Hel"}, finish_reason=None)
    + _chunk(delta={"content": "lo"}, finish_reason=None)
    + _chunk(delta={}, finish_reason="length")
    + b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\n'
    + b"data: [DONE]\n\n"
)


# ------------------------------------------------------------------------- SSE parsing


def test_sse_events_come_out_whole_however_the_bytes_are_split() -> None:
    whole = SseParser().feed(CHAT_STREAM)
    assert len(whole) == 6 and whole[-1] == b"[DONE]"
    for size in (1, 2, 3, 7, 50):
        parser = SseParser()
        events = []
        for start in range(0, len(CHAT_STREAM), size):
            events += parser.feed(CHAT_STREAM[start : start + size])
        assert events == whole


def test_sse_crlf_multiline_data_comments_and_other_fields() -> None:
    stream = b": keep-alive\r\nevent: message\r\nid: 4\r\ndata: a\r\ndata:b\r\n\r\ndata: [DONE]\n\n"
    assert SseParser().feed(stream) == [b"a\nb", b"[DONE]"]
    # A blank line with no data before it dispatches nothing.
    assert SseParser().feed(b"\n\nretry: 10\n\n") == []


def test_stream_state_times_content_chunks_only_and_reads_usage() -> None:
    state = StreamState()
    for now, data in enumerate(SseParser().feed(CHAT_STREAM)):
        state.event(data, float(now))
    # The role chunk (empty content) and the finish chunk are not tokens.
    assert state.chunk_times_s == [1.0, 2.0]
    assert state.first_content_s == 1.0
    assert (state.prompt_tokens, state.output_tokens) == (7, 3)
    assert state.done and state.error is None


def test_stream_state_reads_completions_chunks() -> None:
    state = StreamState()
    state.event(orjson.dumps({"choices": [{"text": "a", "finish_reason": None}]}), 1.0)
    state.event(orjson.dumps({"choices": [{"text": "", "finish_reason": "stop"}]}), 2.0)
    assert state.chunk_times_s == [1.0] and state.output_tokens is None


def test_stream_state_error_event_and_garbage_fail_with_a_key() -> None:
    state = StreamState()
    state.event(b'{"error": {"message": "cache exhausted", "type": "server_error"}}', 1.0)
    state.event(b"not json", 2.0)  # the first error is kept
    assert (state.error, state.error_message) == ("stream error", "cache exhausted")
    garbage = StreamState()
    garbage.event(b"[1, 2]", 1.0)
    assert garbage.error == "stream bad-json"


# ------------------------------------------------------------------------- timings


def _stream(chunk_times_s: list[float], done_s: float, output_tokens: int | None) -> StreamState:
    state = StreamState()
    state.chunk_times_s = chunk_times_s
    state.done, state.done_s, state.output_tokens, state.prompt_tokens = True, done_s, 7, 7
    state.output_tokens = output_tokens
    return state


def test_request_timings_count_from_the_scheduled_arrival_when_sent_late() -> None:
    [request] = build_requests(_settings(num_requests=1, output_tokens=4))
    stream = _stream([10.5, 10.6, 10.8, 10.9], done_s=11.0, output_tokens=4)
    result = request_result(request, stream, level_start_s=9.0, scheduled_s=10.0, sent_s=10.2)
    assert result.arrival_s == pytest.approx(1.0)
    assert result.send_lag_s == pytest.approx(0.2)
    assert result.ttft_s == pytest.approx(0.5)  # from 10.0, not from the late send
    assert result.e2e_s == pytest.approx(1.0)
    assert result.itl_s == pytest.approx([0.1, 0.2, 0.1])
    assert result.tpot_s == pytest.approx((1.0 - 0.5) / 3)
    assert result.usage_reported and result.output_tokens == 4


def test_without_usage_output_tokens_are_the_content_chunks() -> None:
    [request] = build_requests(_settings(num_requests=1))
    result = request_result(request, _stream([1.0, 2.0], 2.5, None), 0.0, 0.5, 0.5)
    assert result.output_tokens == 2 and not result.usage_reported


def test_tpot_is_vllms_definition() -> None:
    assert tpot_s(e2e_s=2.0, ttft_s=0.5, output_tokens=4) == pytest.approx(0.5)
    assert tpot_s(e2e_s=2.0, ttft_s=0.5, output_tokens=1) is None
    assert tpot_s(e2e_s=None, ttft_s=None, output_tokens=9) is None


def _ok(
    ttft_s: float, e2e_s: float, output_tokens: int, max_tokens: int = 0, **kw: object
) -> RequestResult:
    return RequestResult(
        index=0, arrival_s=0.0, send_lag_s=0.0, max_tokens=max_tokens or output_tokens,
        prompt_tokens=10, output_tokens=output_tokens, usage_reported=True,
        ttft_s=ttft_s, e2e_s=e2e_s, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_goodput_needs_every_slo_met() -> None:
    fast = _ok(ttft_s=0.1, e2e_s=1.0, output_tokens=10)  # TPOT 100 ms
    assert meets_slos(fast, {"ttft": 100, "tpot": 100})
    assert not meets_slos(fast, {"ttft": 99})
    assert not meets_slos(fast, {"ttft": 500, "tpot": 99.9})
    assert not meets_slos(fast, {"e2el": 999})
    # One output token: TPOT counts as 0, as in vLLM.
    assert meets_slos(_ok(ttft_s=0.1, e2e_s=0.1, output_tokens=1), {"tpot": 1})
    # No content at all: held to the TTFT limit with its E2E.
    empty = _ok(ttft_s=0.0, e2e_s=0.3, output_tokens=0)
    empty.ttft_s = None
    assert not meets_slos(empty, {"ttft": 200}) and meets_slos(empty, {"ttft": 300})
    failed = RequestResult(index=0, arrival_s=0, send_lag_s=0, max_tokens=4, error="http 503")
    assert not meets_slos(failed, {})


def _measurement(requests: list[RequestResult], **kw: object) -> LevelMeasurement:
    fields: dict[str, object] = {
        "level": LoadLevel(request_rate=2.0), "requests": requests, "duration_s": 2.0,
        "error_examples": {"http 503": "queue full"}, "peak_inflight": 2, "late_sends": 0,
        "client_cpu_s": 0.1, "slos_ms": {"ttft": 200}, "ignore_eos": True, "max_inflight": 8,
    }  # fmt: skip
    return LevelMeasurement(**(fields | kw))  # type: ignore[arg-type]


def test_level_figures_throughput_goodput_and_distributions() -> None:
    requests = [
        _ok(ttft_s=0.1, e2e_s=0.5, output_tokens=5, itl_s=[0.1] * 4),
        _ok(ttft_s=0.3, e2e_s=1.1, output_tokens=9, itl_s=[0.1] * 8),
        _ok(ttft_s=0.2, e2e_s=0.2, output_tokens=1),
        RequestResult(index=3, arrival_s=1.5, send_lag_s=0.0, max_tokens=9, error="http 503"),
    ]
    result = level_result(_measurement(requests))
    assert (result.requests, result.errors, result.errors_by_code) == (3, 1, {"http 503": 1})
    assert result.error_examples == {"http 503": "queue full"}
    assert result.request_throughput_per_s == pytest.approx(1.5)
    assert result.output_tokens == 15 and result.prompt_tokens == 30
    assert result.output_throughput_tok_per_s == pytest.approx(7.5)
    assert result.total_token_throughput_tok_per_s == pytest.approx(22.5)
    # TTFT <= 200 ms: the first and third requests.
    assert result.good_requests == 2 and result.goodput_req_per_s == pytest.approx(1.0)
    assert result.ttft.count == 3 and result.ttft.mean_ms == pytest.approx(200)
    assert result.ttft.max_ms == pytest.approx(300)
    # TPOT only for requests of 2+ tokens: 100 ms each.
    assert result.tpot.count == 2 and result.tpot.p50_ms == pytest.approx(100, rel=0.01)
    assert result.itl.count == 12 and result.e2e.count == 3
    assert result.client_cpu_pct == pytest.approx(5.0)
    assert result.warnings == []


def test_level_warnings_name_what_went_wrong() -> None:
    short = _ok(ttft_s=0.1, e2e_s=0.5, output_tokens=3, max_tokens=8)
    no_usage = _ok(ttft_s=0.1, e2e_s=0.5, output_tokens=3)
    no_usage.usage_reported = False
    result = level_result(_measurement([short, no_usage], client_cpu_s=1.9, late_sends=1))
    text = " ".join(result.warnings)
    assert "stopped before max_tokens despite ignore_eos" in text
    assert "no usage chunk" in text
    assert "95% of a core" in text
    assert "sent over 10 ms late" in text and "busy" in text
    failed = RequestResult(index=0, arrival_s=0, send_lag_s=0, max_tokens=4, error="http 503")
    nothing = level_result(_measurement([failed]))
    assert nothing.ttft.mean_ms is None and nothing.goodput_req_per_s == 0
    assert any("http 503 x1 (queue full)" in w for w in nothing.warnings)


def test_json_and_csv_hold_every_level_even_one_without_successes(tmp_path: Path) -> None:
    ok = level_result(_measurement([_ok(ttft_s=0.1, e2e_s=0.5, output_tokens=5)]))
    failed = RequestResult(index=0, arrival_s=0, send_lag_s=0, max_tokens=4, error="timeout")
    empty = level_result(_measurement([failed]))
    result = OpenAIBenchResult(
        url="http://x", model="m", protocol="openai-chat", distribution="poisson",
        num_requests=1, ignore_eos=True, goodput_slos_ms={"ttft": 200}, levels=[ok, empty],
    )  # fmt: skip
    write_json(result, tmp_path / "r.json")  # refuses NaN: empty figures are null
    levels = json.loads((tmp_path / "r.json").read_text())["levels"]
    assert levels[0]["ttft"]["mean_ms"] == pytest.approx(100)
    assert levels[1]["ttft"]["mean_ms"] is None
    assert levels[0]["request_results"][0]["e2e_s"] == 0.5
    write_csv_rows(tmp_path / "r.csv", CSV_FIELDS, [level_row(level) for level in result.levels])
    with (tmp_path / "r.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == CSV_FIELDS and len(rows) == 2
    assert float(rows[0]["e2e_mean_ms"]) == pytest.approx(500)
    assert rows[1]["errors_by_code"] == "timeout=1" and rows[1]["ttft_p99_ms"] == ""


# ------------------------------------------------------------------------- requests


def _settings(**kw: object) -> OpenAIBenchSettings:
    return OpenAIBenchSettings(url="http://localhost:8000", model="m", **kw)  # type: ignore[arg-type]


def test_synthetic_prompts_have_the_asked_word_count_and_differ() -> None:
    rng = np.random.default_rng(0)
    prompts = [synthetic_prompt(n, rng) for n in (1, 64, 64, 1000)]
    assert [len(p.split()) for p in prompts] == [1, 64, 64, 1000]
    assert prompts[1] != prompts[2]


def test_requests_are_reproducible_and_lengths_stay_in_range() -> None:
    settings = _settings(num_requests=200, prompt_tokens="40,10", output_tokens="16,4", seed=3)
    requests = build_requests(settings)
    assert requests == build_requests(settings)
    assert requests != build_requests(settings.model_copy(update={"seed": 4}))
    words = [len(r.prompt.split()) for r in requests]
    assert min(words) >= 30 and max(words) <= 50 and len(set(words)) > 10
    assert {r.max_tokens for r in requests} == set(range(12, 21))
    assert [r.index for r in requests] == list(range(200))


def test_request_bodies_stream_with_usage_for_each_protocol() -> None:
    [chat] = build_requests(_settings(num_requests=1, output_tokens=7, ignore_eos=True))
    body = orjson.loads(chat.body)
    assert body["messages"] == [{"role": "user", "content": chat.prompt}]
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    [completion] = build_requests(_settings(num_requests=1, protocol="openai-completions"))
    body = orjson.loads(completion.body)
    assert body["prompt"] == completion.prompt and "messages" not in body
    assert "ignore_eos" not in body and body["model"] == "m"


def test_token_id_prompts_go_to_completions_only() -> None:
    settings = _settings(num_requests=3, protocol="openai-completions")
    requests = build_requests(settings, prompts=[[1, 2, 3], "text"])
    assert [orjson.loads(r.body)["prompt"] for r in requests] == [[1, 2, 3], "text", [1, 2, 3]]
    with pytest.raises(ValueError, match="need --protocol openai-completions"):
        build_requests(_settings(num_requests=1), prompts=[[1, 2, 3]])


def test_prompts_file_lines_are_used_in_turn(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text('first prompt\n\n"two\\nlines"\nthird\n')
    assert read_prompts(path) == ["first prompt", "two\nlines", "third"]
    requests = build_requests(_settings(num_requests=4, prompts_path=path))
    assert [r.prompt for r in requests] == ["first prompt", "two\nlines", "third", "first prompt"]
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts(tmp_path / "empty.txt")
    (tmp_path / "bad.txt").write_text('"unterminated\n')
    with pytest.raises(ValueError, match="line 1"):
        read_prompts(tmp_path / "bad.txt")


def test_settings_parse_and_check_lengths_and_slos() -> None:
    assert TokenRange.parse("128") == TokenRange(mean=128)
    assert TokenRange.parse("128, 32").bounds() == (96, 160)
    assert _settings(output_tokens=64).output_tokens == TokenRange(mean=64)
    assert parse_goodput(["ttft:500 tpot:50", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0,
    }  # fmt: skip
    assert _settings(goodput=["ttft:500,tpot:50"]).goodput == {"ttft": 500.0, "tpot": 50.0}
    for bad, message in [
        ({"prompt_tokens": "10,10"}, "spread must be smaller"),
        ({"prompt_tokens": "ten"}, "MEAN or MEAN,SPREAD"),
        ({"goodput": ["itl:5"]}, "unknown metric 'itl'"),
        ({"goodput": ["ttft=5"]}, "METRIC:MILLISECONDS"),
        ({"goodput": ["ttft:0"]}, "must be > 0"),
        ({"concurrency": [1], "request_rate": [2.0]}, "not both"),
    ]:
        with pytest.raises(ValidationError, match=message):
            _settings(**bad)


def test_cli_refuses_options_of_the_other_mode() -> None:
    runner = CliRunner()
    url = "http://127.0.0.1:9"
    args = [url, "-m", "m", "--protocol", "openai-chat", "--batch-size", "2"]
    result = runner.invoke(bench, args)
    assert result.exit_code == 2 and "--batch-size: not used with OpenAI" in result.output
    result = runner.invoke(bench, [url, "-m", "m", "--goodput", "ttft:5", "--ignore-eos"])
    assert result.exit_code == 2 and "--goodput, --ignore-eos: not used with V2" in result.output
    result = runner.invoke(
        bench, [url, "-m", "m", "--protocol", "openai-completions", "--output-tokens", "4,4"]
    )
    assert result.exit_code == 2 and "--output-tokens: " in result.output


# ------------------------------------------------------------------------- load loops


class FakeClient:
    """Answers every request after ``service_s`` with ``tokens`` evenly spaced chunks."""

    def __init__(self, service_s: float, tokens: int = 4) -> None:
        self.service_s = service_s
        self.tokens = tokens
        self.error_examples: dict[str, str] = {}
        self.reconnects = 0
        self.inflight = 0
        self.peak = 0
        self.sent_at: list[float] = []
        self.took: list[float] = []  # each send's real time (a loaded host oversleeps)

    def encode(self, body: bytes) -> bytes:
        return body

    async def send(self, payload: bytes) -> StreamState:
        self.sent_at.append(time.monotonic())
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        start = time.monotonic()
        await asyncio.sleep(self.service_s)
        self.took.append(time.monotonic() - start)
        self.inflight -= 1
        step = self.service_s / (self.tokens + 1)
        times = [start + step * (i + 1) for i in range(self.tokens)]
        return _stream(times, time.monotonic(), self.tokens)


async def _run_level(client: FakeClient, level: LoadLevel, **kw: object) -> LevelMeasurement:
    settings = _settings(num_requests=6, output_tokens=4, **kw)
    requests = build_requests(settings)
    run = LevelRun(client, settings, requests, level, ProgressListener())  # type: ignore[arg-type]
    return await run.run()


async def test_closed_loop_keeps_concurrency_requests_outstanding() -> None:
    client = FakeClient(service_s=0.05)
    measured = await _run_level(client, LoadLevel(concurrency=2))
    assert client.peak == 2 and measured.peak_inflight == 2
    assert [r.index for r in measured.requests] == list(range(6))
    assert all(r.error is None and r.send_lag_s < 0.01 for r in measured.requests)
    # Six requests two at a time: three rounds of 50 ms.
    assert measured.duration_s >= 0.15


async def test_open_loop_counts_the_wait_for_a_slot_from_the_scheduled_arrival() -> None:
    # 100 req/s, constant gaps of 10 ms, but one request at a time taking 50 ms: every
    # request after the first waits, and that wait is part of its latency.
    client = FakeClient(service_s=0.05)
    measured = await _run_level(
        client, LoadLevel(request_rate=100.0), distribution="constant", max_inflight=1
    )
    assert client.peak == 1 and measured.late_sends >= 4
    arrivals = [r.arrival_s for r in measured.requests]
    assert arrivals == pytest.approx([0.01 * i for i in range(6)], abs=1e-9)
    last = measured.requests[-1]
    assert last.send_lag_s > 0.15
    e2e = last.e2e_s
    # Its latency is its wait for the slot plus its own service time, nothing more.
    assert e2e is not None and e2e == pytest.approx(last.send_lag_s + client.took[-1], abs=0.005)
    assert last.ttft_s is not None and last.ttft_s > last.send_lag_s


async def test_open_loop_sends_on_schedule_whatever_the_responses_do() -> None:
    # Six arrivals 20 ms apart, each answered after 0.5 s: all are sent before the first
    # answer, none before its time (bar the 1 ms of timer slack).
    client = FakeClient(service_s=0.5)
    started = time.monotonic()
    measured = await _run_level(client, LoadLevel(request_rate=50.0), distribution="constant")
    assert measured.peak_inflight == 6 and client.peak == 6
    for request, sent_at in zip(measured.requests, client.sent_at, strict=True):
        assert sent_at - started >= request.arrival_s - 0.0011
    assert measured.requests[-1].arrival_s == pytest.approx(0.1)


async def test_the_warm_up_shares_no_prefix_with_the_run_and_reports_its_ttft() -> None:
    """The probe warms the server on a prompt as long as the first request's, but a
    prefix cache must not serve any measured request from it."""
    sent: list[bytes] = []

    class Recording(FakeClient):
        async def send(self, payload: bytes) -> StreamState:
            sent.append(payload)
            return await super().send(payload)

    for protocol in ("openai-completions", "openai-chat"):
        sent.clear()
        settings = _settings(protocol=protocol, num_requests=8, prompt_tokens=32, seed=5)
        requests = build_requests(settings)
        ttft_s = await _probe(Recording(service_s=0.05), settings, requests[0])  # type: ignore[arg-type]
        assert ttft_s is not None and 0.005 < ttft_s < 0.05
        [body] = [json.loads(p) for p in sent]
        probe = (
            body["prompt"] if protocol == "openai-completions" else body["messages"][0]["content"]
        )
        assert probe == requests[0].prompt[::-1]
        assert body["max_tokens"] <= 4
        for request in requests:
            assert probe[:2] != request.prompt[:2]


def test_response_format_constrains_every_request(tmp_path: Path) -> None:
    """--response-format json_object, or a schema file sent as a strict json_schema."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    common = {"url": "http://127.0.0.1:1", "model": "m", "protocol": "openai-chat",
              "num_requests": 2, "prompt_tokens": 8, "output_tokens": 4}  # fmt: skip
    plain = OpenAIBenchSettings(**common)
    assert all("response_format" not in json.loads(r.body) for r in build_requests(plain))
    as_object = OpenAIBenchSettings(**common, response_format="json_object")
    bodies = [json.loads(r.body) for r in build_requests(as_object)]
    assert all(body["response_format"] == {"type": "json_object"} for body in bodies)
    as_schema = OpenAIBenchSettings(**common, response_format=str(tmp_path / "schema.json"))
    body = json.loads(build_requests(as_schema)[0].body)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "bench", "schema": schema, "strict": True},
    }
    with pytest.raises(ValueError, match="expected 'json_object' or a JSON schema file"):
        OpenAIBenchSettings(**common, response_format=str(tmp_path / "missing.json"))
