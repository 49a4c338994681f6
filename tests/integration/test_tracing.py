"""Request tracing (``--trace-config mode=opentelemetry``) as a collector receives it: the
server's spans, exported over OTLP/HTTP by OpenTelemetry's own exporter, are read here by
a receiver that parses OTLP's protobuf (OpenTelemetry's own messages). V2 inference over
HTTP and gRPC and an OpenAI chat completion, in one process and split; each span a child
of the caller's ``traceparent``; Triton's trace settings deciding what is traced; under
a V2 inference's span, Triton's TIMESTAMPS as its model and compute spans' events (the
engine's, in the split layout), a request held in the queue showing it, an ensemble's
steps a model span each.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.llm_models import smollm2_gguf
from tests.models import ADD_SUB_WIDTH, build_add_sub, build_repeat, write_config
from tests.utils import RemoteServer, slipstream_command

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LLM = "smollm2"
DELAYED = "delayed"
QUEUE_DELAY_US = 300_000
PIPELINE = "pipeline"
REPEAT = "repeat"
# Two add_sub steps, the second on the first's outputs.
PIPELINE_CONFIG = f"""
name: "{PIPELINE}"
platform: "ensemble"
max_batch_size: 8
input [
  {{ name: "A" data_type: TYPE_FP32 dims: [ {ADD_SUB_WIDTH} ] }},
  {{ name: "B" data_type: TYPE_FP32 dims: [ {ADD_SUB_WIDTH} ] }}
]
output [ {{ name: "SUM_OF_BOTH" data_type: TYPE_FP32 dims: [ {ADD_SUB_WIDTH} ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "add_sub"
      model_version: -1
      input_map {{ key: "INPUT0" value: "A" }}
      input_map {{ key: "INPUT1" value: "B" }}
      output_map {{ key: "OUTPUT0" value: "sum" }}
      output_map {{ key: "OUTPUT1" value: "diff" }}
    }},
    {{
      model_name: "add_sub"
      model_version: -1
      input_map {{ key: "INPUT0" value: "sum" }}
      input_map {{ key: "INPUT1" value: "diff" }}
      output_map {{ key: "OUTPUT0" value: "SUM_OF_BOTH" }}
    }}
  ]
}}
"""
# Triton's TIMESTAMPS in the order they happen: the model span's and its compute span's.
MODEL_EVENTS = ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
COMPUTE_EVENTS = ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
TIMELINE = [*MODEL_EVENTS[:2], *COMPUTE_EVENTS, MODEL_EVENTS[2]]
CLOCKS_SLACK_NS = 1_000_000


class Collector:
    """An OTLP/HTTP trace receiver on a loopback port: every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self._lock = threading.Lock()
        collector = self

        class Receive(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service.ExportTraceServiceRequest.FromString(body)
                with collector._lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            collector.spans.extend(scope.spans)
                answer = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Receive)
        self.url = f"127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout_s: float = 20.0) -> list[Any]:
        """The spans once at least ``count`` request spans (a request's own, the server
        kind; its model and compute spans are internal) have come, with those that come
        with them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if sum(span.kind == span.SPAN_KIND_SERVER for span in self.spans) >= count:
                    time.sleep(0.3)  # stragglers of the same export
                    taken, self.spans = self.spans, []
                    return taken
            time.sleep(0.02)
        raise AssertionError(f"{len(self.spans)} spans came, {count} expected")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module", params=["one", "split"])
def traced(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RemoteServer, Collector]]:
    repo = tmp_path_factory.mktemp("tracing")
    build_add_sub(repo)
    # A lone request waits out the queue delay for company: its queue time.
    build_add_sub(repo, DELAYED)
    write_config(repo, DELAYED, {"max_batch_size": 8, "dynamic_batching": {
        "max_queue_delay_microseconds": QUEUE_DELAY_US}})  # fmt: skip
    (repo / PIPELINE / "1").mkdir(parents=True)
    (repo / PIPELINE / "config.pbtxt").write_text(PIPELINE_CONFIG)
    build_repeat(repo, REPEAT)
    (repo / LLM / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / LLM / "1" / "model.gguf")
    write_config(repo, LLM, {"backend": "llama_cpp", "generation": {
        "max_model_len": 256, "max_num_seqs": 2, "threads": 1}})  # fmt: skip
    collector = Collector()
    args = ["--trace-config", "mode=opentelemetry", "--trace-config", "rate=1",
            "--trace-config", f"opentelemetry,url={collector.url}",
            "--trace-config", "opentelemetry,resource=deployment=test", "--trust-pickle",
            *(["--frontends", "1"] if request.param == "split" else [])]  # fmt: skip
    # The SDK's batch processor exports every 5 s by default; 50 ms keeps the tests short.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
    with RemoteServer(repo, args, log_dir=repo, env=env) as server:
        yield server, collector
    collector.close()


def _add_sub_inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput(f"INPUT{i}", [1, ADD_SUB_WIDTH], "FP32") for i in (0, 1)]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, ADD_SUB_WIDTH), np.float32))
    return inputs


def _attributes(span: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        found[attribute.key] = getattr(value, value.WhichOneof("value"))
    return found


def _child_of_the_caller(span: Any) -> bool:
    return span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID


def _requests(spans: list[Any]) -> dict[str, Any]:
    """The V2 inferences' spans by request id."""
    return {_attributes(s)["slipstream.request_id"]: s for s in spans if s.name == "InferRequest"}


