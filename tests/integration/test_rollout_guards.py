"""What a rollout and a shadow count, and what they do when a version goes away, through
a real server (explicit model control, the scripted backend and small ONNX models):

- ``vocab``: the candidate's embedding table is smaller than the baseline's, so it
  refuses (400, "the model refused the request's data") rows the baseline serves: the
  refusals count against it and it is rolled back;
- ``shapes``: identical versions under traffic with malformed requests (400 before any
  version runs): those count against neither, and the candidate is promoted;
- ``removal``: a rollout whose candidate, then baseline, is unloaded pauses, says why,
  and resumes once both serve again;
- ``mirror``: a shadow version that fails the marked requests: only those copies count
  as failed, and none of its copies enters the ``slipstream_request_*`` series;
- ``crowded``: a slow shadow version whose queue holds one request: the copies it has no
  room for are dropped, not failed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from prometheus_client.parser import text_string_to_metric_families

from tests.models import build_add_constant, write_config, write_graph
from tests.scripted import build_scripted, scripted_command, scripted_config
from tests.utils import RemoteServer

FINAL = ("promoted", "rolled_back", "aborted")
# A vocab row past the candidate's table (10 rows) and within the baseline's (100).
OUT_OF_CANDIDATE_VOCAB = 50.0


def build_lookup(repo: Path, name: str, version: int, table_rows: int) -> None:
    """INPUT0 FP32 [-1, 4] -> OUTPUT0 = INPUT0 + table[|INPUT0[:, 0]|]: ONNX Runtime
    refuses (INVALID_ARGUMENT) a row whose first value is past the table."""
    nodes = [
        helper.make_node("Slice", ["INPUT0", "zero", "one", "one"], ["col0"]),
        helper.make_node("Abs", ["col0"], ["abs0"]),
        helper.make_node("Cast", ["abs0"], ["ids"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "ids"], ["looked_up"]),  # [B, 1]
        helper.make_node("Add", ["INPUT0", "looked_up"], ["OUTPUT0"]),
    ]
    shape: list[str | int] = ["batch", 4]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape)],
        [
            numpy_helper.from_array(np.zeros(table_rows, np.float32), "table"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
        ],
    )
    write_graph(graph, repo, name, version)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("rollout_guards")
    repo = root / "repo"
    build_lookup(repo, "vocab", 1, table_rows=100)
    build_lookup(repo, "vocab", 2, table_rows=10)
    for name in ("vocab", "shapes"):
        write_config(repo, name, {"version_policy": {"all": {}}, "max_batch_size": 8})
    for version in (1, 2):
        build_add_constant(repo, "shapes", version, 1.0)
        build_scripted(repo, "removal", version)
    write_config(repo, "removal", scripted_config())
    build_scripted(repo, "mirror", 1)
    build_scripted(repo, "mirror", 2, fail_marked=True)
    shadow = {"version": "2", "share": 1.0, "queue": 256}
    write_config(repo, "mirror", scripted_config(rollout={"weights": {"1": 100}, "shadow": shadow}))
    build_scripted(repo, "crowded", 1)
    build_scripted(repo, "crowded", 2, delay_s=0.05)
    crowded = scripted_config(
        max_batch_size=1,
        dynamic_batching={"max_queue_size": 1},
        rollout={"weights": {"1": 100}, "shadow": shadow},
    )
    write_config(repo, "crowded", crowded)
    args = ["--model-control-mode", "explicit"]
    for name in ("vocab", "shapes", "removal", "mirror", "crowded"):
        args += ["--load-model", name]
    with RemoteServer(repo, args, log_dir=root, command=scripted_command()) as running:
        yield running


def body(first: float, width: int = 4) -> dict[str, Any]:
    data = [first, *range(1, width)]
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, width],
                        "data": [float(x) for x in data]}]}  # fmt: skip


def rollout(client: httpx.Client, server: RemoteServer, model: str,
            action: dict[str, Any] | None = None) -> httpx.Response:  # fmt: skip
    url = server.url(f"/v2/models/{model}/rollout")
    return client.get(url) if action is None else client.post(url, json=action)


def status(client: httpx.Client, server: RemoteServer, model: str) -> dict[str, Any]:
    reply = rollout(client, server, model)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def samples(client: httpx.Client, server: RemoteServer, family: str, **labels: str
            ) -> float:  # fmt: skip
    """The sum of ``family``'s samples whose labels include ``labels``."""
    text = client.get(server.url("/metrics")).text
    return sum(
        sample.value
        for metric in text_string_to_metric_families(text)
        for sample in metric.samples
        if sample.name == family and labels.items() <= sample.labels.items()
    )


