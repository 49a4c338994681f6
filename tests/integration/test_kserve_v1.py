"""KServe's V1 protocol (``POST /v1/models/<m>:predict``, ``GET /v1/models[/<m>]``) on a
real ``slipstream serve``, over HTTP as KServe's V1 clients and curl scripts send it:
row and columnar bodies, batches of 1 to 32 rows, models of one and of several inputs,
the datatypes of the model's config, answers equal to the same V2 request's, V1 and V2
requests batched together, errors, and once in the split layout behind API keys.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from slipstream.security.keys import KeyRing
from tests.models import (
    ADD_SUB_WIDTH,
    build_add_constant,
    build_add_sub,
    build_classifier,
    build_identity,
    build_mean_embedding,
    write_config,
)
from tests.utils import RemoteServer

BUILD_MODELS = Path(__file__).resolve().parents[2] / "examples" / "build_models.py"
MLP_WIDTH = 256
# A model whose batcher waits (up to 2 s) for a second request before it runs a batch.
BATCHED = "add_sub_batched"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("kserve_v1")
    repo = root / "models"
    subprocess.run([sys.executable, str(BUILD_MODELS), str(repo), "--only", "mlp"],
                   check=True, capture_output=True)  # fmt: skip
    build_add_sub(repo)
    build_add_sub(repo, BATCHED)
    build_classifier(repo, "classifier")
    write_config(repo, BATCHED, {"max_batch_size": 8, "dynamic_batching": {
        "max_queue_delay_microseconds": 2_000_000, "preferred_batch_size": [2]}})  # fmt: skip
    for datatype in ("BYTES", "BOOL", "INT32"):
        build_identity(repo, datatype)
    # An embedding model: served on the OpenAI routes too.
    table = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    build_mean_embedding(repo, "embed", table)
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(repo / "embed" / "tokenizer.json"))
    write_config(repo, "embed", {"max_batch_size": 8, "tokenizer": "tokenizer.json"})
    # A model that fails to load: in the repository, never ready.
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    with RemoteServer(repo, ["--no-strict-readiness"], log_dir=root) as running:
        yield running


def predict(server: RemoteServer, model: str, body: Any, version: str = "") -> httpx.Response:
    versions = f"/versions/{version}" if version else ""
    return server.http.post(f"/v1/models/{model}{versions}:predict", json=body)


def answer(reply: httpx.Response) -> Any:
    assert reply.status_code == 200, reply.text
    return reply.json()


def v2_infer(server: RemoteServer, model: str, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """The FP32 outputs of the same inference over V2."""
    tensors = [{"name": name, "shape": list(array.shape), "datatype": "FP32",
                "data": array.ravel().tolist()} for name, array in inputs.items()]  # fmt: skip
    outputs = answer(server.http.post(f"/v2/models/{model}/infer", json={"inputs": tensors}))
    return {out["name"]: np.array(out["data"], np.float32).reshape(out["shape"])
            for out in outputs["outputs"]}  # fmt: skip


def rows(count: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, width)).astype(np.float32)


def error_of(reply: httpx.Response, status: int) -> str:
    """KServe's error shape: {"error": "<message>"}."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert isinstance(error, str) and error
    return error


# -- formats ------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 7, 32])
def test_rows_answer_one_prediction_each_as_v2_answers(server: RemoteServer, count: int) -> None:
    x = rows(count, MLP_WIDTH, seed=count)
    predictions = answer(predict(server, "mlp", {"instances": x.tolist()}))["predictions"]
    assert len(predictions) == count and all(len(row) == 10 for row in predictions)
    expected = v2_infer(server, "mlp", {"input": x})["output"]
    np.testing.assert_array_equal(np.array(predictions, np.float32), expected)


@pytest.mark.parametrize("count", [1, 5])
def test_columns_answer_the_whole_output_as_v2_answers(server: RemoteServer, count: int) -> None:
    x = rows(count, MLP_WIDTH, seed=100 + count)
    outputs = answer(predict(server, "mlp", {"inputs": x.tolist()}))["outputs"]
    expected = v2_infer(server, "mlp", {"input": x})["output"]
    np.testing.assert_array_equal(np.array(outputs, np.float32), expected)
    # Named by the input, as a model of several inputs needs.
    named = answer(predict(server, "mlp", {"inputs": {"input": x.tolist()}}))["outputs"]
    assert named == outputs


def test_a_model_of_several_inputs_and_outputs_row_by_row(server: RemoteServer) -> None:
    a, b = rows(3, ADD_SUB_WIDTH, 1), rows(3, ADD_SUB_WIDTH, 2)
    instances = [{"INPUT0": a[i].tolist(), "INPUT1": b[i].tolist()} for i in range(3)]
    predictions = answer(predict(server, "add_sub", {"instances": instances}))["predictions"]
    expected = v2_infer(server, "add_sub", {"INPUT0": a, "INPUT1": b})
    assert [sorted(row) for row in predictions] == [["OUTPUT0", "OUTPUT1"]] * 3
    for name in ("OUTPUT0", "OUTPUT1"):
        got = np.array([row[name] for row in predictions], np.float32)
        np.testing.assert_array_equal(got, expected[name])
    np.testing.assert_array_equal(expected["OUTPUT0"], a + b)