def _children(spans: list[Any], parent: Any) -> list[Any]:
    children = [
        s for s in spans if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id
    ]
    return sorted(children, key=lambda span: span.start_time_unix_nano)


def _events(span: Any) -> dict[str, int]:
    return {event.name: event.time_unix_nano for event in span.events}


def _model_and_compute(spans: list[Any], parent: Any, model: str) -> tuple[Any, Any]:
    """The one model span under ``parent`` (Triton's: named after the model, with its
    name and version), and its one compute span; checked for Triton's events, in the
    order they happened, within their spans."""
    (span,) = _children(spans, parent)
    assert span.name == model, span
    assert _attributes(span)["triton.model_name"] == model
    assert _attributes(span)["triton.model_version"] == "1"
    (compute,) = _children(spans, span)
    assert compute.name == "compute" and not _children(spans, compute)
    assert [event.name for event in span.events] == MODEL_EVENTS
    assert [event.name for event in compute.events] == COMPUTE_EVENTS
    times = {**_events(span), **_events(compute)}
    stamps = [times[name] for name in TIMELINE]
    assert stamps == sorted(stamps), dict(zip(TIMELINE, stamps, strict=True))
    # The request span's times are the wall clock's as it ran, the others monotonic ones
    # made wall-clock times when the request was done: a clock being slewed meanwhile
    # (NTP) moves them apart by a little.
    for outer, inner, slack_ns in ((parent, span, CLOCKS_SLACK_NS), (span, compute, 0)):
        assert outer.start_time_unix_nano <= inner.start_time_unix_nano + slack_ns
        assert inner.end_time_unix_nano <= outer.end_time_unix_nano + slack_ns
    assert span.start_time_unix_nano == times["REQUEST_START"]
    assert span.end_time_unix_nano == times["REQUEST_END"]
    assert compute.start_time_unix_nano == times["COMPUTE_START"]
    assert compute.end_time_unix_nano == times["COMPUTE_END"]
    return span, compute


def test_v2_inference_is_a_span_under_the_caller_s_over_http_and_grpc(
    traced: tuple[RemoteServer, Collector],
) -> None:
    server, collector = traced
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        http.infer("add_sub", _add_sub_inputs(httpclient), request_id="r-http",
                   headers={"traceparent": TRACEPARENT})  # fmt: skip
        grpc.infer("add_sub", _add_sub_inputs(grpcclient), request_id="r-grpc",
                   headers={"traceparent": TRACEPARENT})  # fmt: skip
        bad = httpclient.InferInput("INPUT0", [1, 3], "FP32")
        bad.set_data_from_numpy(np.ones((1, 3), np.float32))
        with pytest.raises(InferenceServerException):
            http.infer("add_sub", [bad, _add_sub_inputs(httpclient)[1]], request_id="r-bad")
    finally:
        http.close()
        grpc.close()
    spans = _requests(collector.wait(3))
    for request_id, protocol in (("r-http", "http"), ("r-grpc", "grpc")):
        span = spans[request_id]
        assert span.name == "InferRequest" and _child_of_the_caller(span), span
        assert span.kind == span.SPAN_KIND_SERVER
        attributes = _attributes(span)
        assert attributes["triton.model_name"] == "add_sub"
        assert attributes["triton.model_version"] == "1"
        assert attributes["slipstream.protocol"] == protocol
        assert span.status.code != span.status.STATUS_CODE_ERROR
        assert span.end_time_unix_nano > span.start_time_unix_nano
    failed = spans["r-bad"]
    assert failed.status.code == failed.status.STATUS_CODE_ERROR
    assert "INPUT0" in failed.status.message
    assert _attributes(failed)["error.type"] == "InvalidRequest"
    assert failed.parent_span_id == b""  # no traceparent: a trace of its own


