"""The ``slipstream`` command as a user runs it: help, argument errors, serve and stop."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.utils import RemoteServer, slipstream_command

SERVE_OPTIONS = [
    "--model-repository",
    "--host",
    "--http-port",
    "--grpc-port",
    "--model-control-mode",
    "--load-model",
    "--repository-poll-secs",
    "--max-request-bytes",
    "--max-buffered-body-bytes",
    "--shutdown-timeout-s",
    "--max-header-bytes",
    "--max-header-count",
    "--header-timeout-s",
    "--body-timeout-s",
    "--min-body-rate-bytes-s",
    "--send-timeout-s",
    "--keep-alive-timeout-s",
    "--max-connections",
    "--grpc-max-message-bytes",
    "--grpc-max-concurrent-streams",
    "--no-strict-readiness",
    "--log-level",
]


def run_cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*slipstream_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_help_lists_the_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout
    assert "Usage:" in result.stdout


def test_version() -> None:
    from slipstream import __version__

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert __version__ in result.stdout


def test_serve_help_lists_every_option_with_its_default() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    for option in SERVE_OPTIONS:
        assert option in result.stdout, f"{option} missing from serve --help"
    assert "none|explicit|poll" in result.stdout
    assert "[default: 8000]" in result.stdout  # defaults come from the settings model


def test_missing_repository_exits_non_zero_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_repo"
    result = run_cli("serve", "--model-repository", str(missing), "--http-port", "0")
    assert result.returncode != 0
    assert str(missing) in result.stderr
    assert "--model-repository" in result.stderr
    assert "Traceback" not in result.stderr


def test_repository_option_is_required() -> None:
    result = run_cli("serve")
    assert result.returncode != 0
    assert "--model-repository" in result.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model-control-mode", "sometimes"], "--model-control-mode"),
        (["--http-port", "eighty"], "--http-port"),
        (["--http-port", "70000"], "--http-port: "),
        (["--max-request-bytes", "10"], "--max-request-bytes: "),
        (["--load-model", "../up"], "--load-model: '../up' contains '/'"),
        (["--tls-cert", "cert.pem"], "Error: --tls-cert and --tls-key go together"),
        (["--log-level", "loud"], "--log-level"),
        (["--frontends", "-1"], "--frontends: "),
        (["--frontends", "2", "--ray"], "--frontends"),
        (["--engines", "per-device", "--ray"], "--engines"),
        (["--engines", "per-gpu"], "--engines"),
    ],
)
def test_invalid_option_values_exit_non_zero_naming_the_option(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    result = run_cli("serve", "--model-repository", str(tmp_path), *args)
    assert result.returncode != 0
    assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    # Named by its flag, never by the settings field behind it.
    assert "_" not in result.stderr.split("Error:")[-1].split(":")[0], result.stderr


@pytest.mark.parametrize(
    "layout",
    [[], ["--frontends", "1"], ["--engines", "per-device"]],
    ids=["one-process", "split", "per-device"],
)
def test_serve_an_empty_repository_and_stop_on_sigint(tmp_path: Path, layout: list[str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    with RemoteServer(repo, layout, log_dir=tmp_path) as server:
        assert httpx.get(server.url("/v2/health/ready"), timeout=10).status_code == 200
        if "--engines" in layout:  # one front end and, with no model, the CPU's engine
            log = server.log_text()
            assert "split layout: 1 front-end processes, engine cpu" in log, log
        index = httpx.post(server.url("/v2/repository/index"), timeout=10).json()
        assert index == []
        assert server.proc is not None
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C: the same graceful stop as SIGTERM
        assert server.wait() == 0, server.log_tail()


@pytest.mark.parametrize("layout", [[], ["--frontends", "2"]], ids=["one-process", "split"])
def test_a_port_in_use_stops_the_server_naming_it(tmp_path: Path, layout: list[str]) -> None:
    """A front end that cannot listen is not started again and again: the server exits 1
    and says which port, as one process does."""
    (tmp_path / "repo").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "serve", "--model-repository", str(tmp_path / "repo"), "--host", "127.0.0.1",
            "--http-port", str(port), "--grpc-port", "0", *layout,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"could not bind 127.0.0.1:{port}" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("layout", [["--frontends", "1"], ["--engines", "per-device"]])
def test_an_engine_that_cannot_start_stops_the_server_saying_why(
    tmp_path: Path, layout: list[str]
) -> None:
    """A model named to load that is not in the repository: the engine cannot start, and
    the server exits 1 saying why and with which exit code the engine stopped."""
    (tmp_path / "repo").mkdir()
    result = run_cli(
        "serve", "--model-repository", str(tmp_path / "repo"), "--host", "127.0.0.1",
        "--http-port", "0", "--grpc-port", "0", "--model-control-mode", "explicit",
        "--load-model", "nope", *layout,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "model 'nope' is not in the repository" in result.stderr, result.stderr[-2000:]
    assert re.search(r"engine( cpu)? exited \(code 1\) before it was ready", result.stderr)


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        (["profile", "{model}"], "model.onnx: onnxruntime cannot load it"),
        (["optimize", "--model", "{model}", "--repository", "{tmp}/out", "--name", "n",
          "--passes", "graph", "--validation", "{tmp}/val.npz"], "not a readable ONNX model"),
        (["export", "build", "--target", "edge", "{tmp}/repo/bad", "-o", "{tmp}/bundle",
          "--validation", "{tmp}/val.npz"], "not a readable ONNX model"),
    ],
    ids=["profile", "optimize", "export"],
)  # fmt: skip
def test_a_file_that_is_not_a_model_is_an_error_naming_it_not_a_traceback(
    tmp_path: Path, command: list[str], fragment: str
) -> None:
    """Found 2026-11-28: each of these printed protobuf's or ONNX Runtime's traceback."""
    model = tmp_path / "repo" / "bad" / "1" / "model.onnx"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"not a model\n")
    np.savez(tmp_path / "val.npz", x=np.zeros((4, 3), np.float32))
    args = [part.format(model=model, tmp=tmp_path) for part in command]
    result = run_cli(*args, timeout_s=120)
    assert result.returncode != 0
    assert fragment in result.stdout + result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