def test_a_model_of_several_inputs_and_outputs_by_columns(server: RemoteServer) -> None:
    a, b = rows(4, ADD_SUB_WIDTH, 3), rows(4, ADD_SUB_WIDTH, 4)
    body = {"inputs": {"INPUT0": a.tolist(), "INPUT1": b.tolist()}}
    outputs = answer(predict(server, "add_sub", body))["outputs"]
    assert sorted(outputs) == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(np.array(outputs["OUTPUT0"], np.float32), a + b)
    np.testing.assert_array_equal(np.array(outputs["OUTPUT1"], np.float32), a - b)


def test_a_classifier_answers_a_label_and_probabilities_per_row(server: RemoteServer) -> None:
    """An INT64 label [N] beside probabilities [N, 4], as scikit-learn classifiers export."""
    body = {"instances": [[9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0]]}
    predictions = answer(predict(server, "classifier", body))["predictions"]
    assert [row["label"] for row in predictions] == [0, 2]
    assert [len(row["probabilities"]) for row in predictions] == [4, 4]
    assert predictions[1]["probabilities"][2] > 0.99


def test_a_version_in_the_path(server: RemoteServer) -> None:
    x = rows(2, MLP_WIDTH, 5)
    assert answer(predict(server, "mlp", {"instances": x.tolist()}, version="1"))
    assert "version 9" in error_of(predict(server, "mlp", {"inputs": x.tolist()}, "9"), 404)


def test_datatypes_come_from_the_models_config(server: RemoteServer) -> None:
    text = "wörld"
    b64 = base64.b64encode(text.encode()).decode()
    body = {"instances": [["hello", {"b64": b64}], ["a", "b"]]}
    assert answer(predict(server, "identity_bytes", body)) == {
        "predictions": [["hello", text], ["a", "b"]]
    }
    flags = {"inputs": [[True, False, True]]}
    assert answer(predict(server, "identity_bool", flags)) == {"outputs": flags["inputs"]}
    ints = {"instances": [[1, -2], [2**31 - 1, 0]]}
    assert answer(predict(server, "identity_int32", ints)) == {"predictions": ints["instances"]}


def test_signature_name_is_ignored_as_kserve_ignores_it(server: RemoteServer) -> None:
    body = {"signature_name": "serving_default", "instances": [[1, 2]]}
    assert answer(predict(server, "identity_int32", body)) == {"predictions": [[1, 2]]}


def test_v1_and_v2_requests_to_one_model_run_in_one_batch(server: RemoteServer) -> None:
    """The model's batcher waits (up to 2 s) for a second request: a V1 and a V2 request
    sent together run as one batch of two, and the statistics count both."""
    a, b = rows(1, ADD_SUB_WIDTH, 6), rows(1, ADD_SUB_WIDTH, 7)
    v1_body = {"instances": [{"INPUT0": a[0].tolist(), "INPUT1": b[0].tolist()}]}
    with ThreadPoolExecutor(2) as pool:
        v1 = pool.submit(predict, server, BATCHED, v1_body)
        v2 = pool.submit(v2_infer, server, BATCHED, {"INPUT0": b, "INPUT1": a})
        predictions = answer(v1.result())["predictions"]
        np.testing.assert_array_equal(v2.result()["OUTPUT1"], b - a)
    np.testing.assert_array_equal(np.array(predictions[0]["OUTPUT1"], np.float32), a[0] - b[0])
    stats = answer(server.http.get(f"/v2/models/{BATCHED}/stats"))["model_stats"][0]
    assert (stats["inference_count"], stats["execution_count"]) == (2, 1)
    assert stats["inference_stats"]["success"]["count"] == 2


# -- errors ------------------------------------------------------------------------------


def _width_rows() -> list[list[float]]:
    return [[0.0] * MLP_WIDTH, [0.0] * (MLP_WIDTH - 1)]


def _pair(first: str, second: str) -> dict[str, list[float]]:
    return {first: [0.0] * ADD_SUB_WIDTH, second: [0.0] * ADD_SUB_WIDTH}


