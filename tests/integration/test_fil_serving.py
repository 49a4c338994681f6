"""Tree models served as Triton's FIL backend serves them, through a real ``slipstream
serve`` and the stock tritonclient over HTTP and gRPC: a config.pbtxt laid out as FIL's
docs/model_config.md example, a config.yaml, no config at all, dynamic batching, and a
corrupt file and a wrong feature count answered without the server going down."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.gated import wait_until
from tests.tree_models import (
    CLASSES,
    FEATURES,
    fil_config,
    rows,
    save,
    train_lightgbm,
    train_xgboost,
)
from tests.utils import RemoteServer

xgboost = pytest.importorskip("xgboost")
lightgbm = pytest.importorskip("lightgbm")

X = rows(256, seed=11)
BATCH_SIZES = (1, 7, 256)
# Requests held up to this long for batch mates: the concurrent ones below share runs.
BATCHED_DELAY_US = 200_000


class Repository:
    """The served models and each one's expected output__0 for the rows X."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.expected: dict[str, np.ndarray] = {}

    def add(self, name: str, expected: np.ndarray) -> Path:
        self.expected[name] = expected.astype(np.float32)
        return self.root / name


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repository:
    repository = Repository(tmp_path_factory.mktemp("fil") / "models")
    binary = train_xgboost("binary")
    p = binary.inplace_predict(X)
    # FIL's docs example, as it is: XGBoost UBJSON, 32 features, classes.
    path = repository.add("fraud", (p > 0.5)[:, None])
    save(binary, path / "1", "xgboost.ubj")
    (path / "config.pbtxt").write_text(
        fil_config("xgboost_ubj", FEATURES, 1, {"output_class": "true"})
    )
    # The same model answering probabilities, requests held for batch mates.
    path = repository.add("fraud_batched", np.stack([1 - p, p], axis=1))
    save(binary, path / "1", "xgboost.json")
    (path / "config.pbtxt").write_text(
        fil_config("xgboost_json", FEATURES, 2, {"predict_proba": "true"}).replace(
            "dynamic_batching {}",
            f"dynamic_batching {{ max_queue_delay_microseconds: {BATCHED_DELAY_US} }}",
        )
    )
    multiclass = train_lightgbm("multiclass")
    path = repository.add("species", multiclass.predict(X))
    save(multiclass, path / "1", "model.txt")
    (path / "config.pbtxt").write_text(
        fil_config("lightgbm", FEATURES, CLASSES, {"predict_proba": "true"})
    )
    # A config.yaml that names the backend only: tensors completed from the file.
    path = repository.add("species_class", multiclass.predict(X).argmax(axis=1)[:, None])
    save(multiclass, path / "1", "model.txt")
    (path / "config.yaml").write_text("backend: fil\nparameters:\n  output_class: 'true'\n")
    # No config at all: a regressor in model.json.
    regressor = train_xgboost("regression")
    path = repository.add("price", regressor.inplace_predict(X)[:, None])
    save(regressor, path / "1", "model.json")
    # A corrupt file under Triton FIL's name.
    broken = repository.root / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "xgboost.model").write_bytes(b"binf\x00\x01garbage")
    (broken.parent / "config.pbtxt").write_text(fil_config("xgboost", FEATURES, 1, {}))
    return repository


