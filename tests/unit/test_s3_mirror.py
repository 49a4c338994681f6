"""The local copy of an S3 repository: what a sync fetches, keeps and removes, against
moto's in-process S3 (the S3 API without a socket)."""

from __future__ import annotations

import doctest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.repository import remote, stores
from slipstream.repository.remote import RepositoryError, RepositoryMirror
from slipstream.repository.stores import S3Location, S3Store

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

BUCKET = "models"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with moto.mock_aws():
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _mirror(s3: Any, cache: Path, prefix: str = "repo") -> RepositoryMirror:
    return RepositoryMirror(S3Store(S3Location(None, BUCKET, f"{prefix}/"), client=s3), cache)


def test_a_sync_fetches_only_what_changed_and_removes_what_is_gone(s3: Any, tmp_path: Path) -> None:
    s3.put_object(Bucket=BUCKET, Key="repo/m/config.yaml", Body=b"max_batch_size: 4\n")
    s3.put_object(Bucket=BUCKET, Key="repo/m/1/model.onnx", Body=b"one")
    s3.put_object(Bucket=BUCKET, Key="repo/m/2/", Body=b"")  # a "directory" marker
    s3.put_object(Bucket=BUCKET, Key="other/m/1/model.onnx", Body=b"not ours")
    mirror = _mirror(s3, tmp_path)
    first = mirror.sync()
    assert (first.fetched, first.removed, first.refused) == (2, 0, 0)
    assert (mirror.directory / "m" / "1" / "model.onnx").read_bytes() == b"one"
    assert mirror.sync().fetched == 0  # nothing changed
    s3.put_object(Bucket=BUCKET, Key="repo/m/1/model.onnx", Body=b"uno")
    s3.put_object(Bucket=BUCKET, Key="repo/m/3/model.onnx", Body=b"three")
    assert mirror.sync().fetched == 2
    assert (mirror.directory / "m" / "1" / "model.onnx").read_bytes() == b"uno"
    s3.delete_object(Bucket=BUCKET, Key="repo/m/3/model.onnx")
    assert mirror.sync().removed == 1
    assert not (mirror.directory / "m" / "3").exists()  # the emptied directory too
    assert sorted(p.name for p in (tmp_path / "incoming").iterdir()) == []


def test_a_restart_on_the_same_cache_fetches_nothing_unchanged(s3: Any, tmp_path: Path) -> None:
    s3.put_object(Bucket=BUCKET, Key="repo/m/1/model.onnx", Body=b"one")
    assert _mirror(s3, tmp_path).sync().fetched == 1
    assert _mirror(s3, tmp_path).sync().fetched == 0
    # A file of the copy changed by hand (another size) is fetched again.
    (tmp_path / "repository" / "m" / "1" / "model.onnx").write_bytes(b"edited by hand")
    assert _mirror(s3, tmp_path).sync().fetched == 1
    assert (tmp_path / "repository" / "m" / "1" / "model.onnx").read_bytes() == b"one"


@pytest.mark.parametrize(
    "key", ["repo/../up", "repo/m/../../up", "repo//abs", "repo/m/./1/x", "repo/m\\..\\up"]
)
def test_keys_leaving_the_copy_are_left_out(s3: Any, tmp_path: Path, key: str) -> None:
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    s3.put_object(Bucket=BUCKET, Key="repo/m/1/model.onnx", Body=b"one")
    report = _mirror(s3, tmp_path / "cache").sync()
    assert (report.fetched, report.refused) == (1, 1)
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [Path("cache/manifest.json"), Path("cache/repository/m/1/model.onnx")]


def test_a_missing_bucket_is_a_repository_error_naming_it(s3: Any, tmp_path: Path) -> None:
    mirror = RepositoryMirror(S3Store(S3Location(None, "no-such-bucket", ""), client=s3), tmp_path)
    with pytest.raises(RepositoryError, match="no-such-bucket"):
        mirror.sync()


@pytest.mark.parametrize(
    "url", ["s3://", "s3:///path", "s3://host:9000/", "https://x/y", "gs://", "gs:///p",
            "as://a", "as://a/", "as:///c/p"],
)  # fmt: skip
def test_bad_urls_are_refused_with_the_expected_form(url: str) -> None:
    with pytest.raises(RepositoryError, match="expected"):
        stores.open_store(url)


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(remote).failed == 0
    assert doctest.testmod(stores).failed == 0


def test_following_survives_a_failing_sync_and_catches_up(s3: Any, tmp_path: Path) -> None:
    """A sync that fails on the disk's side (here its manifest cannot be replaced) is
    logged and retried: the thread goes on, and the copy follows once it can."""
    import threading
    import time

    s3.put_object(Bucket=BUCKET, Key="repo/m/1/model.onnx", Body=b"one")
    mirror = _mirror(s3, tmp_path)
    mirror.sync()
    manifest = tmp_path / "manifest.json"
    manifest.unlink()
    manifest.mkdir()  # os.replace onto a directory: every sync that changes something fails
    stop = threading.Event()
    s3.put_object(Bucket=BUCKET, Key="repo/m/1/two.bin", Body=b"two")
    thread = mirror.follow(0.05, stop)
    try:
        time.sleep(0.3)
        assert thread.is_alive()
        manifest.rmdir()
        s3.put_object(Bucket=BUCKET, Key="repo/m/1/three.bin", Body=b"three")
        deadline = time.monotonic() + 5
        while not (tmp_path / "repository" / "m" / "1" / "three.bin").exists():
            assert time.monotonic() < deadline, "the copy never caught up"
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(1)
