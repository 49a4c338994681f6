"""``slipstream serve --frontends 2`` owns its ports: a second server started on them fails
"address already in use" with exit code 1, as a one-process server does, instead of
binding beside the first through SO_REUSEPORT and taking half of its connections.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.models import build_add_constant
from tests.utils import HOST, RemoteServer, slipstream_command

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("split_ports")
    build_add_constant(root / "a", "plus", 1, 1.0)
    with RemoteServer(root / "a", ["--frontends", "2"], log_dir=root) as running:
        yield running


def _serve_on_ports_of(
    first: RemoteServer, repository: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*slipstream_command(), "serve", "--model-repository", str(repository),
         "--host", HOST, "--http-port", str(first.http_port),
         "--grpc-port", str(first.grpc_port), *args],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def _every_request_reaches(first: RemoteServer) -> None:
    """Fresh connections, so the kernel would spread them over every listener."""
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                        "data": [1.0, 2.0, 3.0, 4.0]}]}  # fmt: skip
    for _ in range(24):
        with httpx.Client(timeout=10) as http:
            answer = http.post(first.url("/v2/models/plus/infer"), json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("layout", [["--frontends", "2"], []], ids=["split", "one-process"])
def test_a_second_server_on_the_ports_of_a_split_server_exits_1_naming_the_port(
    first: RemoteServer, tmp_path: Path, layout: list[str]
) -> None:
    build_add_constant(tmp_path / "b", "other", 1, 5.0)
    second = _serve_on_ports_of(first, tmp_path / "b", *layout)
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"could not bind {HOST}:{first.http_port}" in second.stderr, second.stderr[-3000:]
    assert "address already in use" in second.stderr.lower()
    assert "listening" not in second.stderr, second.stderr[-3000:]
    _every_request_reaches(first)


def test_the_grpc_port_alone_taken_is_named(first: RemoteServer, tmp_path: Path) -> None:
    build_add_constant(tmp_path / "b", "other", 1, 5.0)
    second = subprocess.run(
        [*slipstream_command(), "serve", "--model-repository", str(tmp_path / "b"),
         "--host", HOST, "--http-port", "0", "--grpc-port", str(first.grpc_port),
         "--frontends", "2"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"gRPC server could not bind {HOST}:{first.grpc_port}" in second.stderr
    assert "--grpc-port" in second.stderr
    _every_request_reaches(first)