@pytest.fixture(scope="module")
def server(repo: Repository, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log_dir = tmp_path_factory.mktemp("fil-logs")
    with RemoteServer(repo.root, log_dir=log_dir, wait_for="live") as running:
        for name in repo.expected:
            wait_until(
                lambda n=name: running.http.get(f"/v2/models/{n}/ready").status_code == 200,
                f"model {name} ready",
            )
        yield running


def http_infer(client: Any, model: str, x: np.ndarray) -> np.ndarray:
    tensor = httpclient.InferInput("input__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    wanted = [httpclient.InferRequestedOutput("output__0", binary_data=True)]
    out: np.ndarray = client.infer(model, [tensor], outputs=wanted).as_numpy("output__0")
    return out


def grpc_infer(client: Any, model: str, x: np.ndarray) -> np.ndarray:
    tensor = grpcclient.InferInput("input__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    out: np.ndarray = client.infer(model, [tensor]).as_numpy("output__0")
    return out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_model_answers_as_its_library_at_each_batch_size(
    server: RemoteServer, repo: Repository, protocol: str
) -> None:
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(server.http_address)
        infer = http_infer
    else:
        client = grpcclient.InferenceServerClient(server.grpc_address)
        infer = grpc_infer
    try:
        for name, expected in repo.expected.items():
            for batch in BATCH_SIZES:
                out = infer(client, name, X[:batch])
                assert out.dtype == np.float32
                np.testing.assert_array_equal(out, expected[:batch], err_msg=f"{name}[{batch}]")
    finally:
        client.close()


def test_completed_configs_say_what_the_files_hold(server: RemoteServer) -> None:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        shapes = {}
        for name in ("fraud", "species", "species_class", "price"):
            config = client.get_model_config(name)
            assert config["backend"] == "fil"
            (tensor,) = config["output"]
            shapes[name] = [int(d) for d in tensor["dims"]]
            assert [int(d) for d in config["input"][0]["dims"]] == [FEATURES]
        assert shapes == {"fraud": [1], "species": [CLASSES], "species_class": [1], "price": [1]}
        assert int(client.get_model_config("price")["max_batch_size"]) == 32768
        metadata = client.get_model_metadata("price")
        assert metadata["inputs"] == [
            {"name": "input__0", "datatype": "FP32", "shape": [-1, FEATURES]}
        ]
    finally:
        client.close()


def test_concurrent_rows_share_runs_and_each_gets_its_own_answer(
    server: RemoteServer, repo: Repository
) -> None:
    client = httpclient.InferenceServerClient(server.http_address, concurrency=8)
    try:
        before = client.get_inference_statistics("fraud_batched")["model_stats"][0]
        pending = []
        for index in range(8):
            tensor = httpclient.InferInput("input__0", [1, FEATURES], "FP32")
            tensor.set_data_from_numpy(X[index : index + 1], binary_data=True)
            pending.append(client.async_infer("fraud_batched", [tensor]))
        answers = np.concatenate([p.get_result().as_numpy("output__0") for p in pending])
        np.testing.assert_array_equal(answers, repo.expected["fraud_batched"][:8])
        after = client.get_inference_statistics("fraud_batched")["model_stats"][0]
        runs = int(after["execution_count"]) - int(before["execution_count"])
        assert int(after["inference_count"]) - int(before["inference_count"]) == 8
        assert runs < 8, "the 8 concurrent rows never shared a run"
    finally:
        client.close()


def test_a_wrong_feature_count_is_a_400_and_the_server_keeps_serving(
    server: RemoteServer, repo: Repository
) -> None:
    short = rows(2, features=FEATURES - 1)
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        with pytest.raises(InferenceServerException, match=r"input__0.*\[2, 31\]") as raised:
            http_infer(http, "fraud", short)
        assert raised.value.status() == "400"
        with pytest.raises(InferenceServerException, match="input__0") as raised:
            grpc_infer(grpc, "fraud", short)
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
        np.testing.assert_array_equal(http_infer(http, "fraud", X[:3]), repo.expected["fraud"][:3])
    finally:
        http.close()
        grpc.close()


def test_a_corrupt_file_leaves_its_model_unavailable_naming_why(server: RemoteServer) -> None:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "xgboost.model" in index["broken"]["reason"]
        assert "legacy binary format" in index["broken"]["reason"]
        assert index["fraud"]["state"] == "READY"
    finally:
        client.close()


def test_runs_on_many_connections_at_once_stay_correct(
    server: RemoteServer, repo: Repository
) -> None:
    failures: list[BaseException] = []

    def worker(offset: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc_address)
        try:
            for start in range(offset, 64, 4):
                out = grpc_infer(client, "species", X[start : start + 3])
                np.testing.assert_array_equal(out, repo.expected["species"][start : start + 3])
        except BaseException as exc:
            failures.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
