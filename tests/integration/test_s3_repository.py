"""A model repository in S3, as Triton serves one (``--model-repository
s3://host:port/bucket/path``): served in one process and split, followed in poll mode
(a version added, a model removed), refused with the cause when it cannot be read, and
never written outside its copy whatever the object keys say.

The store is moto's S3 server on a loopback port (the S3 API over HTTP, as MinIO speaks
it); the server under test reaches it with boto3, as it would AWS.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gated import wait_until
from tests.models import (
    assert_add_sub_answers,
    build_add_constant,
    build_add_sub,
)
from tests.utils import RemoteServer, slipstream_command

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

BUCKET = "models"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "slipstream-test",
    "AWS_SECRET_ACCESS_KEY": "slipstream-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    """``host:port`` of an S3 server with an empty bucket ``models``."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    address = f"{host}:{port}"
    _client(address).create_bucket(Bucket=BUCKET)
    yield address
    server.stop()


def _client(address: str) -> Any:
    keys = {"aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}  # fmt: skip
    return boto3.client("s3", endpoint_url=f"http://{address}", region_name="us-east-1", **keys)


def _upload(address: str, local: Path, prefix: str) -> None:
    client = _client(address)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local).as_posix()}")


def _delete(address: str, prefix: str) -> None:
    client = _client(address)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    for item in listed:
        client.delete_object(Bucket=BUCKET, Key=item["Key"])


@pytest.mark.parametrize("layout", [[], ["--frontends", "1"]], ids=["one-process", "split"])
def test_an_s3_repository_is_served_as_a_directory_would_be(
    store: str, tmp_path: Path, layout: list[str]
) -> None:
    local = tmp_path / "local"
    model_file = build_add_sub(local)
    prefix = f"served-{len(layout)}"
    _upload(store, local, prefix)
    # A key that would land outside the copy: left out (and logged), never written.
    _client(store).put_object(Bucket=BUCKET, Key=f"{prefix}/../escaped.txt", Body=b"no")
    cache = tmp_path / "cache"
    url = f"s3://{store}/{BUCKET}/{prefix}"
    args = ["--repository-cache", str(cache), *layout]
    with RemoteServer(url, args, log_dir=tmp_path, env=CREDENTIALS) as server:
        assert_add_sub_answers(server.http_address, model_file)
        index = server.http.post("/v2/repository/index", json={}).json()
        assert [(e["name"], e["state"]) for e in index] == [("add_sub", "READY")]
    assert (cache / "repository" / "add_sub" / "1" / "model.onnx").read_bytes() == (
        model_file.read_bytes()
    )
    assert not list(tmp_path.rglob("escaped.txt"))
    assert "left out: its key leaves the repository" in server.log_path.read_text()


def test_poll_mode_follows_the_bucket(store: str, tmp_path: Path) -> None:
    """A version uploaded is loaded once it settles; a model deleted is unloaded."""
    local = tmp_path / "local"
    build_add_constant(local, "plus", 1, 1.0)
    model_file = build_add_sub(local)
    _upload(store, local, "polled")
    url = f"s3://{store}/{BUCKET}/polled"
    args = ["--model-control-mode", "poll", "--repository-poll-secs", "0.3"]
    with RemoteServer(url, args, log_dir=tmp_path, env=CREDENTIALS) as server:
        assert_add_sub_answers(server.http_address, model_file)
        build_add_constant(tmp_path / "v2", "plus", 2, 2.0)
        _upload(store, tmp_path / "v2", "polled")

        def served_versions() -> list[str]:
            answer = server.http.get("/v2/models/plus")
            return list(answer.json().get("versions", [])) if answer.status_code == 200 else []

        wait_until(lambda: "2" in served_versions(), "version 2 of plus to be served", 60)
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                            "data": [1.0] * 4}]}  # fmt: skip
        answer = server.http.post("/v2/models/plus/versions/2/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [3.0] * 4
        _delete(store, "polled/add_sub/")
        wait_until(
            lambda: server.http.get("/v2/models/add_sub/ready").status_code != 200,
            "add_sub to be unloaded once its objects are gone",
            60,
        )
        assert server.http.get("/v2/models/plus/ready").status_code == 200


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("s3://{store}/no-such-bucket/x", "no-such-bucket"),
        ("s3://127.0.0.1:9/models/x", "cannot list the repository"),
    ],
    ids=["missing-bucket", "unreachable"],
)
def test_an_unreadable_repository_stops_the_start_naming_the_cause(
    store: str, tmp_path: Path, url: str, fragment: str
) -> None:
    command = [*slipstream_command(), "serve", "--model-repository", url.format(store=store),
               "--http-port", "0", "--grpc-port", "0"]  # fmt: skip
    env = {**os.environ, **CREDENTIALS, "AWS_MAX_ATTEMPTS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--model-repository" in done.stderr and fragment in done.stderr, done.stderr
