"""Request tracing (``--trace-config mode=opentelemetry``) as a collector receives it: the
server's spans, exported over OTLP/HTTP by OpenTelemetry's own exporter, are read here by
a receiver that parses OTLP's protobuf (OpenTelemetry's own messages). V2 inference over
HTTP and gRPC and an OpenAI chat completion, in one process and split; each span a child
of the caller's ``traceparent``; Triton's trace settings deciding what is traced.
"""

from __future__ import annotations

import os
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
from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config
from tests.utils import RemoteServer, slipstream_command

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LLM = "smollm2"


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
        """The spans once at least ``count`` have come (then those that come with them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.spans) >= count:
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
    (repo / LLM / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / LLM / "1" / "model.gguf")
    write_config(repo, LLM, {"backend": "llama_cpp", "generation": {
        "max_model_len": 256, "max_num_seqs": 2, "threads": 1}})  # fmt: skip
    collector = Collector()
    args = ["--trace-config", "mode=opentelemetry", "--trace-config", "rate=1",
            "--trace-config", f"opentelemetry,url={collector.url}",
            "--trace-config", "opentelemetry,resource=deployment=test",
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
    spans = {_attributes(s)["slipstream.request_id"]: s for s in collector.wait(3)}
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
    traced_ids = sorted(_attributes(span)["slipstream.request_id"] for span in collector.wait(3))
    assert traced_ids == ["global-again", "n0", "n2"]


def test_a_bad_trace_config_stops_the_start_naming_it(tmp_path: Path) -> None:
    """(Each entry's refusal is tests/unit/test_trace_config.py's: here, the option's.)"""
    build_add_sub(tmp_path)
    command = [*slipstream_command(), "serve", "--model-repository", str(tmp_path),
               "--trace-config", "mode=triton", "--http-port", "0", "--grpc-port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--trace-config" in done.stderr and "only mode=opentelemetry" in done.stderr