@pytest.mark.parametrize(
    ("model", "body", "fragment"),
    [
        ("mlp", {"instances": [[0.0]], "inputs": [[0.0]]}, 'exactly one of "instances"'),
        ("mlp", {"instance": [[0.0]]}, "got neither (keys: instance)"),
        ("mlp", {"instances": []}, "instances: expected a non-empty list"),
        ("mlp", [[0.0]], "request body: expected a JSON object"),
        ("mlp", {"instances": _width_rows()}, "instances[1]: a list of 255 values where "
         "instances[0] has a list of 256 values"),
        ("mlp", {"instances": [[0.0, 1.0]]}, "input 'input': shape [1, 2] does not match"),
        ("mlp", {"instances": [["a"] * MLP_WIDTH]}, "instances: FP32 data must be numbers"),
        ("identity_int32", {"inputs": [[1.5]]}, "inputs: INT32 data must be integers"),
        ("identity_bytes", {"instances": [[{"b64": "%%"}]]}, "instances: b64: not valid"),
        ("identity_bytes", {"instances": [[7]]}, "BYTES data must be strings or"),
        ("add_sub", {"instances": [_pair("INPUT0", "INPUT1"), _pair("INPUT0", "X")]},
         "instances[1]: input 'INPUT1' is missing"),
        ("add_sub", {"instances": [_pair("INPUT0", "nope")]},
         "instances[0]: 'nope' is not an input of model 'add_sub'"),
        ("add_sub", {"instances": [[0.0] * ADD_SUB_WIDTH]},
         "instances: model 'add_sub' has 2 inputs (INPUT0, INPUT1)"),
        ("add_sub", {"inputs": {"INPUT0": [[0.0] * ADD_SUB_WIDTH]}}, "input 'INPUT1'"),
    ],
)  # fmt: skip
def test_a_bad_request_is_400_naming_the_field(
    server: RemoteServer, model: str, body: Any, fragment: str
) -> None:
    assert fragment in error_of(predict(server, model, body), 400)


def test_an_unknown_model_is_404_and_a_wrong_method_405(server: RemoteServer) -> None:
    assert "nope" in error_of(predict(server, "nope", {"instances": [[0.0]]}), 404)
    reply = server.http.get("/v1/models/mlp:predict")
    assert "use POST" in error_of(reply, 405)
    assert reply.headers["allow"] == "POST"
    assert ":explain" in error_of(server.http.post("/v1/models/mlp:explain", json={}), 404)


# -- listing and readiness ---------------------------------------------------------------


def test_the_model_list_serves_kserve_and_the_openai_sdk(server: RemoteServer) -> None:
    listing = answer(server.http.get("/v1/models"))
    # KServe V1: every model served (not the one that failed to load).
    assert listing["models"] == sorted(
        [
            "add_sub",
            BATCHED,
            "classifier",
            "embed",
            "identity_bool",
            "identity_bytes",
            "identity_int32",
            "mlp",
        ]
    )
    # OpenAI: the models of the OpenAI routes, as the SDK reads them.
    assert [card.id for card in server.openai().models.list()] == ["embed"]


def test_readiness_of_a_tensor_model_an_openai_model_and_a_failed_one(
    server: RemoteServer,
) -> None:
    assert answer(server.http.get("/v1/models/mlp")) == {"name": "mlp", "ready": True}
    card = answer(server.http.get("/v1/models/embed"))
    assert (card["id"], card["object"], card["name"], card["ready"]) == (
        "embed", "model", "embed", True
    )  # fmt: skip
    assert server.openai().models.retrieve("embed").id == "embed"
    reply = server.http.get("/v1/models/broken")
    assert reply.status_code == 503
    assert reply.json()["name"] == "broken" and reply.json()["ready"] is False
    assert server.http.get("/v1/models/nope").status_code == 404


# -- the split layout, behind API keys --------------------------------------------------


@pytest.fixture(scope="module")
def keyed_split(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RemoteServer, dict[str, str]]]:
    root = tmp_path_factory.mktemp("kserve_v1_split")
    build_add_sub(root / "models")
    build_add_constant(root / "models", "plus", 1, 1.0)
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    keys = {"app": ring.create("app", "infer")[0],
            "tenant": ring.create("tenant", "infer", models=["plus"])[0]}  # fmt: skip
    ring.save()
    args = ["--frontends", "1", "--auth-file", str(root / "keys.json")]
    with RemoteServer(root / "models", args, log_dir=root) as running:
        yield running, keys


def test_split_layout_with_keys(keyed_split: tuple[RemoteServer, dict[str, str]]) -> None:
    server, keys = keyed_split
    a, b = rows(2, ADD_SUB_WIDTH, 8), rows(2, ADD_SUB_WIDTH, 9)
    body = {"inputs": {"INPUT0": a.tolist(), "INPUT1": b.tolist()}}
    path = "/v1/models/add_sub:predict"
    refused = server.http.post(path, json=body)
    assert "key" in error_of(refused, 401).lower()
    assert refused.headers["www-authenticate"].startswith("Bearer")
    tenant = {"Authorization": f"Bearer {keys['tenant']}"}
    error_of(server.http.post(path, json=body, headers=tenant), 403)
    app = {"Authorization": f"Bearer {keys['app']}"}
    outputs = answer(server.http.post(path, json=body, headers=app))["outputs"]
    np.testing.assert_array_equal(np.array(outputs["OUTPUT0"], np.float32), a + b)
    plus = server.http.post("/v1/models/plus:predict", json={"instances": [[1, 2, 3, 4]]},
                            headers=tenant)  # fmt: skip
    assert answer(plus) == {"predictions": [[2.0, 3.0, 4.0, 5.0]]}
    # A key limited to some models lists only those.
    assert answer(server.http.get("/v1/models", headers=tenant))["models"] == ["plus"]
    assert answer(server.http.get("/v1/models", headers=app))["models"] == ["add_sub", "plus"]
    assert answer(server.http.get("/v1/models/plus", headers=tenant)) == {
        "name": "plus", "ready": True
    }  # fmt: skip
