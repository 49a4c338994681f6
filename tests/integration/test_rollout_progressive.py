"""Progressive rollouts through a real server under real traffic.

Three models, each with a baseline version 1 and a candidate version 2 of the scripted
backend (tests/scripted.py), are rolled out at once with 1.5 s analysis windows while a
client per model sends requests one after another (every 20th one marked):

- ``errs``: the candidate fails the marked requests (5% of its traffic): rolled back;
- ``slow``: the candidate takes 3x as long: rolled back on the p99 ratio;
- ``good``: the candidate answers as the baseline does: promoted.

Then a rollout in progress survives ``kill -9`` of the server: the restarted server
resumes the same step.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_client

from slipstream.serving.rollout_store import REDIS_KEY
from tests.models import write_config
from tests.redis_server import RedisServer
from tests.scripted import build_scripted, scripted_command, scripted_config
from tests.utils import RemoteServer, slipstream_command

INTERVAL_S = 1.5
# Steps measured side by side with the baseline: a 100% step would judge the candidate
# against the last baseline window, seconds earlier, on a machine others share.
PLAN = {"action": "start", "candidate": "2", "steps": [25, 50], "interval_s": INTERVAL_S,
        "min_requests": 10}  # fmt: skip
FINAL = ("promoted", "rolled_back", "aborted")


@dataclass
class Outcome:
    sent_at: float
    marked: bool
    status: int
    version: str


@dataclass
class Traffic:
    """One client sending requests to a model back to back, until stopped."""

    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                marked = n % 20 == 0
                row = [-1.0 if marked else 1.0, 2.0, 3.0, 4.0]
                body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                    "data": row}]}  # fmt: skip
                sent_at = time.time()
                reply = client.post(self.url, json=body)
                version = reply.json().get("model_version", "") if reply.status_code == 200 else ""
                self.outcomes.append(Outcome(sent_at, marked, reply.status_code, version))


def start_traffic(server: RemoteServer, model: str) -> tuple[Traffic, threading.Thread]:
    traffic = Traffic(server.url(f"/v2/models/{model}/infer"))
    thread = threading.Thread(target=traffic.run, daemon=True)
    thread.start()
    return traffic, thread


def status(client: httpx.Client, server: RemoteServer, model: str) -> dict[str, Any]:
    reply = client.get(server.url(f"/v2/models/{model}/rollout"))
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def wait_for(client: httpx.Client, server: RemoteServer, model: str, ok: Any, timeout_s: float
             ) -> dict[str, Any]:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        now = status(client, server, model)
        if ok(now):
            return now
        assert time.monotonic() < deadline, f"{model}: {json.dumps(now, indent=1)}"
        time.sleep(0.05)


def cli(server: RemoteServer, *args: str) -> str:
    done = subprocess.run([*slipstream_command(), "rollout", *args, "--url", server.http_url],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def event_at(state: dict[str, Any], event: str) -> float:
    return next(e["at"] for e in state["history"] if e["event"] == event)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("rollout_progressive")
    repo = root / "repo"
    for name, baseline_s, candidate_s, fails in (
        ("errs", 0.002, 0.002, True), ("slow", 0.005, 0.015, False),
        ("good", 0.005, 0.005, False),
    ):  # fmt: skip
        build_scripted(repo, name, 1, delay_s=baseline_s)
        build_scripted(repo, name, 2, delay_s=candidate_s, fail_marked=fails)
        write_config(repo, name, scripted_config())
    with RemoteServer(repo, [], log_dir=root, command=scripted_command()) as running:
        yield running


def test_bad_candidates_roll_back_and_a_healthy_one_is_promoted(server: RemoteServer) -> None:
    models = ("errs", "slow", "good")
    drivers = {model: start_traffic(server, model) for model in models}
    try:
        with httpx.Client(timeout=30) as client:
            for model in ("errs", "good"):
                reply = client.post(server.url(f"/v2/models/{model}/rollout"), json=PLAN)
                assert reply.status_code == 200, reply.text
            cli(server, "start", "slow", "--candidate", "2", "--steps", "25,50",
                "--interval", "1.5s", "--min-requests", "10",
                "--min-p99-delta-ms", "1.5")  # fmt: skip
            final = {m: wait_for(client, server, m, lambda s: s["status"] in FINAL, 30)
                     for m in models}  # fmt: skip
            time.sleep(0.5)  # traffic after the verdicts: none may fail
            checked_at = time.time()
            time.sleep(0.5)
            metrics = client.get(server.url("/metrics")).text
    finally:
        for traffic, thread in drivers.values():
            traffic.stop.set()
            thread.join(30)
    errs, slow, good = final["errs"], final["slow"], final["good"]
    for state, why in ((errs, "error rate"), (slow, "max_p99_ratio")):
        assert state["status"] == "rolled_back", json.dumps(state["history"], indent=1)
        assert why in state["reason"], state["reason"]
        assert state["weights"] == {"1": 100.0}
        # Rolled back within two analysis windows of the start.
        took = event_at(state, "rollback") - event_at(state, "start")
        assert took <= 2 * INTERVAL_S + 0.5, state["history"]
    assert "min_p99_delta_ms 1.5" in slow["reason"], slow["reason"]  # the CLI's flag
    assert good["status"] == "promoted", json.dumps(good["history"], indent=1)
    assert [e["event"] for e in good["history"]] == ["start", "pass", "pass", "promote"]
    assert good["weights"] == {"2": 100.0}
    for model, (traffic, _) in drivers.items():
        outcomes = traffic.outcomes
        failed = [o for o in outcomes if o.status != 200]
        # Only the candidate's marked requests failed: never the baseline's, never a
        # request after the rollback.
        assert all(o.marked for o in failed), (model, failed[:5])
        rolled_back = event_at(final[model], "rollback") if model != "good" else 0.0
        assert all(o.sent_at < rolled_back + 0.05 for o in failed), (model, rolled_back, failed)
        later = [o for o in outcomes if o.sent_at > checked_at]
        assert later and all(o.status == 200 for o in later), model
        expected = "2" if model == "good" else "1"
        assert {o.version for o in later} == {expected}, model
    assert 'slipstream_rollout_state{model="good",state="promoted"} 1.0' in metrics
    assert 'slipstream_rollout_verdicts_total{model="errs",verdict="fail"} 1.0' in metrics
    text = cli(server, "status", "good")
    assert "promoted" in text and "history:" in text and "promote" in text


def test_a_rollout_survives_kill_9_and_resumes_its_step(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for version in (1, 2):
        build_scripted(repo, "canary", version, delay_s=0.001)
    write_config(repo, "canary", scripted_config())
    # Persistence is under test here, not the analysis: thresholds no healthy window misses
    # on a busy machine.
    plan = {**PLAN, "steps": [10, 50, 100], "interval_s": 1.5, "min_requests": 10,
            "max_p99_ratio": 100.0}  # fmt: skip
    first = RemoteServer(
        repo, [], log_dir=tmp_path, command=scripted_command(), expected_exit_code=-9
    )
    with first, httpx.Client(timeout=30) as client:
        traffic, thread = start_traffic(first, "canary")
        try:
            reply = client.post(first.url("/v2/models/canary/rollout"), json=plan)
            assert reply.status_code == 200, reply.text
            wait_for(client, first, "canary", lambda s: s["step"] == 1, 20)
        finally:
            traffic.stop.set()
            thread.join(30)
        first.kill()  # SIGKILL: no shutdown, only what was persisted
    saved = json.loads((repo / "canary" / "rollout.json").read_text())
    assert (saved["status"], saved["step"]) == ("running", 1)
    with RemoteServer(repo, [], log_dir=tmp_path, command=scripted_command()) as second, \
            httpx.Client(timeout=30) as client:  # fmt: skip
        state = status(client, second, "canary")
        assert (state["status"], state["step"]) == ("running", 1)
        assert state["weights"] == {"1": 50.0, "2": 50.0}
        assert "paused" in cli(second, "pause", "canary")
        assert "running" in cli(second, "resume", "canary")
        assert "aborted" in cli(second, "abort", "canary")
        reply = client.post(second.url("/v2/models/canary/rollout"), json={"action": "resume"})
        assert reply.status_code == 400 and "aborted" in reply.json()["error"]
        state = status(client, second, "canary")
        assert state["weights"] == {"1": 100.0}


def test_a_rollout_kept_in_redis_survives_kill_9_without_writing_the_repository(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    for version in (1, 2):
        build_scripted(repo, "canary", version, delay_s=0.001)
    write_config(repo, "canary", scripted_config())
    # An interval no test waits for: persistence is under test, not the analysis.
    plan = {**PLAN, "steps": [10, 50, 100], "interval_s": 600.0}
    with RedisServer(tmp_path / "redis") as redis:
        args = ["--rollout-store", redis.url]
        first = RemoteServer(
            repo, args, log_dir=tmp_path, command=scripted_command(), expected_exit_code=-9
        )
        with first, httpx.Client(timeout=30) as client:
            reply = client.post(first.url("/v2/models/canary/rollout"), json=plan)
            assert reply.status_code == 200, reply.text
            first.kill()
        stored = redis_client.Redis(port=redis.port).hget(REDIS_KEY, "canary")
        assert stored is not None and json.loads(stored)["status"] == "running"
        assert not (repo / "canary" / "rollout.json").exists()
        with RemoteServer(repo, args, log_dir=tmp_path, command=scripted_command()) as second, \
                httpx.Client(timeout=30) as client:  # fmt: skip
            state = status(client, second, "canary")
            assert (state["status"], state["step"]) == ("running", 0)
            assert state["weights"] == {"1": 90.0, "2": 10.0}
            assert "aborted" in cli(second, "abort", "canary")
        assert (
            json.loads(redis_client.Redis(port=redis.port).hget(REDIS_KEY, "canary"))["status"]
            == "aborted"
        )
