"""A device's side of the fleet without sockets: the root it is provisioned with
(``slipstream edge --root``) and what its agent logs when it installs a version.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner

import slipstream.edge.device as device
from slipstream.cli import main
from slipstream.edge.agent import AgentSettings, FleetAgent
from slipstream.edge.device import ProvisionError, provision_root
from slipstream.edge.fleet_client import FleetClient, FleetDirs, FleetSyncError
from slipstream.edge.fleet_repo import FleetPaths, IndexEntry, init_repository
from slipstream.serving.core import ModelServer
from tests.bundles import write_bundle

URL = "http://fleet.invalid"


@pytest.fixture
def root_json(tmp_path: Path) -> Path:
    """A publisher's 1.root.json (what a device is given as --root)."""
    paths = FleetPaths.of(tmp_path / "publisher")
    init_repository(paths)
    return paths.metadata / "1.root.json"


def _bad_roots(root_json: Path) -> dict[str, bytes]:
    """Files a user might pass as --root by mistake, by what is wrong with them."""
    tampered = json.loads(root_json.read_bytes())
    tampered["signed"]["version"] = 2  # changed after it was signed
    timestamp = root_json.parent / "timestamp.json"
    return {
        r"not TUF root metadata \(.*KeyError": b"{}",
        r"not TUF root metadata \(.*JSONDecodeError": b"root: yes\n",
        "timestamp metadata, not root": timestamp.read_bytes(),
        "not signed by its own root keys": json.dumps(tampered).encode(),
    }


def test_a_root_that_is_not_signed_root_metadata_is_refused_and_not_stored(
    root_json: Path, tmp_path: Path
) -> None:
    dirs = FleetDirs(tmp_path / "device" / ".fleet")
    for reason, data in _bad_roots(root_json).items():
        bad = tmp_path / "bad.json"
        bad.write_bytes(data)
        with pytest.raises(ProvisionError, match=rf"^--root {re.escape(str(bad))}: {reason}"):
            provision_root(dirs, bad)
        assert not dirs.trusted_root.exists(), reason
    provision_root(dirs, root_json)
    assert dirs.trusted_root.read_bytes() == root_json.read_bytes()


def test_edge_with_a_bad_root_exits_with_one_line_and_starts_nothing(
    root_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def started(*args: Any) -> int:
        raise AssertionError("the device started with a root it cannot use")

    monkeypatch.setattr(device, "run_edge", started)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    repository = tmp_path / "models"
    result = CliRunner().invoke(
        main, ["edge", "--fleet", URL, "--repository", str(repository), "--root", str(bad)]
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: --root {bad}: not TUF root metadata")
    assert result.output.count("\n") == 1, result.output
    assert not repository.exists()


def test_a_stored_root_that_is_unusable_says_how_to_provision_again(
    root_json: Path, tmp_path: Path
) -> None:
    """What the device was left with when it stored --root unchecked."""
    dirs = FleetDirs(tmp_path / "device" / ".fleet")
    dirs.root.mkdir(parents=True)
    dirs.trusted_root.write_text("{}")
    with pytest.raises(
        ProvisionError, match=rf"{re.escape(str(dirs.trusted_root))}.*delete it.*--root"
    ):
        provision_root(dirs, root_json)
    assert dirs.trusted_root.read_text() == "{}"  # the user decides, not the device


def test_a_stored_root_is_kept_over_a_different_root(root_json: Path, tmp_path: Path) -> None:
    dirs = FleetDirs(tmp_path / "device" / ".fleet")
    provision_root(dirs, root_json)
    other = FleetPaths.of(tmp_path / "other")
    init_repository(other)
    provision_root(dirs, other.metadata / "1.root.json")
    assert dirs.trusted_root.read_bytes() == root_json.read_bytes()


async def test_an_install_logs_the_version_it_replaced_or_a_first_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    agent = FleetAgent(AgentSettings(URL, repository, "d"))

    async def checked(*args: Any) -> str:
        return ""  # the server loaded it and its samples passed

    monkeypatch.setattr(agent, "_load_and_check", checked)
    service = cast(ModelServer, object())
    with caplog.at_level(logging.INFO, logger="slipstream.edge.agent"):
        for version in (1, 2):
            staged = write_bundle(tmp_path / f"staged{version}" / "m", "m", version)
            entry = IndexEntry("m", version, f"bundles/m/m-{version}.tar", "edge")
            await agent._install(service, entry, staged)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "fleet agent: m version 1 serving (first install)",
        "fleet agent: m version 2 serving (was version 1)",
    ]
    assert agent.state.models["m"].version == 2


def test_a_stored_root_changed_while_running_fails_the_round_with_one_line(
    tmp_path: Path,
) -> None:
    dirs = FleetDirs(tmp_path / "device" / ".fleet")
    dirs.root.mkdir(parents=True)
    dirs.trusted_root.write_text("{}")
    with pytest.raises(FleetSyncError, match=r"trusted_root.json refused: .*KeyError: 'signed'"):
        FleetClient(URL, dirs).open()
