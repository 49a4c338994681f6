"""An engine that dies shows in /metrics: its own series start again from zero with it,
so each front end counts what the outage cost (the connection lost, the calls answered
503) under its ``frontend`` label, which the EngineUnavailable alert reads."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.models import build_add_sub
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("outage")
    build_add_sub(tmp / "repo")
    with RemoteServer(tmp / "repo", ["--frontends", "1"], log_dir=tmp) as server:
        yield server


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_an_engine_restart_is_counted_by_the_front_ends(split: RemoteServer) -> None:
    with httpx.Client(timeout=30) as client:
        before = client.get(split.url("/metrics")).text
        assert samples(before, "slipstream_engine_connection_lost_total") == {
            (("frontend", "0"),): 0.0
        }
        os.kill(split.engine_pids()[-1], signal.SIGKILL)
        refused = 0
        deadline = time.monotonic() + 60
        while client.get(split.url("/v2/health/ready")).status_code != 200:
            assert time.monotonic() < deadline, "the engine never came back"
            reply = client.get(split.url("/v2/models/add_sub"))
            refused += reply.status_code == 503
            time.sleep(0.02)
        assert refused, "no request met the engine away"
        after = client.get(split.url("/metrics")).text
    assert samples(after, "slipstream_engine_connection_lost_total") == {(("frontend", "0"),): 1.0}
    unavailable = samples(after, "slipstream_engine_unavailable_calls_total")
    assert unavailable[(("frontend", "0"), ("when", "refused"))] >= refused
    # The page as a whole stays valid for Prometheus: it parses (exit 1 otherwise), and
    # lints clean but for Triton's own names (nv_inference_count, ..._duration_us), which
    # Triton's dashboards query as they are.
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=after, capture_output=True, text=True
    )
    problems = [line for line in checked.stderr.splitlines()
                if line.strip() and not line.startswith("nv_inference_")]  # fmt: skip
    assert checked.returncode in (0, 3) and not problems, checked.stderr
