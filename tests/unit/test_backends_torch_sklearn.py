"""The torch and sklearn backends return what the framework itself computes."""

from __future__ import annotations

import concurrent.futures
import pickle
from collections.abc import Iterator
from pathlib import Path

import joblib
import numpy as np
import pytest
import torch
from sklearn.datasets import load_iris
from sklearn.linear_model import LinearRegression, LogisticRegression

from slipstream.errors import InvalidRequest
from slipstream.runtime import get_backend
from slipstream.runtime.base import ModelSignature, TensorSpec
from slipstream.runtime.torch import SIGNATURE_FILE, TorchBackend, signature_to_json

# torch 2.13 deprecates every torch.jit entry point in favour of torch.export; serving
# existing TorchScript files is exactly what the torch backend is for.
jit_deprecated = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class TwoHeads(torch.nn.Module):
    """Returns a tuple, and takes two inputs, so order matters both ways."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.scale(x)
        return h - y, (h * y).sum(dim=1)


class DictOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"doubled": x * 2, "total": x.sum(dim=1)}


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    # TorchBackend.load sets torch's process-wide thread count.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _load(kind: str, path: Path, **parameters: str) -> object:
    return get_backend(kind).load(path, dict(parameters), 1)


# --- torch: TorchScript ---------------------------------------------------------------


@jit_deprecated
def test_torchscript_mlp_matches_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Mlp().eval()
    path = tmp_path / "model.pt"
    torch.jit.script(module).save(str(path))
    backend = get_backend("torch").load(path, {}, 1)
    assert backend.releases_gil
    # TorchScript declares no signature: the repository takes it from config.yaml.
    assert backend.signature() == ModelSignature(inputs=(), outputs=())

    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    result = backend.run({"x": x}, ["output"])
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    assert list(result) == ["output"]
    assert result["output"].dtype == np.float32
    np.testing.assert_allclose(result["output"], expected, rtol=1e-5, atol=1e-6)
    backend.close()


@jit_deprecated
def test_torchscript_read_only_input_is_served_without_warning(tmp_path: Path) -> None:
    # Wire decoders hand out read-only views; torch warns on those (an error here).
    path = tmp_path / "model.pt"
    torch.jit.script(DictOut()).save(str(path))
    backend = get_backend("torch").load(path, {}, 1)
    raw = np.arange(6, dtype=np.float32).tobytes()
    x = np.frombuffer(raw, dtype=np.float32).reshape(2, 3)
    result = backend.run({"x": x}, ["total", "doubled"])
    assert list(result) == ["total", "doubled"]
    np.testing.assert_array_equal(result["doubled"], x * 2)
    np.testing.assert_array_equal(result["total"], [3.0, 12.0])


@jit_deprecated
def test_torchscript_tuple_outputs_map_onto_output_names_in_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TwoHeads().eval()
    path = tmp_path / "model.pt"
    torch.jit.trace(module, (torch.ones(2, 4), torch.ones(2, 4))).save(str(path))
    backend = get_backend("torch").load(path, {}, 1)

    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    result = backend.run({"x": x, "y": y}, ["diff", "dot"])
    with torch.no_grad():
        diff, dot = module(torch.from_numpy(x), torch.from_numpy(y))
    np.testing.assert_allclose(result["diff"], diff.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["dot"], dot.numpy(), rtol=1e-5, atol=1e-6)

    with pytest.raises(RuntimeError, match=r"returned 2 output\(s\).*in the order forward"):
        backend.run({"x": x, "y": y}, ["dot"])


@jit_deprecated
def test_torchscript_embedded_signature_orders_inputs_and_outputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = TwoHeads().eval()
    signature = ModelSignature(
        inputs=(TensorSpec("x", "FP32", (-1, 4)), TensorSpec("y", "FP32", (-1, 4))),
        outputs=(TensorSpec("diff", "FP32", (-1, 4)), TensorSpec("dot", "FP32", (-1,))),
    )
    path = tmp_path / "model.pt"
    torch.jit.save(
        torch.jit.script(module),
        str(path),
        _extra_files={SIGNATURE_FILE: signature_to_json(signature)},
    )
    backend = get_backend("torch").load(path, {}, 1)
    assert backend.signature() == signature

    rng = np.random.default_rng(2)
    x, y = (rng.standard_normal((2, 4)).astype(np.float32) for _ in range(2))
    # The declared order wins over the dict's order, and one output may be requested.
    result = backend.run({"y": y, "x": x}, ["dot"])
    with torch.no_grad():
        _, dot = module(torch.from_numpy(x), torch.from_numpy(y))
    assert list(result) == ["dot"]
    np.testing.assert_allclose(result["dot"], dot.numpy(), rtol=1e-5, atol=1e-6)

    with pytest.raises(InvalidRequest, match="missing input 'y'"):
        backend.run({"x": x}, ["dot"])


@jit_deprecated
def test_torchscript_invalid_embedded_signature_fails_load(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(DictOut()), str(path), _extra_files={SIGNATURE_FILE: "{}"})
    with pytest.raises(ValueError, match=r"slipstream_signature\.json: invalid signature"):
        get_backend("torch").load(path, {}, 1)


@jit_deprecated
def test_torch_rejects_bytes_input(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.jit.script(DictOut()).save(str(path))
    backend = get_backend("torch").load(path, {}, 1)
    with pytest.raises(InvalidRequest, match="no BYTES tensors"):
        backend.run({"x": np.array([b"a"], dtype=object)}, ["total"])


@jit_deprecated
def test_torch_pickled_module_is_refused_with_a_fix(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(Mlp().state_dict(), path)
    with pytest.raises(ValueError, match=r"not a TorchScript archive.*torch\.jit\.script"):
        get_backend("torch").load(path, {}, 1)


# --- torch: torch.export programs -----------------------------------------------------


def export_two_heads(tmp_path: Path) -> tuple[Path, TwoHeads]:
    """TwoHeads exported with a dynamic batch dim to ``tmp_path/model.pt2``."""
    torch.manual_seed(0)
    module = TwoHeads().eval()
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        module,
        (torch.ones(2, 4), torch.ones(2, 4)),
        dynamic_shapes={"x": {0: batch}, "y": {0: batch}},
    )
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    return path, module


def test_exported_programs_load_side_by_side(tmp_path: Path) -> None:
    """The model manager loads a repository's models at once, each in a thread:
    torch.export.load keeps its deserializer in a global, and two loads at one time
    failed one model ("_CURRENT_DESERIALIZER is already set")."""
    paths = []
    for index in range(4):
        directory = tmp_path / str(index)
        directory.mkdir()
        paths.append(export_two_heads(directory)[0])
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:
            backends = list(pool.map(lambda path: get_backend("torch").load(path, {}, 1), paths))
        x = np.ones((2, 4), np.float32)
        for backend in backends:
            assert set(backend.run({"x": x, "y": x}, ["output_0", "output_1"])) == {
                "output_0",
                "output_1",
            }


def test_exported_program_signature_and_outputs(tmp_path: Path) -> None:
    path, module = export_two_heads(tmp_path)
    backend = get_backend("torch").load(path, {}, 1)
    assert backend.signature() == ModelSignature(
        inputs=(TensorSpec("x", "FP32", (-1, 4)), TensorSpec("y", "FP32", (-1, 4))),
        outputs=(TensorSpec("output_0", "FP32", (-1, 4)), TensorSpec("output_1", "FP32", (-1,))),
    )
    assert backend.signature().batch_dim_is_dynamic

    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((7, 4)).astype(np.float32) for _ in range(2))
    result = backend.run({"x": x, "y": y}, ["output_1", "output_0"])
    with torch.no_grad():
        diff, dot = module(torch.from_numpy(x), torch.from_numpy(y))
    np.testing.assert_allclose(result["output_0"], diff.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["output_1"], dot.numpy(), rtol=1e-5, atol=1e-6)


class Embedder(torch.nn.Module):
    """Token ids -> summed embedding rows: an id past the table is the request's fault."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).sum(dim=1)


