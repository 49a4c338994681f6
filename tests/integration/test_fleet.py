"""Fleet updates with real processes: a publisher (``slipstream fleet serve``) and five
devices (``slipstream edge``), each on its own loopback port and model repository.

One scenario, step by step (each test leaves the fleet as the next expects): a new
version reaches every device under load without a failed request; a bundle with a wrong
hash, an unsigned one, an expired timestamp and a replayed older repository are refused
while the devices serve; a bundle failing its own samples is refused and one the server
cannot load is rolled back; with the publisher killed, every device keeps serving.
The model of version N adds N to its input, so an answer says which version gave it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from securesystemslib.signer import CryptoSigner
from tuf.api.metadata import Metadata, MetaFile, TargetFile

from slipstream.edge.fleet_repo import (
    FleetPaths,
    Lifetimes,
    init_repository,
    pack_bundle,
    publish_bundle,
    refresh_metadata,
)
from tests.bundles import SAMPLE_ROWS, write_bundle
from tests.utils import HOST, RemoteServer, free_ports, slipstream_command

DEVICES = 5
MODEL = "adder"
POLL_S = "0.3"
# The bound for a version to reach the whole fleet.
REACH_S = 60.0
BODY = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 4],
                               "data": SAMPLE_ROWS.ravel().tolist()}]})  # fmt: skip


class EdgeDevice(RemoteServer):
    """``slipstream edge`` in a subprocess (RemoteServer's start, readiness and stop)."""

    def __init__(self, repository: Path, fleet_url: str, root: Path, device_id: str,
                 log_dir: Path) -> None:  # fmt: skip
        self.fleet_url, self.root, self.device_id = fleet_url, root, device_id
        super().__init__(repository, log_dir=log_dir)

    def _pick_ports(self) -> None:
        (self.http_port,) = free_ports(1)
        self.grpc_port = 0
        self.argv = [
            *slipstream_command(), "edge", "--fleet", self.fleet_url,
            "--repository", str(self.repository), "--root", str(self.root),
            "--device-id", self.device_id, "--poll-s", POLL_S, "--max-backoff-s", "1",
            "--host", HOST, "--http-port", str(self.http_port),
        ]  # fmt: skip
        self.log_path = self._log_dir / f"edge-{self.device_id}.log"

    def answer(self, http: httpx.Client) -> int:
        """The version that answers a request (its output is the input plus it)."""
        response = http.post(self.url(f"/v2/models/{MODEL}/infer"), content=BODY)
        assert response.status_code == 200, f"{self.device_id}: {response.text}"
        data = response.json()["outputs"][0]["data"]
        version = round(data[0] - SAMPLE_ROWS.ravel()[0])
        assert data == (SAMPLE_ROWS + version).ravel().tolist()
        assert response.json()["model_version"] == str(version)
        return version

    def state(self) -> dict[str, Any]:
        """What the device last reported (its own copy, readable with no publisher)."""
        return json.loads((self.repository / ".fleet" / "state.json").read_text())  # type: ignore[no-any-return]


@dataclass
class Fleet:
    paths: FleetPaths
    url: str
    publisher: subprocess.Popen[bytes]
    devices: list[EdgeDevice]
    bundles: Path
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5.0))

    def reports(self) -> dict[str, dict[str, Any]]:
        response = self.http.get(f"{self.url}/v2/fleet/devices")
        assert response.status_code == 200, response.text
        return {d["device_id"]: d for d in response.json()["devices"]}

    def bundle(self, version: int, **kwargs: Any) -> Path:
        return write_bundle(self.bundles / f"{MODEL}-{version}" / MODEL, MODEL, version, **kwargs)

    def wait_reports(self, check: Callable[[dict[str, Any]], bool], what: str,
                     timeout_s: float = 20.0) -> float:  # fmt: skip
        """Wait until every device's report passes ``check``; the seconds it took."""
        start = time.monotonic()
        while True:
            reports = self.reports()
            if len(reports) == DEVICES and all(check(r) for r in reports.values()):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"not every device {what} in {timeout_s} s: {reports}")
            time.sleep(0.1)

    def assert_serving(self, version: int) -> None:
        for device in self.devices:
            assert device.answer(self.http) == version


def serving(version: int) -> Callable[[dict[str, Any]], bool]:
    return lambda report: report["models"].get(MODEL, {}).get("version") == version