def drive_until_final(server: RemoteServer, model: str, bad_body: dict[str, Any],
                      codes: Counter[int], timeout_s: float = 30.0) -> dict[str, Any]:  # fmt: skip
    """Send requests to ``model`` back to back, every 4th one ``bad_body``, until its
    rollout ends; the final status."""
    url = server.url(f"/v2/models/{model}/infer")
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=30) as client:
        n = 0
        while True:
            n += 1
            reply = client.post(url, json=bad_body if n % 4 == 0 else body(1.0))
            codes[reply.status_code] += 1
            if n % 50 == 0:
                state = status(client, server, model)
                if state["status"] in FINAL:
                    return state
                assert time.monotonic() < deadline, state


def test_data_the_candidate_refuses_counts_against_it_and_malformed_requests_do_not(
    server: RemoteServer,
) -> None:
    plan = {"action": "start", "candidate": "2", "baseline": "1", "steps": [50],
            "interval_s": 1.0, "min_requests": 10, "max_p99_ratio": 100.0}  # fmt: skip
    with httpx.Client(timeout=30) as client:
        for model in ("vocab", "shapes"):
            reply = rollout(client, server, model, plan)
            assert reply.status_code == 200, reply.text
    traffic = {
        "vocab": body(OUT_OF_CANDIDATE_VOCAB),  # served by 1, refused by 2
        "shapes": body(1.0, width=3),  # refused by the config's shape before any run
    }
    codes = {model: Counter[int]() for model in traffic}
    final: dict[str, dict[str, Any]] = {}

    def drive(model: str) -> None:
        final[model] = drive_until_final(server, model, traffic[model], codes[model])

    threads = [threading.Thread(target=drive, args=(model,)) for model in traffic]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    vocab, shapes = final["vocab"], final["shapes"]
    # Only the candidate's refusals failed: half the split's marked requests.
    assert set(codes["vocab"]) == {200, 400}, codes
    assert vocab["status"] == "rolled_back", vocab["history"]
    assert "error rate" in vocab["reason"], vocab["reason"]
    assert vocab["last_verdict"]["figures"]["baseline_error_rate"] == 0.0
    assert set(codes["shapes"]) == {200, 400}, codes
    assert shapes["status"] == "promoted", shapes["history"]
    assert shapes["last_verdict"]["figures"]["candidate_error_rate"] == 0.0


def set_versions(client: httpx.Client, server: RemoteServer, versions: list[int]) -> None:
    """Serve only ``versions`` of ``removal`` (a reload with a version policy)."""
    policy = {"specific": {"versions": versions}}
    write_config(server.repository, "removal", scripted_config(version_policy=policy))
    reply = client.post(server.url("/v2/repository/models/removal/load"))
    assert reply.status_code == 200, reply.text


def test_a_rollout_pauses_saying_why_when_its_candidate_or_baseline_stops_serving(
    server: RemoteServer,
) -> None:
    # An interval no test waits for: no window is judged here.
    plan = {"action": "start", "candidate": "2", "baseline": "1", "steps": [10, 50],
            "interval_s": 600.0}  # fmt: skip
    with httpx.Client(timeout=30) as client:
        assert rollout(client, server, "removal", plan).status_code == 200
        set_versions(client, server, [1])
        state = status(client, server, "removal")
        assert state["status"] == "paused", state
        assert "candidate (version 2)" in state["reason"], state["reason"]
        assert state["history"][-1]["event"] == "pause"
        assert state["weights"] == {"1": 100.0}
        assert samples(client, server, "slipstream_rollout_state", model="removal",
                       state="paused") == 1.0  # fmt: skip
        assert "candidate (version 2) of 'removal' stopped serving" in server.log_text()
        # Resuming without the candidate is refused, naming it.
        reply = rollout(client, server, "removal", {"action": "resume"})
        assert reply.status_code == 400 and "version 2" in reply.json()["error"], reply.text
        set_versions(client, server, [1, 2])
        assert status(client, server, "removal")["status"] == "paused"  # until resumed
        resumed = rollout(client, server, "removal", {"action": "resume"}).json()
        assert (resumed["status"], resumed["reason"]) == ("running", "")
        assert resumed["weights"] == {"1": 90.0, "2": 10.0}
        # Without the baseline, the candidate would take all the traffic: paused too.
        set_versions(client, server, [2])
        state = status(client, server, "removal")
        assert state["status"] == "paused", state
        assert "baseline (version 1)" in state["reason"], state["reason"]
        assert state["step"] == 0
        aborted = rollout(client, server, "removal", {"action": "abort"}).json()
        assert aborted["status"] == "aborted"


