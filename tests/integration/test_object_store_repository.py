"""Model repositories in Google Cloud Storage (``gs://bucket/path``) and Azure Blob
Storage (``as://account/container/path``), as Triton names them, against each store's
real API: gcp-storage-emulator and Azurite, on loopback ports. The local copy fetches
only what changed and removes what is gone (the S3 tests cover the copy's other rules,
which are the same code); `slipstream serve` serves the copy, follows it in poll mode,
and refuses a repository it cannot read, naming the cause.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.repository.remote import RepositoryError, RepositoryMirror
from slipstream.repository.stores import open_store
from tests.gated import wait_until
from tests.models import (
    assert_add_sub_answers,
    build_add_constant,
    build_add_sub,
)
from tests.object_stores import AZURE_ACCOUNT, BUCKET, Azurite, GcsEmulator
from tests.utils import RemoteServer, slipstream_command

pytest.importorskip("google.cloud.storage", reason="the gcs extra is not installed")
pytest.importorskip("azure.storage.blob", reason="the azure extra is not installed")


class Bucket:
    """One store's bucket (or container) ``models``: writes, and the URL Triton gives it."""

    def __init__(self, kind: str, server: Any) -> None:
        self.kind = kind
        self.env: dict[str, str] = server.env
        self._bucket = server.bucket if kind == "gs" else server.container

    def url(self, prefix: str) -> str:
        where = BUCKET if self.kind == "gs" else f"{AZURE_ACCOUNT}/{BUCKET}"
        return f"{self.kind}://{where}/{prefix}"

    def put(self, key: str, data: bytes) -> None:
        if self.kind == "gs":
            self._bucket.blob(key).upload_from_string(data)
        else:
            self._bucket.upload_blob(key, data, overwrite=True)

    def upload(self, local: Path, prefix: str) -> None:
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())

    def delete(self, prefix: str) -> None:
        if self.kind == "gs":
            for blob in list(self._bucket.list_blobs(prefix=prefix)):
                blob.delete()
        else:
            for blob in list(self._bucket.list_blobs(name_starts_with=prefix)):
                self._bucket.delete_blob(blob.name)


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsEmulator]:
    with GcsEmulator() as running:
        yield running


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    with Azurite(tmp_path_factory.mktemp("azurite")) as running:
        yield running


@pytest.fixture(params=["gs", "as"])
def bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    server = request.getfixturevalue("gcs" if request.param == "gs" else "azurite")
    made = Bucket(request.param, server)
    for name, value in made.env.items():  # for the stores opened in this process
        monkeypatch.setenv(name, value)
    return made


def test_the_copy_fetches_what_changed_and_removes_what_is_gone(
    bucket: Bucket, tmp_path: Path
) -> None:
    bucket.put("copied/m/config.yaml", b"max_batch_size: 4\n")
    bucket.put("copied/m/1/model.onnx", b"one")
    bucket.put("elsewhere/m/1/model.onnx", b"not ours")
    mirror = RepositoryMirror(open_store(bucket.url("copied")), tmp_path)
    first = mirror.sync()
    assert (first.fetched, first.removed, first.refused) == (2, 0, 0)
    assert (mirror.directory / "m" / "1" / "model.onnx").read_bytes() == b"one"
    assert mirror.sync().fetched == 0  # nothing changed
    bucket.put("copied/m/1/model.onnx", b"uno")  # the same size: its tag tells
    bucket.put("copied/m/3/model.onnx", b"three")
    assert mirror.sync().fetched == 2
    assert (mirror.directory / "m" / "1" / "model.onnx").read_bytes() == b"uno"
    bucket.delete("copied/m/3/")
    assert mirror.sync().removed == 1
    assert not (mirror.directory / "m" / "3").exists()
    # A restart on the same cache fetches nothing unchanged.
    assert RepositoryMirror(open_store(bucket.url("copied")), tmp_path).sync().fetched == 0


def test_a_missing_bucket_is_a_repository_error_naming_it(bucket: Bucket) -> None:
    url = bucket.url("x").replace(BUCKET, "no-such-bucket")
    with pytest.raises(RepositoryError, match="no-such-bucket"):
        open_store(url).list()


def test_the_repository_is_served_and_followed_in_poll_mode(bucket: Bucket, tmp_path: Path) -> None:
    local = tmp_path / "local"
    model_file = build_add_sub(local)
    bucket.upload(local, "served")
    args = ["--model-control-mode", "poll", "--repository-poll-secs", "0.3",
            "--repository-cache", str(tmp_path / "cache")]  # fmt: skip
    with RemoteServer(bucket.url("served"), args, log_dir=tmp_path, env=bucket.env) as server:
        assert_add_sub_answers(server.http_address, model_file)
        build_add_constant(tmp_path / "v1", "plus", 1, 2.0)
        bucket.upload(tmp_path / "v1", "served")
        wait_until(
            lambda: server.http.get("/v2/models/plus/ready").status_code == 200,
            "plus, uploaded, to be served", 60,
        )  # fmt: skip
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                            "data": [1.0] * 4}]}  # fmt: skip
        answer = server.http.post("/v2/models/plus/infer", json=body)
        assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [3.0] * 4
        bucket.delete("served/add_sub/")
        wait_until(
            lambda: server.http.get("/v2/models/add_sub/ready").status_code != 200,
            "add_sub to be unloaded once its objects are gone", 60,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "url", "env", "fragment"),
    [
        ("gs", "gs://no-such-bucket/x", {}, "no-such-bucket"),
        ("as", "as://devstoreaccount1/no-such-container/x", {}, "no-such-container"),
        ("as", "as://another/models/x", {}, "another"),
        ("as", "as://devstoreaccount1/models/x", {"AZURE_STORAGE_ACCOUNT": "someone"},
         "AZURE_STORAGE_ACCOUNT names account 'someone'"),
    ],
    ids=["gs-missing-bucket", "as-missing-container", "as-other-account", "as-account-env"],
)  # fmt: skip
def test_an_unreadable_repository_stops_the_start_naming_the_cause(
    request: pytest.FixtureRequest, kind: str, url: str, env: dict[str, str], fragment: str
) -> None:
    server = request.getfixturevalue("gcs" if kind == "gs" else "azurite")
    command = [*slipstream_command(), "serve", "--model-repository", url,
               "--http-port", "0", "--grpc-port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **server.env, **env})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--model-repository" in done.stderr and fragment in done.stderr, done.stderr
