"""A device whose publisher does not answer: real urllib3 requests to a loopback port
nothing listens on (the scenario with real processes is in test_fleet.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import pytest

from slipstream.edge.agent import AgentSettings, FleetAgent
from slipstream.edge.fleet_client import FleetDirs
from slipstream.edge.fleet_repo import FleetPaths, init_repository
from slipstream.serving.core import ModelServer
from tests.utils import HOST, free_ports


async def test_a_failed_poll_is_one_warning_that_names_the_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = FleetPaths.of(tmp_path / "publisher")
    init_repository(paths)
    repository = tmp_path / "models"
    dirs = FleetDirs(repository / ".fleet")
    dirs.root.mkdir(parents=True)
    dirs.trusted_root.write_bytes((paths.metadata / "1.root.json").read_bytes())
    (port,) = free_ports(1)  # nothing listens there
    agent = FleetAgent(AgentSettings(f"http://{HOST}:{port}", repository, "d", timeout_s=5))
    with caplog.at_level(logging.INFO):
        assert not await agent.sync_once(cast(ModelServer, None))  # no install is reached
        await agent.report()
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.levelno for r in lines] == [logging.WARNING], caplog.text
    assert "fleet repository unreachable" in lines[0].getMessage()
    assert "Connection refused" in lines[0].getMessage()
    assert "Connection refused" in agent.state.last_error