def shadow_outcomes(client: httpx.Client, server: RemoteServer, model: str = "mirror"
                    ) -> dict[str, float]:  # fmt: skip
    return {
        outcome: samples(client, server, "slipstream_shadow_requests_total", model=model,
                         version="2", outcome=outcome)
        for outcome in ("agreed", "disagreed", "failed", "dropped")
    }  # fmt: skip


def mirror_traffic(client: httpx.Client, server: RemoteServer, count: int = 40) -> Counter[int]:
    """``count`` requests to ``mirror`` back to back, every 4th marked (version 2, the
    shadow, fails those); waits until every copy is counted; the clients' statuses."""
    before = sum(shadow_outcomes(client, server).values())
    codes: Counter[int] = Counter()
    url = server.url("/v2/models/mirror/infer")
    for n in range(count):
        codes[client.post(url, json=body(-1.0 if n % 4 == 3 else 1.0)).status_code] += 1
    deadline = time.monotonic() + 10
    while sum(shadow_outcomes(client, server).values()) < before + count:
        assert time.monotonic() < deadline, shadow_outcomes(client, server)
        time.sleep(0.02)
    return codes


def test_one_failing_shadow_copy_fails_alone(server: RemoteServer) -> None:
    with httpx.Client(timeout=30) as client:
        before = shadow_outcomes(client, server)
        codes = mirror_traffic(client, server)
        after = shadow_outcomes(client, server)
    assert codes == {200: 40}
    counted = {outcome: after[outcome] - before[outcome] for outcome in after}
    # Copies run stacked; the marked ones fail on version 2 as they would sent to it.
    assert counted == {"agreed": 30.0, "disagreed": 0.0, "failed": 10.0, "dropped": 0.0}


def test_shadow_copies_stay_out_of_the_request_series(server: RemoteServer) -> None:
    def requests(version: str) -> tuple[float, float]:
        labels = {"model": "mirror", "version": version}
        return (samples(client, server, "slipstream_request_success_total", **labels),
                samples(client, server, "slipstream_request_failure_total", **labels))  # fmt: skip

    with httpx.Client(timeout=30) as client:
        primary, shadow = requests("1"), requests("2")
        codes = mirror_traffic(client, server)
        assert codes == {200: 40}
        # The clients' 40 requests, all answered by version 1; version 2 ran 40 copies
        # (10 failed) that no client sent: its series count none of them.
        assert requests("1") == (primary[0] + 40, primary[1])
        assert requests("2") == shadow
        assert shadow_outcomes(client, server)["failed"] > 0


def test_copies_a_full_shadow_queue_has_no_room_for_are_dropped_not_failed(
    server: RemoteServer,
) -> None:
    url = server.url("/v2/models/crowded/infer")
    with httpx.Client(timeout=30) as client:
        # One at a time: version 1's own queue (one request, too) never overflows.
        codes = Counter(client.post(url, json=body(1.0)).status_code for _ in range(40))
    assert codes == {200: 40}
    with httpx.Client(timeout=30) as client:
        deadline = time.monotonic() + 20
        while sum((counted := shadow_outcomes(client, server, "crowded")).values()) < 40:
            assert time.monotonic() < deadline, counted
            time.sleep(0.05)
    # Version 2 takes 50 ms a copy and queues one: most copies find no room.
    assert counted["failed"] == 0, counted
    assert counted["dropped"] > 0 and counted["agreed"] > 0, counted
