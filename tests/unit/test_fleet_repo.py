"""The fleet's publisher and the device's TUF client, without sockets: the device reads
the repository's files through a fetcher that maps URLs onto the directory.

The refusals a device must make over HTTP are in tests/integration/test_fleet.py; here,
what the publisher refuses and the bad bundles a device must name.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from tuf.api.exceptions import DownloadHTTPError
from tuf.ngclient.fetcher import FetcherInterface

from slipstream.cli import main
from slipstream.edge.agent import AgentSettings, FleetAgent
from slipstream.edge.fleet_client import FleetClient, FleetDirs, FleetSyncError, unpack_bundle
from slipstream.edge.fleet_repo import (
    FleetPaths,
    FleetRepoError,
    IndexEntry,
    Lifetimes,
    init_repository,
    pack_bundle,
    publish_bundle,
    refresh_metadata,
)
from slipstream.edge.manifest import BundleError
from tests.bundles import write_bundle

URL = "http://fleet.invalid"


class DirectoryFetcher(FetcherInterface):
    """Answers URL/<path> with DIR/<path>, 404 when there is no such file."""

    def __init__(self, public: Path) -> None:
        self.public = public

    def _fetch(self, url: str) -> Iterator[bytes]:
        path = self.public / url.removeprefix(URL + "/")
        if not path.is_file():
            raise DownloadHTTPError(f"{url}: 404", 404)
        return iter([path.read_bytes()])


@pytest.fixture
def paths(tmp_path: Path) -> FleetPaths:
    paths = FleetPaths.of(tmp_path / "repo")
    init_repository(paths)
    return paths


def client_for(paths: FleetPaths, device: Path) -> FleetClient:
    dirs = FleetDirs(device / ".fleet")
    dirs.root.mkdir(parents=True)
    dirs.trusted_root.write_bytes((paths.metadata / "1.root.json").read_bytes())
    return FleetClient(URL, dirs, fetcher=DirectoryFetcher(paths.public))


def test_init_keeps_private_keys_0600_outside_the_served_tree(paths: FleetPaths) -> None:
    assert paths.keys.stat().st_mode & 0o777 == 0o700
    for role in ("root", "targets", "snapshot", "timestamp"):
        assert (paths.keys / f"{role}.pem").stat().st_mode & 0o777 == 0o600
    served = [p.name for p in paths.public.rglob("*")]
    assert not any(name.endswith(".pem") for name in served)
    with pytest.raises(FleetRepoError, match="already a fleet repository"):
        init_repository(paths)


def test_publish_signs_a_new_version_and_bumps_every_role(
    paths: FleetPaths, tmp_path: Path
) -> None:
    first = publish_bundle(paths, write_bundle(tmp_path / "b1" / "m", "m", 1))
    second = publish_bundle(paths, write_bundle(tmp_path / "b2" / "m", "m", 2))
    assert second.targets_version == first.targets_version + 1
    assert second.timestamp_version == first.timestamp_version + 1
    assert (paths.metadata / f"{second.targets_version}.targets.json").is_file()
    sync = client_for(paths, tmp_path / "device").open()
    assert sync.index() == {"m": IndexEntry("m", 2, "bundles/m/m-2.tar", "edge")}
    staged = sync.fetch_bundle(sync.index()["m"])
    assert (staged / "2" / "model.onnx").is_file()


def test_publish_says_the_tuf_target_it_signed(paths: FleetPaths, tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "b" / "m", "m", 1)
    result = CliRunner().invoke(main, ["fleet", "publish", str(bundle), "--repo", str(paths.repo)])
    assert result.exit_code == 0, result.output
    # A target name, not a path here: the file is public/targets/bundles/m/<sha256>.m-1.tar.
    assert "as target bundles/m/m-1.tar" in result.output


def test_publish_refuses_an_older_or_equal_version(paths: FleetPaths, tmp_path: Path) -> None:
    publish_bundle(paths, write_bundle(tmp_path / "b2" / "m", "m", 2))
    with pytest.raises(FleetRepoError, match="not newer than the published version 2"):
        publish_bundle(paths, write_bundle(tmp_path / "b1" / "m", "m", 1))


def test_publish_refuses_a_key_others_can_read(paths: FleetPaths, tmp_path: Path) -> None:
    (paths.keys / "targets.pem").chmod(0o644)
    with pytest.raises(FleetRepoError, match=r"targets.pem: readable by others.*chmod 600"):
        publish_bundle(paths, write_bundle(tmp_path / "b" / "m", "m", 1))


def test_publish_names_the_file_a_bundle_misses(paths: FleetPaths, tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "b" / "m", "m", 1)
    (bundle / "sample_outputs.npz").unlink()
    with pytest.raises(BundleError, match=r"sample_outputs.npz: missing"):
        publish_bundle(paths, bundle)
    result = CliRunner().invoke(main, ["fleet", "publish", str(bundle), "--repo", str(paths.repo)])
    assert result.exit_code == 1
    assert "sample_outputs.npz: missing" in result.output and "not published" in result.output


def test_a_device_refuses_a_bundle_whose_bytes_differ_from_the_signed_ones(
    paths: FleetPaths, tmp_path: Path
) -> None:
    published = publish_bundle(paths, write_bundle(tmp_path / "b" / "m", "m", 1))
    stored = next((paths.targets / "bundles" / "m").glob("*.m-1.tar"))
    data = stored.read_bytes()
    stored.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    sync = client_for(paths, tmp_path / "device").open()
    with pytest.raises(FleetSyncError, match="sha256 differs from the signed one"):
        sync.fetch_bundle(published.entry)


def test_a_device_names_the_file_a_bundle_lacks(tmp_path: Path) -> None:
    """A tar whose manifest names a file it does not hold (signed by a publisher that did
    not check it): refused, naming the file, and nothing left in staging."""
    bundle = write_bundle(tmp_path / "b" / "m", "m", 1)
    packed = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(pack_bundle(bundle))) as source,
        tarfile.open(fileobj=packed, mode="w") as target,
    ):
        for member in source.getmembers():
            if member.name != "1/model.onnx":
                target.addfile(member, source.extractfile(member))
    tar = tmp_path / "m-1.tar"
    tar.write_bytes(packed.getvalue())
    staged = tmp_path / "staging" / "m"
    entry = IndexEntry("m", 1, "bundles/m/m-1.tar", "edge")
    with pytest.raises(FleetSyncError, match=r"m-1.tar refused: .*1/model.onnx: missing"):
        unpack_bundle(tar, staged, entry)
    assert not staged.exists()
    tar.write_bytes(pack_bundle(bundle))
    with pytest.raises(FleetSyncError, match="manifest says m version 1, the index m version 2"):
        unpack_bundle(tar, staged, IndexEntry("m", 2, "bundles/m/m-2.tar", "edge"))


def test_a_device_without_a_root_is_told_what_to_pass(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["edge", "--fleet", URL, "--repository", str(tmp_path)])
    assert result.exit_code == 1
    assert "pass --root" in result.output


def test_failed_rounds_back_off_up_to_the_limit(tmp_path: Path) -> None:
    agent = FleetAgent(AgentSettings(URL, tmp_path, "d", poll_s=2.0, max_backoff_s=30.0))
    assert agent.next_delay_s() == 2.0
    agent.state.failures_in_row = 1
    assert 2.0 <= agent.next_delay_s() <= 4.0
    agent.state.failures_in_row = 10
    assert 15.0 <= agent.next_delay_s() <= 30.0
    assert json.loads(agent.state.to_json())["device_id"] == "d"


def test_refresh_renews_a_root_near_its_expiry_and_devices_follow(tmp_path: Path) -> None:
    """The root, signed once at init, expires (a year by default): past it, every device
    refused every poll, and no command could renew it. ``fleet refresh`` now signs a new
    root version when the root nears its expiry, and a device trusting the old one
    follows it as a TUF root rotation."""
    paths = FleetPaths.of(tmp_path / "repo")
    init_repository(paths, Lifetimes(root_days=-1.0))  # a root already past its expiry
    publish_bundle(paths, write_bundle(tmp_path / "b" / "m", "m", 1))
    device = client_for(paths, tmp_path / "device")
    with pytest.raises(FleetSyncError, match="expired metadata"):
        device.open()
    refresh_metadata(paths)
    renewed = json.loads((paths.metadata / "root.json").read_bytes())["signed"]
    assert renewed["version"] == 2 and (paths.metadata / "2.root.json").is_file()
    assert device.open().index()["m"].version == 1
    refresh_metadata(paths)  # a root with a year left is not signed again
    assert not (paths.metadata / "3.root.json").exists()
