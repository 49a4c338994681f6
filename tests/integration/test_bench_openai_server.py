"""``slipstream bench`` in OpenAI mode against a real ``slipstream serve`` running a tiny
random-weight Llama: the Python API and the CLI, chat and completions, closed and open
loop, and errors counted by status.

Runs are a few requests of a few tokens (the tiny model decodes ~10-20 tokens/s on this
machine), so each takes a second or two. With ``ignore_eos`` every response must carry
exactly max_tokens tokens, which ties the client's counts to the server's.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from slipstream.bench.cli import bench
from slipstream.bench.openai.results import OpenAILevelResult
from slipstream.bench.openai.runner import run_openai_benchmark
from tests.llm_models import build_tiny_llama
from tests.utils import RemoteServer

# Slow: the whole module runs in `make test`, not in `make test-fast`.
pytestmark = pytest.mark.slow

GENERATION_CONFIG = "backend: transformers\ngeneration:\n  num_blocks: 64\n  block_size: 16\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("bench_openai")
    build_tiny_llama(repo / "tiny" / "1")
    (repo / "tiny" / "config.yaml").write_text(GENERATION_CONFIG)
    with RemoteServer(repo, log_dir=repo) as remote:
        yield remote


def _run(*args: str) -> Result:
    return CliRunner().invoke(bench, list(args), catch_exceptions=False)


def _check_consistent(level: OpenAILevelResult, max_in_flight: int) -> None:
    """Every request succeeded, with exactly its max_tokens, and the figures agree."""
    assert level.errors == 0 and level.requests == len(level.request_results)
    for request in level.request_results:
        assert request.error is None and request.usage_reported
        assert request.output_tokens == request.max_tokens
        assert request.prompt_tokens is not None and request.prompt_tokens > 0
        assert request.ttft_s is not None and request.e2e_s is not None
        assert 0 < request.ttft_s <= request.e2e_s
        # A chunk per token at most (the server may hold back split UTF-8 characters).
        assert len(request.itl_s) + 1 <= request.output_tokens
        assert sum(request.itl_s) <= request.e2e_s - request.ttft_s
        tpot = request.tpot_s
        assert tpot == pytest.approx((request.e2e_s - request.ttft_s) / (request.output_tokens - 1))
    assert level.output_tokens == sum(r.max_tokens for r in level.request_results)
    assert level.output_throughput_tok_per_s == pytest.approx(
        level.output_tokens / level.duration_s
    )
    assert level.request_throughput_per_s == pytest.approx(level.requests / level.duration_s)
    assert level.duration_s >= max(r.e2e_s or 0 for r in level.request_results)
    assert 1 <= level.peak_inflight <= max_in_flight
    for summary in (level.ttft, level.tpot, level.itl, level.e2e):
        figures = [summary.p50_ms, summary.p90_ms, summary.p99_ms, summary.max_ms]
        assert all(f is not None and f > 0 for f in figures) and figures == sorted(figures)
        assert summary.mean_ms is not None and summary.mean_ms > 0
    assert (level.ttft.max_ms or 0) <= (level.e2e.max_ms or 0)
    assert level.warnings == []


def test_api_closed_loop_chat_counts_every_token(server: RemoteServer) -> None:
    result = run_openai_benchmark(
        server.http_url, "tiny", concurrency=[2], num_requests=4, prompt_tokens=8,
        output_tokens="5,1", ignore_eos=True, goodput_ms={"ttft": 60_000, "tpot": 60_000},
    )  # fmt: skip
    [level] = result.levels
    assert (result.protocol, result.distribution, level.concurrency) == ("openai-chat", None, 2)
    # The warm-up's first token, measured but in no level.
    assert result.probe_ttft_ms is not None and result.probe_ttft_ms > 0
    assert {r.max_tokens for r in level.request_results} <= {4, 5, 6}
    _check_consistent(level, max_in_flight=2)
    # SLOs of a minute: every request is good.
    assert level.good_requests == 4
    assert level.goodput_req_per_s == pytest.approx(level.request_throughput_per_s)


def test_cli_open_loop_completions_writes_json_and_csv(
    server: RemoteServer, tmp_path: Path
) -> None:
    out, table = tmp_path / "llm.json", tmp_path / "llm.csv"
    result = _run(
        server.http_url, "-m", "tiny", "--protocol", "openai-completions",
        "--request-rate", "8", "--num-requests", "4", "--prompt-tokens", "6,2",
        "--output-tokens", "4", "--ignore-eos", "--goodput", "ttft:0.001 e2el:60000",
        "--seed", "7", "--json", str(out), "--csv", str(table),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for text in ("output tok/s", "goodput req/s", "TTFT", "TPOT", "ITL", "E2E"):
        assert text in result.output
    data: dict[str, Any] = json.loads(out.read_text())
    assert data["distribution"] == "poisson" and data["goodput_slos_ms"]["ttft"] == 0.001
    [level] = data["levels"]
    assert level["request_rate"] == 8 and level["errors"] == 0
    assert [r["output_tokens"] for r in level["request_results"]] == [4] * 4
    assert level["output_tokens"] == 16
    # No first token comes within a microsecond: goodput is 0.
    assert level["good_requests"] == 0 and level["goodput_req_per_s"] == 0
    assert level["send_rate_per_s"] > 0
    for request in level["request_results"]:
        assert request["ttft_s"] <= request["e2e_s"]
    with table.open() as file:
        [row] = list(csv.DictReader(file))
    assert int(row["output_tokens"]) == 16
    assert float(row["e2e_p50_ms"]) == pytest.approx(level["e2e"]["p50_ms"])


def test_requests_the_server_refuses_are_counted_by_status(
    server: RemoteServer, tmp_path: Path
) -> None:
    # The warm-up asks for 4 tokens and passes; 1,000 tokens exceed the model's
    # 512-token context, so the server answers each real request 400.
    out = tmp_path / "refused.json"
    result = _run(
        server.http_url, "-m", "tiny", "--protocol", "openai-chat", "--concurrency", "2",
        "--num-requests", "3", "--prompt-tokens", "8", "--output-tokens", "1000",
        "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 1 and "every request failed" in result.output
    [level] = json.loads(out.read_text())["levels"]
    assert level["errors_by_code"] == {"http 400": 3} and level["requests"] == 0
    assert "context length" in level["error_examples"]["http 400"]


def test_a_failed_warm_up_stops_the_run_with_the_servers_message(server: RemoteServer) -> None:
    result = _run(server.http_url, "-m", "nope", "--protocol", "openai-chat")
    assert result.exit_code == 1
    assert "http 404" in result.output and "check --model" in result.output
    # The default 256-token prompt is ~900 tokens in the tiny model's 400-word vocabulary.
    result = _run(server.http_url, "-m", "tiny", "--protocol", "openai-completions")
    assert result.exit_code == 1
    assert "http 400" in result.output and "context length of 512" in result.output
