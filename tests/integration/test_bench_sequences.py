"""``slipstream bench`` against a stateful model (``sequence_batching``) on a real server:
every request is in a sequence (an id unique across workers, ``sequence_start`` on the
first, ``sequence_end`` on the last), so none is refused, and no sequence is left open.

The model is a Python model that logs, per request, the CORRID, START and END controls
the server gave it: the log shows the sequences as the server ran them. One model takes
string ids (CORRID TYPE_STRING), one UINT32 ids (a 32-bit bound on the ids).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slipstream.bench.cli import bench
from tests.utils import RemoteServer

SHORT = ["--warmup-s", "0.1", "--window-s", "0.4", "--duration", "0.8"]
LENGTH = 5

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = open(%(log)r, "a")

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            end = pb_utils.get_input_tensor_by_name(request, "END").as_numpy()
            value = corrid.flat[0]
            value = value.decode() if isinstance(value, bytes) else int(value)
            self.log.write("%%s %%d %%d\\n" %% (value, start.flat[0], end.flat[0]))
            data = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", data)]))
        self.log.flush()
        return responses

    def finalize(self):
        self.log.close()
"""

CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
  ]
}
"""

MODELS = {"by_string": "TYPE_STRING", "by_uint32": "TYPE_UINT32"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("bench_sequences")
    repo = root / "repo"
    for name, corrid in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        log = root / f"{name}.log"
        (repo / name / "1" / "model.py").write_text(MODEL % {"log": str(log)})
        (repo / name / "config.pbtxt").write_text(CONFIG % corrid)
    with RemoteServer(repo, ["--trust-pickle"], log_dir=root) as running:
        yield running


def _log(server: RemoteServer, model: str) -> list[tuple[str, int, int]]:
    path = server.repository.parent / f"{model}.log"
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(corrid, int(start), int(end)) for corrid, start, end in rows]


def _stats(server: RemoteServer, model: str) -> dict[str, Any]:
    body = server.http.get(f"/v2/models/{model}/stats").json()
    stats: dict[str, Any] = body["model_stats"][0]["inference_stats"]
    return stats


@pytest.mark.parametrize(
    ("protocol", "model", "concurrency"),
    [("http", "by_string", "1,3"), ("grpc", "by_uint32", "4"), ("http-binary", "by_uint32", "2")],
)
def test_bench_runs_whole_sequences_of_a_stateful_model(
    server: RemoteServer, protocol: str, model: str, concurrency: str, tmp_path: Path
) -> None:
    log = server.repository.parent / f"{model}.log"
    logged_before = len(_log(server, model)) if log.exists() else 0
    failed_before = _stats(server, model)["fail"]["count"]
    url = server.grpc_address if protocol == "grpc" else server.http_url
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        bench,
        [url, "-m", model, "--protocol", protocol, "--concurrency", concurrency,
         "--sequence-length", str(LENGTH), "--workers", "2", "--json", str(out), *SHORT],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"sequences of {LENGTH} requests" in result.output
    document = json.loads(out.read_text())
    ids = "string" if model == "by_string" else "int"
    assert (document["sequence_length"], document["sequence_ids"]) == (LENGTH, ids)
    levels = document["levels"]
    assert all(level["errors"] == 0 and level["requests"] > 10 for level in levels), levels
    # The server refused nothing, and ran every request the bench counted (and more:
    # warm-up and the requests that ended cut sequences).
    assert _stats(server, model)["fail"]["count"] == failed_before
    logged = _log(server, model)[logged_before:]
    assert len(logged) >= sum(level["requests"] for level in levels)
    by_id: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for corrid, start, end in logged:
        by_id[corrid].append((start, end))
    if ids == "int":
        assert all(0 < int(corrid) < 2**32 for corrid in by_id)
    # Each sequence: START first, END last, and nothing else; none left open.
    for corrid, flags in by_id.items():
        assert len(flags) <= LENGTH, (corrid, flags)
        assert flags[0][0] == 1 and flags[-1][1] == 1, (corrid, flags)
        assert all(start == 0 for start, _ in flags[1:]), (corrid, flags)
        assert all(end == 0 for _, end in flags[:-1]), (corrid, flags)
    whole = [flags for flags in by_id.values() if len(flags) == LENGTH]
    assert len(whole) >= len(by_id) // 2