def error_since(since: str, *words: str) -> Callable[[dict[str, Any]], bool]:
    """The device reported an error after ``since`` (ISO time) containing ``words``."""
    return lambda r: (
        (r["last_error_at"] or "") >= since and all(w in r["last_error"] for w in words)
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    paths = FleetPaths.of(root / "repo")
    init_repository(paths)
    bundles = root / "bundles"
    publish_bundle(paths, write_bundle(bundles / "v1" / MODEL, MODEL, 1))
    (port,) = free_ports(1)
    url = f"http://{HOST}:{port}"
    with (root / "publisher.log").open("wb") as log:
        publisher = subprocess.Popen(
            [*slipstream_command(), "fleet", "serve", "--repo", str(paths.repo), "--host",
             HOST, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    devices = [
        EdgeDevice(root / f"device{i}", url, paths.metadata / "1.root.json", f"dev-{i}", root)
        for i in range(DEVICES)
    ]
    try:
        for device in devices:
            device._spawn()  # all five start at once
        # The devices retry a publisher that is still starting; the fixture's own
        # questions do not, so it waits for one answer (beside a busy suite the devices
        # were ready in 1.3 s, before the publisher listened).
        _wait_answering(f"{url}/v2/fleet/devices", publisher, root / "publisher.log")
        for device in devices:
            device.wait_until("ready", 60.0)
        result = Fleet(paths, url, publisher, devices, bundles)
        with result.http:
            result.wait_reports(serving(1), "serves version 1")
            yield result
    finally:
        for device in devices:
            device.stop()
        publisher.kill()
        publisher.wait(10)


def _wait_answering(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            assert process.poll() is None, f"the publisher exited: {log.read_text()[-2000:]}"
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no answer from {url}: {log.read_text()[-2000:]}"
            time.sleep(0.05)


def test_a_new_version_reaches_every_device_under_load_without_a_failed_request(
    fleet: Fleet,
) -> None:
    answers: Counter[int] = Counter()
    failures: list[str] = []
    stop = threading.Event()

    def load(device: EdgeDevice) -> None:
        with httpx.Client(timeout=5.0) as http:
            while not stop.is_set():
                try:
                    answers[device.answer(http)] += 1
                except (AssertionError, httpx.HTTPError) as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load, args=(d,)) for d in fleet.devices]
    for thread in threads:
        thread.start()
    try:
        start = time.monotonic()
        published = subprocess.run(
            [*slipstream_command(), "fleet", "publish", str(fleet.bundle(2)), "--repo",
             str(fleet.paths.repo)], capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert published.returncode == 0, published.stderr
        assert "published adder version 2" in published.stdout
        fleet.wait_reports(serving(2), "serves version 2", timeout_s=REACH_S)
        took_s = time.monotonic() - start
        time.sleep(0.3)  # requests after the switch too
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    print(f"published and reached {DEVICES} devices in {took_s:.1f} s; answers {dict(answers)}")
    assert failures == []
    assert answers[1] > 0 and answers[2] > 0
    fleet.assert_serving(2)


def test_a_bundle_with_a_wrong_hash_is_refused_then_installed_once_fixed(fleet: Fleet) -> None:
    since = _now()
    result = publish_bundle(fleet.paths, fleet.bundle(3))
    stored = next((fleet.paths.targets / "bundles" / MODEL).glob("*.adder-3.tar"))
    good = stored.read_bytes()
    stored.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit, same length
    fleet.wait_reports(error_since(since, "adder version 3", "sha256"), "refused the bytes")
    fleet.assert_serving(2)
    stored.write_bytes(good)
    fleet.wait_reports(serving(result.entry.version), "installed version 3 once fixed")
    fleet.assert_serving(3)


def test_an_unsigned_bundle_is_refused(fleet: Fleet) -> None:
    """An attacker without the keys adds a bundle and metadata signed by a key of theirs."""
    metadata = fleet.paths.metadata
    saved = {name: (metadata / name).read_bytes() for name in
             ("targets.json", "snapshot.json", "timestamp.json")}  # fmt: skip
    since = _now()
    forge_bundle(fleet.paths, fleet.bundle(4), CryptoSigner.generate_ed25519())
    fleet.wait_reports(error_since(since, "not signed by the trusted keys"), "refused it")
    fleet.assert_serving(3)
    for name, data in saved.items():
        (metadata / name).write_bytes(data)


def test_an_expired_timestamp_is_refused(fleet: Fleet) -> None:
    since = _now()
    refresh_metadata(fleet.paths, Lifetimes(timestamp_days=-1.0))
    fleet.wait_reports(error_since(since, "expired"), "refused the expired timestamp")
    fleet.assert_serving(3)
    refresh_metadata(fleet.paths)


def test_a_replayed_older_repository_is_refused(fleet: Fleet) -> None:
    metadata = fleet.paths.metadata
    old = {p.name: p.read_bytes() for p in metadata.iterdir() if p.is_file()}
    shutil.rmtree(fleet.bundles / f"{MODEL}-4")
    publish_bundle(fleet.paths, fleet.bundle(4))
    fleet.wait_reports(serving(4), "installed version 4")
    new = {p.name: p.read_bytes() for p in metadata.iterdir() if p.is_file()}
    since = _now()
    for name, data in old.items():  # the repository as it was, signatures valid
        (metadata / name).write_bytes(data)
    fleet.wait_reports(error_since(since, "replay"), "refused the older timestamp")
    fleet.assert_serving(4)
    for name, data in new.items():
        (metadata / name).write_bytes(data)


def test_bundles_failing_their_checks_are_refused_or_rolled_back(fleet: Fleet) -> None:
    publish_bundle(fleet.paths, fleet.bundle(5, wrong_samples=True))
    fleet.wait_reports(
        lambda r: "failed its own sample check" in r["models"][MODEL]["error"], "refused v5"
    )
    fleet.assert_serving(4)
    # Intact and self-consistent, but its config.yaml contradicts the model: the server
    # refuses to load it after it was installed beside version 4, which serves on.
    publish_bundle(fleet.paths, fleet.bundle(6, config={"input": [
        {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [5]}]}))  # fmt: skip
    fleet.wait_reports(
        lambda r: r["models"][MODEL]["state"] == "rolled back" and "version 6" in r["last_error"],
        "rolled back v6",
    )
    fleet.assert_serving(4)
    for device in fleet.devices:
        on_disk = sorted(p.name for p in (device.repository / MODEL).iterdir() if p.is_dir())
        assert on_disk == ["3", "4"]


def test_every_device_keeps_serving_without_the_publisher(fleet: Fleet) -> None:
    fleet.publisher.kill()
    fleet.publisher.wait(10)
    deadline = time.monotonic() + 10
    while not all(d.state()["failures_in_row"] >= 2 for d in fleet.devices):
        assert time.monotonic() < deadline, [d.state() for d in fleet.devices]
        time.sleep(0.1)
    fleet.assert_serving(4)
    assert all("fleet repository unreachable" in d.state()["last_error"] for d in fleet.devices)


def forge_bundle(paths: FleetPaths, bundle: Path, key: CryptoSigner) -> None:
    """Add ``bundle`` as a target with targets, snapshot and timestamp metadata of the
    next versions, each signed by ``key`` alone (not a key root.json trusts)."""
    metadata = paths.metadata
    expires = datetime.now(UTC) + timedelta(days=1)
    targets = Metadata.from_file(str(metadata / "targets.json"))
    data = pack_bundle(bundle)
    info = TargetFile.from_data("bundles/adder/adder-4.tar", data)
    (paths.targets / "bundles" / MODEL / f"{info.hashes['sha256']}.adder-4.tar").write_bytes(data)
    targets.signed.targets[info.path] = info
    targets.signed.version += 1
    snapshot = Metadata.from_file(str(metadata / "snapshot.json"))
    snapshot.signed.meta["targets.json"] = MetaFile(targets.signed.version)
    snapshot.signed.version += 1
    timestamp = Metadata.from_file(str(metadata / "timestamp.json"))
    timestamp.signed.snapshot_meta = MetaFile(snapshot.signed.version)
    timestamp.signed.version += 1
    for role, md in (("targets", targets), ("snapshot", snapshot), ("timestamp", timestamp)):
        md.signed.expires = expires
        md.signatures.clear()
        md.sign(key)
        if role != "timestamp":
            md.to_file(str(metadata / f"{md.signed.version}.{role}.json"))
        md.to_file(str(metadata / f"{role}.json"))