class Faulty(torch.nn.Module):
    """A model whose run fails whatever the data: a fault of the model, not the request."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to("meta").cpu()


@jit_deprecated
@pytest.mark.parametrize("kind", ["script", "export"])
def test_torch_index_past_the_table_is_the_request_s_fault(tmp_path: Path, kind: str) -> None:
    module = Embedder().eval()
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    if kind == "script":
        path = tmp_path / "model.pt"
        torch.jit.script(module).save(str(path))
    else:
        batch = torch.export.Dim("batch")
        program = torch.export.export(
            module, (torch.from_numpy(ids),), dynamic_shapes={"ids": {0: batch}}
        )
        path = tmp_path / "model.pt2"
        torch.export.save(program, str(path))
    backend = get_backend("torch").load(path, {}, 1)
    output = "output" if kind == "export" else "sum"
    assert backend.run({"ids": ids}, [output])[output].shape == (2, 4)
    with pytest.raises(InvalidRequest) as refused:
        backend.run({"ids": np.array([[1, 2, 10]], dtype=np.int64)}, [output])
    # torch's own message, and not TorchScript's traceback (which holds server paths).
    assert refused.value.message.endswith("index out of range in self")
    assert "Traceback" not in refused.value.message and "/" not in refused.value.message


@jit_deprecated
def test_torch_fault_that_is_not_the_data_stays_internal(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.jit.script(Faulty()).save(str(path))
    backend = get_backend("torch").load(path, {}, 1)
    with pytest.raises(Exception) as fault:
        backend.run({"x": np.ones((1, 2), dtype=np.float32)}, ["output"])
    assert not isinstance(fault.value, InvalidRequest)


def test_exported_program_names_dict_and_single_outputs(tmp_path: Path) -> None:
    dict_path, mlp_path = tmp_path / "dict.pt2", tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(DictOut(), (torch.ones(2, 3),)), str(dict_path))
    torch.export.save(torch.export.export(Mlp().eval(), (torch.ones(1, 8),)), str(mlp_path))

    dict_backend = get_backend("torch").load(dict_path, {}, 1)
    # Exported without a dynamic dim, the batch size is fixed.
    assert dict_backend.signature().outputs == (
        TensorSpec("doubled", "FP32", (2, 3)),
        TensorSpec("total", "FP32", (2,)),
    )
    x = np.ones((2, 3), dtype=np.float32)
    np.testing.assert_array_equal(dict_backend.run({"x": x}, ["total"])["total"], [3.0, 3.0])

    mlp_backend = get_backend("torch").load(mlp_path, {}, 1)
    assert mlp_backend.signature() == ModelSignature(
        inputs=(TensorSpec("x", "FP32", (1, 8)),),
        outputs=(TensorSpec("output", "FP32", (1, 3)),),
    )


def test_exported_program_load_refuses_other_files(tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    path.write_bytes(b"not a zip archive")
    with pytest.raises(ValueError, match=r"not a torch\.export program"):
        get_backend("torch").load(path, {}, 1)


# --- torch: parameters ----------------------------------------------------------------


def test_torch_thread_count_parameter_is_set_where_the_model_runs(tmp_path: Path) -> None:
    # torch keeps the count per thread: loading sets nothing (it would not reach the
    # instance thread, and would change what the loading thread's other models use).
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(DictOut(), (torch.ones(2, 3),)), str(path))
    before = torch.get_num_threads()
    backend = get_backend("torch").load(path, {"intra_op_thread_count": "1"}, 1)
    assert torch.get_num_threads() == before
    try:
        backend.run({"x": np.ones((2, 3), np.float32)}, ["total"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"intra_op_thread_count": "0"}, "intra_op_thread_count: expected a positive integer"),
        ({"intra_op_thread_count": "many"}, "intra_op_thread_count: expected a positive"),
        ({"device": "tpu"}, "device: expected cpu, cuda or cuda:N"),
        ({"device": "mps"}, "device: expected cpu, cuda or cuda:N"),
        ({"threads": "2"}, "unknown torch backend parameter"),
        ({"precision": "int8"}, "precision: expected fp32, fp16 or bf16, got 'int8'"),
        ({"precision_mode": "mixed"}, "precision_mode: expected cast or autocast"),
        ({"cuda_graph_batch_sizes": "1,x"}, "cuda_graph_batch_sizes: expected positive"),
        ({"cuda_graph_batch_sizes": "0,4"}, "cuda_graph_batch_sizes: expected positive"),
        ({"cuda_graph_batch_sizes": "1,2"}, "CUDA graphs need device: cuda"),
    ],
)
def test_torch_bad_parameters_fail_load(
    tmp_path: Path, parameters: dict[str, str], message: str
) -> None:
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(DictOut(), (torch.ones(2, 3),)), str(path))
    with pytest.raises(ValueError, match=message):
        get_backend("torch").load(path, parameters, 1)


@pytest.mark.parametrize("mode", ["cast", "autocast"])
def test_torch_bf16_precision_returns_the_declared_fp32_outputs(tmp_path: Path, mode: str) -> None:
    path, module = export_two_heads(tmp_path)
    backend = _load("torch", path, precision="bf16", precision_mode=mode)
    assert isinstance(backend, TorchBackend)
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal((9, 4)).astype(np.float32) for _ in range(2))
    result = backend.run({"x": x, "y": y}, ["output_0", "output_1"])
    with torch.no_grad():
        diff, dot = module(torch.from_numpy(x), torch.from_numpy(y))
    # Served in the FP32 model's datatypes, equal to FP32 within bfloat16's rounding
    # (8 bits of mantissa: a relative error near 2**-8 per operation).
    assert result["output_0"].dtype == np.float32 and result["output_1"].dtype == np.float32
    np.testing.assert_allclose(result["output_0"], diff.numpy(), rtol=0.05, atol=0.05)
    np.testing.assert_allclose(result["output_1"], dot.numpy(), rtol=0.05, atol=0.1)
    # ...and not the FP32 result itself: the precision was applied.
    assert not np.array_equal(result["output_0"], diff.numpy())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_torch_cuda_device_without_cuda_fails_load(tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(DictOut(), (torch.ones(2, 3),)), str(path))
    with pytest.raises(ValueError, match="no CUDA device"):
        get_backend("torch").load(path, {"device": "cuda"}, 1)


# --- sklearn --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def iris_classifier() -> LogisticRegression:
    features, labels = load_iris(return_X_y=True)
    return LogisticRegression(max_iter=1000).fit(features, labels)


def test_sklearn_classifier_matches_scikit_learn(
    tmp_path: Path, iris_classifier: LogisticRegression
) -> None:
    path = tmp_path / "model.joblib"
    joblib.dump(iris_classifier, path)
    backend = get_backend("sklearn").load(path, {}, 1)
    assert not backend.releases_gil
    assert backend.signature() == ModelSignature(
        inputs=(TensorSpec("input", "FP32", (-1, 4)),),
        outputs=(
            TensorSpec("predict", "INT64", (-1,)),
            TensorSpec("predict_proba", "FP32", (-1, 3)),
        ),
    )
    features = load_iris().data[::10].astype(np.float32)
    result = backend.run({"input": features}, ["predict", "predict_proba"])
    np.testing.assert_array_equal(result["predict"], iris_classifier.predict(features))
    assert result["predict_proba"].dtype == np.float32
    np.testing.assert_allclose(
        result["predict_proba"], iris_classifier.predict_proba(features), rtol=1e-6
    )


def test_sklearn_fp64_input_and_pickle_file(
    tmp_path: Path, iris_classifier: LogisticRegression
) -> None:
    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps(iris_classifier))
    backend = get_backend("sklearn").load(path, {"input_dtype": "TYPE_FP64"}, 1)
    assert [s.datatype for s in backend.signature().inputs] == ["FP64"]
    features = load_iris().data[:3]
    result = backend.run({"input": features}, ["predict_proba"])
    assert result["predict_proba"].dtype == np.float64
    np.testing.assert_array_equal(result["predict_proba"], iris_classifier.predict_proba(features))


def test_sklearn_string_labels_are_bytes(tmp_path: Path) -> None:
    features, labels = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"])[labels]
    path = tmp_path / "model.joblib"
    joblib.dump(LogisticRegression(max_iter=1000).fit(features, names), path)
    backend = get_backend("sklearn").load(path, {}, 1)
    assert backend.signature().outputs[0] == TensorSpec("predict", "BYTES", (-1,))
    result = backend.run({"input": features[[0, 100]].astype(np.float32)}, ["predict"])
    assert result["predict"].dtype == object
    assert result["predict"].tolist() == [b"setosa", b"virginica"]


def test_sklearn_multi_output_regressor(tmp_path: Path) -> None:
    features = np.random.default_rng(0).standard_normal((20, 3))
    targets = np.stack([features.sum(axis=1), features[:, 0] * 2], axis=1)
    regressor = LinearRegression().fit(features, targets)
    path = tmp_path / "model.joblib"
    joblib.dump(regressor, path)
    backend = get_backend("sklearn").load(path, {}, 1)
    # No predict_proba on a regressor: only predict is served.
    assert backend.signature().outputs == (TensorSpec("predict", "FP64", (-1, 2)),)
    rows = features[:4].astype(np.float32)
    result = backend.run({"input": rows}, ["predict"])
    np.testing.assert_allclose(result["predict"], regressor.predict(rows), rtol=1e-6)


def test_sklearn_refuses_bad_requests(tmp_path: Path, iris_classifier: LogisticRegression) -> None:
    path = tmp_path / "model.joblib"
    joblib.dump(iris_classifier, path)
    backend = get_backend("sklearn").load(path, {}, 1)
    rows = np.zeros((2, 4), dtype=np.float32)
    with pytest.raises(InvalidRequest, match="unknown output 'label'"):
        backend.run({"input": rows}, ["label"])
    with pytest.raises(InvalidRequest, match=r"expected shape \[batch, n_features\]"):
        backend.run({"input": rows[0]}, ["predict"])
    with pytest.raises(InvalidRequest, match="missing input 'input'"):
        backend.run({"features": rows}, ["predict"])
    # scikit-learn's own input checks: answered with its message.
    with pytest.raises(InvalidRequest, match="refused the request's data: X has 3 features"):
        backend.run({"input": np.zeros((2, 3), dtype=np.float32)}, ["predict"])
    nan_rows = np.full((1, 4), np.nan, dtype=np.float32)
    with pytest.raises(InvalidRequest, match="Input X contains NaN"):
        backend.run({"input": nan_rows}, ["predict_proba"])


def test_sklearn_bad_files_and_parameters_fail_load(
    tmp_path: Path, iris_classifier: LogisticRegression
) -> None:
    not_estimator = tmp_path / "dict.joblib"
    joblib.dump({"weights": [1, 2]}, not_estimator)
    with pytest.raises(ValueError, match="has no predict"):
        get_backend("sklearn").load(not_estimator, {}, 1)

    path = tmp_path / "model.joblib"
    joblib.dump(iris_classifier, path)
    with pytest.raises(ValueError, match="input_dtype: expected FP32 or FP64, got 'INT8'"):
        get_backend("sklearn").load(path, {"input_dtype": "INT8"}, 1)
    with pytest.raises(ValueError, match="unknown sklearn backend parameter"):
        get_backend("sklearn").load(path, {"intra_op_thread_count": "2"}, 1)
