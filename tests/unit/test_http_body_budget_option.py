"""--max-buffered-body-bytes from the command line to the HTTP transport's limits, which
every layout's HTTP servers are built with (``runner.start_front_ends``, also run by
each ``--frontends N`` process), and its default from --max-request-bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from slipstream.cli import main
from slipstream.config.server import ServerSettings
from slipstream.server.runner import http_limits

MIB = 1024 * 1024


def test_the_option_reaches_the_http_limits(tmp_path: Path) -> None:
    settings = ServerSettings(
        model_repository=tmp_path, max_request_bytes=8 * MIB, max_buffered_body_bytes=32 * MIB
    )
    assert http_limits(settings).buffered_body_bytes == 32 * MIB


def test_by_default_the_budget_is_eight_of_the_largest_bodies(tmp_path: Path) -> None:
    settings = ServerSettings(model_repository=tmp_path, max_request_bytes=8 * MIB)
    assert http_limits(settings).buffered_body_bytes == 64 * MIB
    assert http_limits(ServerSettings(model_repository=tmp_path)).buffered_body_bytes == (512 * MIB)


def test_a_budget_below_a_kibibyte_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="max_buffered_body_bytes"):
        ServerSettings(model_repository=tmp_path, max_buffered_body_bytes=10)
    result = CliRunner().invoke(
        main, ["serve", "--model-repository", str(tmp_path), "--max-buffered-body-bytes", "10"]
    )
    assert result.exit_code != 0 and "--max-buffered-body-bytes: " in result.output
