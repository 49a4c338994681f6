"""``slipstream bench`` against a real ``slipstream serve``: every protocol in closed and
open loop, the output files, error counting and the exit codes users script against.

The model is add_sub (two FP32 [-1, 16] inputs, max_batch_size 64 completed from the
file). Errors are injected honestly: an ``--input-data`` file whose every fourth request
has a batch of 65, which the server refuses (400 / INVALID_ARGUMENT) as over its
max_batch_size. Levels are short (0.6 s measured) so each run takes a few seconds.
"""

from __future__ import annotations

import base64
import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner, Result

from slipstream.bench.cli import bench
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer, free_ports

# Slow: the whole module runs in `make test`, not in `make test-fast`.
pytestmark = pytest.mark.slow

SHORT = ["--warmup-s", "0.1", "--window-s", "0.3", "--duration", "0.6"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("bench_models")
    build_add_sub(repo)
    with RemoteServer(repo, log_dir=repo) as remote:
        yield remote


def _url(server: RemoteServer, protocol: str) -> str:
    return server.grpc_address if protocol == "grpc" else server.http_url


def _run(*args: str) -> Result:
    return CliRunner().invoke(bench, list(args), catch_exceptions=False)


def _levels(path: Path) -> list[dict[str, Any]]:
    levels: list[dict[str, Any]] = json.loads(path.read_text())["levels"]
    return levels


def _check_latencies(level: dict[str, Any]) -> None:
    figures = [level[k] for k in ("p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms")]
    assert all(f is not None and f > 0 for f in figures), level
    assert figures == sorted(figures)
    assert 0 < level["avg_ms"] <= level["max_ms"]


@pytest.mark.parametrize("protocol", ["http", "http-binary", "grpc"])
def test_closed_loop_sweep_over_each_protocol(
    server: RemoteServer, protocol: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    result = _run(
        _url(server, protocol), "-m", "add_sub", "--protocol", protocol,
        "--concurrency", "1,4", "--batch-size", "2", "--json", str(out), *SHORT,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    levels = _levels(out)
    assert [level["concurrency"] for level in levels] == [1, 4]
    for level in levels:
        assert level["errors"] == 0 and level["requests"] > 20
        assert level["inferences"] == 2 * level["requests"]
        assert level["throughput_infer_per_s"] == pytest.approx(2 * level["throughput_req_per_s"])
        _check_latencies(level)
        # Slipstream offers the statistics extension over both HTTP and gRPC.
        assert level["server_compute_infer_ms"] > 0
        # The client's average latency minus the server's queue and compute time.
        server_ms = sum(
            level[f"server_{part}_ms"]
            for part in ("queue", "compute_input", "compute_infer", "compute_output")
        )
        assert level["server_overhead_ms"] == pytest.approx(level["avg_ms"] - server_ms)
        assert level["client_cpu_pct"] > 0
    assert "concurrency" in result.output and "infer/s" in result.output


@pytest.mark.parametrize("protocol", ["http", "http-binary", "grpc"])
def test_open_loop_sends_at_the_asked_rate_over_each_protocol(
    server: RemoteServer, protocol: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    result = _run(
        _url(server, protocol), "-m", "add_sub", "--protocol", protocol,
        "--request-rate", "150", "--distribution", "poisson", "--json", str(out), *SHORT,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [level] = _levels(out)
    assert level["request_rate"] == 150 and level["concurrency"] is None
    assert level["errors"] == 0
    # Poisson arrivals over 0.6 s: ~90 sends, a standard deviation of ~10%.
    assert level["send_rate_per_s"] == pytest.approx(150, rel=0.35)
    assert level["throughput_req_per_s"] == pytest.approx(level["send_rate_per_s"], rel=0.15)
    _check_latencies(level)


def test_without_duration_windows_run_until_stable(server: RemoteServer, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = _run(
        server.http_url, "-m", "add_sub", "--concurrency", "2", "--warmup-s", "0.2",
        "--window-s", "0.25", "--max-windows", "4", "--stability-pct", "50", "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [level] = _levels(out)
    # Figures are over the last 3 windows; a 50% tolerance settles at once on a quiet
    # machine, and at most 4 windows are measured either way.
    assert level["windows"] == 3
    assert 3 <= level["windows_measured"] <= 4
    if level["stable"]:
        assert not any("not stable" in w for w in level["warnings"])
    else:
        assert level["windows_measured"] == 4
        assert any("not stable" in w for w in level["warnings"])


def test_json_csv_and_html_reports_are_written_and_parse(
    server: RemoteServer, tmp_path: Path
) -> None:
    assert server.proc is not None
    paths = {name: tmp_path / f"out.{name}" for name in ("json", "csv", "html", "png")}
    result = _run(
        server.http_url, "-m", "add_sub", "--concurrency", "1,2",
        "--server-pid", str(server.proc.pid), "--price-per-hour", "0.17",
        "--json", str(paths["json"]), "--csv", str(paths["csv"]),
        "--report", str(paths["html"]), *SHORT,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    levels = _levels(paths["json"])
    for level in levels:
        assert level["server_cpu_pct"] > 0 and level["server_rss_mb"] > 10
        assert level["cost_per_1m_infer"] == pytest.approx(
            0.17 / (level["throughput_infer_per_s"] * 3600) * 1e6
        )
    with paths["csv"].open() as rows:
        table = list(csv.DictReader(rows))
    assert [int(row["concurrency"]) for row in table] == [1, 2]
    for row, level in zip(table, levels, strict=True):
        assert float(row["p99_ms"]) == pytest.approx(level["p99_ms"])
        assert float(row["throughput_infer_per_s"]) == pytest.approx(
            level["throughput_infer_per_s"]
        )
    page = paths["html"].read_text()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3
    assert all(base64.b64decode(image).startswith(PNG_MAGIC) for image in images)

    result = _run(
        server.http_url, "-m", "add_sub", "--request-rate", "100",
        "--report", str(paths["png"]), *SHORT,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert paths["png"].read_bytes().startswith(PNG_MAGIC)


def _mixed_requests(path: Path, good: int, oversized: int) -> Path:
    def request(batch: int) -> dict[str, Any]:
        tensor = {
            "shape": [batch, ADD_SUB_WIDTH],
            "datatype": "FP32",
            "data": [0.5] * (batch * ADD_SUB_WIDTH),
        }
        return {"inputs": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}]}

    path.write_bytes(orjson.dumps([request(1)] * good + [request(65)] * oversized))
    return path


@pytest.mark.parametrize(
    ("protocol", "error_key"), [("http", "http 400"), ("grpc", "grpc INVALID_ARGUMENT")]
)
def test_refused_requests_are_counted_by_code(
    server: RemoteServer, protocol: str, error_key: str, tmp_path: Path
) -> None:
    inputs = _mixed_requests(tmp_path / "requests.json", good=3, oversized=1)
    out = tmp_path / "result.json"
    result = _run(
        _url(server, protocol), "-m", "add_sub", "--protocol", protocol,
        "--input-data", str(inputs), "--concurrency", "2", "--json", str(out), *SHORT,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [level] = _levels(out)
    assert level["errors_by_code"].keys() == {error_key}
    # Each virtual user sends the four requests in turn: one in four is refused.
    share = level["errors"] / (level["errors"] + level["requests"])
    assert share == pytest.approx(0.25, abs=0.05)
    assert "max_batch_size" in level["error_examples"][error_key]
    assert error_key in result.output


def test_every_request_failing_exits_non_zero_after_writing_the_results(
    server: RemoteServer, tmp_path: Path
) -> None:
    inputs = _mixed_requests(tmp_path / "requests.json", good=0, oversized=1)
    out = tmp_path / "result.json"
    result = _run(
        server.http_url, "-m", "add_sub", "--input-data", str(inputs),
        "--concurrency", "1", "--json", str(out), *SHORT,
    )  # fmt: skip
    assert result.exit_code == 1
    assert "every request failed" in result.output
    [level] = _levels(out)
    assert level["requests"] == 0 and level["errors_by_code"]["http 400"] > 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_unreachable_server_exits_non_zero_with_a_clear_message(protocol: str) -> None:
    [port] = free_ports(1)
    url = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
    result = _run(url, "-m", "add_sub", "--protocol", protocol, *SHORT)
    assert result.exit_code == 1
    assert "cannot reach the server" in result.output
    assert f"--protocol {protocol}" in result.output


def test_an_unknown_model_and_bad_options_are_refused(server: RemoteServer) -> None:
    result = _run(server.http_url, "-m", "nope", *SHORT)
    assert result.exit_code == 1 and "check --model" in result.output
    result = _run(server.http_url, "-m", "add_sub", "--concurrency", "1", "--request-rate", "5")
    assert result.exit_code == 2 and "not both" in result.output
    result = _run(server.http_url, "-m", "add_sub", "--batch-size", "100", *SHORT)
    assert result.exit_code == 1 and "max_batch_size 64" in result.output