def test_an_openai_chat_is_a_span_with_its_model_and_token_usage(
    traced: tuple[RemoteServer, Collector],
) -> None:
    server, collector = traced
    body = {"model": LLM, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi"}]}  # fmt: skip
    answer = server.http.post("/v1/chat/completions", json=body,
                              headers={"traceparent": TRACEPARENT}, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    streamed = server.http.post("/v1/chat/completions", json={**body, "stream": True},
                                timeout=60)  # fmt: skip
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    spans = sorted(collector.wait(2), key=lambda span: span.start_time_unix_nano)
    whole, stream = spans
    assert whole.name == stream.name == "POST /v1/chat/completions"
    assert _child_of_the_caller(whole)
    attributes = _attributes(whole)
    assert attributes["gen_ai.request.model"] == LLM
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["http.response.status_code"] == 200
    usage = answer.json()["usage"]
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert [event.name for event in stream.events] == ["FIRST_CHUNK"]
    # The stream's span ends with its last chunk, not when the response starts.
    assert stream.end_time_unix_nano > stream.events[0].time_unix_nano


def test_triton_trace_settings_decide_what_is_traced(
    traced: tuple[RemoteServer, Collector],
) -> None:
    server, collector = traced
    http = httpclient.InferenceServerClient(server.http_address)
    try:
        assert http.get_trace_settings()["trace_mode"] == "opentelemetry"
        assert http.get_trace_settings()["trace_level"] == ["TIMESTAMPS"]
        http.update_trace_settings("add_sub", {"trace_level": ["OFF"]})
        http.infer("add_sub", _add_sub_inputs(httpclient), request_id="off")
        # add_sub's own settings: one request in 2, then 2 traces at most.
        http.update_trace_settings(
            "add_sub", {"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "2"}
        )
        for index in range(8):
            http.infer("add_sub", _add_sub_inputs(httpclient), request_id=f"n{index}")
        with pytest.raises(InferenceServerException):
            http.update_trace_settings(settings={"trace_level": ["TENSORS"]})
        http.update_trace_settings("add_sub", {"trace_level": None, "trace_rate": None,
                                               "trace_count": None})  # fmt: skip
        http.infer("add_sub", _add_sub_inputs(httpclient), request_id="global-again")
    finally:
        http.close()
    traced_ids = sorted(_requests(collector.wait(3)))
    assert traced_ids == ["global-again", "n0", "n2"]


def _decoupled_inputs(model: str) -> list[Any]:
    """A request that streams: three answers from repeat, two tokens' text from the LLM."""
    if model == REPEAT:
        values = {"N": (np.array([3], dtype=np.int32), "INT32")}
    else:
        values = {
            "text_input": (np.array([b"Hello"], dtype=object), "BYTES"),
            "stream": (np.array([True]), "BOOL"),
            "sampling_parameters": (np.array([json.dumps({"max_tokens": 2}).encode()],
                                             dtype=object), "BYTES"),
        }  # fmt: skip
    tensors = []
    for name, (array, datatype) in values.items():
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("model", [REPEAT, LLM])
def test_a_decoupled_model_s_streamed_request_is_one_span_and_one_count(
    traced: tuple[RemoteServer, Collector], model: str
) -> None:
    """On gRPC ModelStreamInfer a decoupled model's request goes straight to its stream
    of answers: one InferRequest span each, none failed, and trace_count 2 of 3 requests
    traces the first two (the third's span never comes)."""
    server, collector = traced
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        http.update_trace_settings(model, {"trace_rate": "1", "trace_count": "2"})
        grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
        for index in range(3):
            grpc.async_stream_infer(model, _decoupled_inputs(model), request_id=f"d{index}",
                                    enable_empty_final_response=True)  # fmt: skip
        finals: list[str] = []
        while len(finals) < 3:
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals.append(response.id)
        grpc.stop_stream()
        spans = collector.wait(2)
        # A request after them: the spans still to come are its own.
        http.infer("add_sub", _add_sub_inputs(httpclient), request_id="after")
        later = collector.wait(1)
    finally:
        http.update_trace_settings(model, {"trace_rate": None, "trace_count": None})
        http.close()
        grpc.close()
    assert sorted(finals) == ["d0", "d1", "d2"]
    requests = [span for span in spans if span.name == "InferRequest"]
    assert sorted(_attributes(span)["slipstream.request_id"] for span in requests) == ["d0", "d1"]
    for span in requests:
        assert span.status.code != span.status.STATUS_CODE_ERROR, span.status.message
        assert _attributes(span)["triton.model_name"] == model
        assert [event.name for event in span.events][:1] == ["FIRST_RESPONSE"]
    assert [_attributes(span)["slipstream.request_id"] for span in later
            if span.name == "InferRequest"] == ["after"]  # fmt: skip


def test_a_v2_inference_s_span_holds_triton_s_timestamps_over_http_and_grpc_unary_and_streaming(
    traced: tuple[RemoteServer, Collector],
) -> None:
    """Under each request's span, a model span and its compute span, with Triton's
    TIMESTAMPS events in the order they happened (the engine's, split); a request that
    fails before reaching a model has neither."""
    server, collector = traced
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    streamed: list[Any] = []
    try:
        http.infer("add_sub", _add_sub_inputs(httpclient), request_id="t-http")
        grpc.infer("add_sub", _add_sub_inputs(grpcclient), request_id="t-grpc")
        grpc.start_stream(callback=lambda result, error: streamed.append(error or result))
        grpc.async_stream_infer("add_sub", _add_sub_inputs(grpcclient), request_id="t-stream")
        grpc.stop_stream()  # after the stream's answers
        body = {"id": "t-sse", "INPUT0": [1.0] * ADD_SUB_WIDTH, "INPUT1": [2.0] * ADD_SUB_WIDTH}
        sse = server.http.post("/v2/models/add_sub/generate_stream", json=body, timeout=30)
        with pytest.raises(InferenceServerException):
            http.infer("add_sub", [_add_sub_inputs(httpclient)[0]], request_id="t-bad")
    finally:
        http.close()
        grpc.close()
    assert len(streamed) == 1 and not isinstance(streamed[0], InferenceServerException)
    assert sse.status_code == 200 and "OUTPUT0" in sse.text, sse.text
    spans = collector.wait(5)
    requests = _requests(spans)
    for request_id in ("t-http", "t-grpc", "t-stream", "t-sse"):
        _model_and_compute(spans, requests[request_id], "add_sub")
    assert _children(spans, requests["t-bad"]) == []


def test_a_request_held_in_the_queue_shows_its_queue_time(
    traced: tuple[RemoteServer, Collector],
) -> None:
    """A lone request on a model with a queue delay waits it out for company: its time
    between QUEUE_START and COMPUTE_START, not in its compute span."""
    server, collector = traced
    http = httpclient.InferenceServerClient(server.http_address)
    try:
        inputs = _add_sub_inputs(httpclient)
        http.infer(DELAYED, inputs, request_id="held", headers={"traceparent": TRACEPARENT})
    finally:
        http.close()
    spans = collector.wait(1)
    request = _requests(spans)["held"]
    assert _child_of_the_caller(request)
    span, compute = _model_and_compute(spans, request, DELAYED)
    queued_ns = _events(compute)["COMPUTE_START"] - _events(span)["QUEUE_START"]
    computed_ns = compute.end_time_unix_nano - compute.start_time_unix_nano
    assert queued_ns >= 0.8 * QUEUE_DELAY_US * 1000, queued_ns
    assert computed_ns < queued_ns / 3, (computed_ns, queued_ns)


def test_an_ensemble_s_steps_are_model_spans_of_their_own(
    traced: tuple[RemoteServer, Collector],
) -> None:
    """As Triton traces an ensemble: its model span, and under it a model span (with its
    compute span) per step; the second step queued once the first was done."""
    server, collector = traced
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        inputs = [grpcclient.InferInput(name, [1, ADD_SUB_WIDTH], "FP32") for name in "AB"]
        for tensor, value in zip(inputs, (3.0, 1.0), strict=True):
            tensor.set_data_from_numpy(np.full((1, ADD_SUB_WIDTH), value, np.float32))
        answer = client.infer(PIPELINE, inputs, request_id="ensemble")
    finally:
        client.close()
    np.testing.assert_array_equal(answer.as_numpy("SUM_OF_BOTH"), np.full((1, 16), 6.0))
    spans = collector.wait(1)
    (ensemble,) = _children(spans, _requests(spans)["ensemble"])
    assert ensemble.name == PIPELINE
    assert [event.name for event in ensemble.events] == ["REQUEST_START", "REQUEST_END"]
    first, second = _children(spans, ensemble)
    computes = []
    for step in (first, second):
        assert step.name == "add_sub" and [e.name for e in step.events] == MODEL_EVENTS
        (compute,) = _children(spans, step)
        assert [event.name for event in compute.events] == COMPUTE_EVENTS
        computes.append(compute)
        assert ensemble.start_time_unix_nano <= step.start_time_unix_nano
        assert step.end_time_unix_nano <= ensemble.end_time_unix_nano
    assert computes[0].end_time_unix_nano <= _events(second)["QUEUE_START"]


def test_a_bad_trace_config_stops_the_start_naming_it(tmp_path: Path) -> None:
    """(Each entry's refusal is tests/unit/test_trace_config.py's: here, the option's.)"""
    build_add_sub(tmp_path)
    command = [*slipstream_command(), "serve", "--model-repository", str(tmp_path),
               "--trace-config", "mode=triton", "--http-port", "0", "--grpc-port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--trace-config" in done.stderr and "only mode=opentelemetry" in done.stderr
