"""Small ONNX models written into a model repository for the server tests.

Every builder writes ``REPO/<name>/<version>/model.onnx`` (plus ``config.yaml`` when
given one) and returns the model file's path, so a test can run the very same file in
ONNX Runtime in-process and compare what the server answers with it.

    repo = tmp_path / "models"
    build_add_sub(repo)
    build_identity(repo, "FP16")          # model "identity_fp16"

A model whose runs wait for the test (queue behaviour) is the gated backend in
``tests/gated.py``, not an ONNX model slow enough on some machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import yaml
from onnx import TensorProto, helper, numpy_helper

# Opset and IR version every ONNX Runtime >= 1.18 reads.
_OPSET = 17
_IR_VERSION = 8

# V2 datatype -> ONNX element type, for every V2 datatype ONNX has.
V2_TO_ONNX: dict[str, int] = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "BF16": TensorProto.BFLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}
NUMERIC_DATATYPES = [name for name in V2_TO_ONNX if name != "BYTES"]

# Width of add_sub's inputs and outputs: [batch, ADD_SUB_WIDTH].
ADD_SUB_WIDTH = 16
# Fixed shape of the non-batching model's input and output.
FIXED_SHAPE = (2, 4)


def _save(model: onnx.ModelProto, repo: Path, name: str, version: int) -> Path:
    model.ir_version = _IR_VERSION
    onnx.checker.check_model(model)
    path = repo / name / str(version) / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])


def write_graph(graph: onnx.GraphProto, repo: Path, name: str, version: int = 1) -> Path:
    """REPO/NAME/VERSION/model.onnx of ``graph`` (standard opset, checked); its path."""
    return _save(_model(graph), repo, name, version)


def write_config(repo: Path, name: str, config: dict[str, Any] | str) -> Path:
    """Write ``REPO/<name>/config.yaml`` from a mapping, or verbatim from a string."""
    path = repo / name / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return path


def build_add_sub(repo: Path, name: str = "add_sub", version: int = 1) -> Path:
    """INPUT0, INPUT1 FP32 [-1, 16] -> OUTPUT0 = sum, OUTPUT1 = difference. No config."""
    shape: list[str | int] = ["batch", ADD_SUB_WIDTH]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        name,
        [
            helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("INPUT1", TensorProto.FLOAT, shape),
        ],
        [
            helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("OUTPUT1", TensorProto.FLOAT, shape),
        ],
    )
    return _save(_model(graph), repo, name, version)


def identity_name(datatype: str) -> str:
    """Repository name of the identity model of one V2 datatype."""
    return f"identity_{datatype.lower()}"


def build_identity(repo: Path, datatype: str, name: str | None = None) -> Path:
    """INPUT0 -> OUTPUT0 unchanged, of one V2 datatype, shape [-1, -1]. No config."""
    element = V2_TO_ONNX[datatype]
    shape: list[str | int] = ["batch", "width"]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        identity_name(datatype),
        [helper.make_tensor_value_info("INPUT0", element, shape)],
        [helper.make_tensor_value_info("OUTPUT0", element, shape)],
    )
    return _save(_model(graph), repo, name or identity_name(datatype), 1)


def build_fixed(repo: Path, name: str = "fixed") -> Path:
    """A non-batching model: INPUT0 FP32 of fixed shape [2, 4] -> OUTPUT0 = 2 * INPUT0."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT0"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, list(FIXED_SHAPE))],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, list(FIXED_SHAPE))],
    )
    return _save(_model(graph), repo, name, 1)


def build_add_constant(repo: Path, name: str, version: int, constant: float) -> Path:
    """INPUT0 FP32 [-1, 4] -> OUTPUT0 = INPUT0 + constant; tells versions apart."""
    shape: list[str | int] = ["batch", 4]
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "C"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array(constant, np.float32), "C")],
    )
    return _save(_model(graph), repo, name, version)


def run_onnx(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a model file in-process with ONNX Runtime: the reference for served outputs."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    if any(array.dtype == ml_dtypes.bfloat16 for array in inputs.values()):
        return _run_onnx_bf16(session, names, inputs)
    feed = {name: _for_ort(array) for name, array in inputs.items()}
    return dict(zip(names, session.run(names, feed), strict=True))


def _run_onnx_bf16(
    session: ort.InferenceSession, names: list[str], inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    # ORT's Python API takes and gives bfloat16 only as OrtValues; the outputs are read
    # back through a float32 Cast run by ORT itself (cast_to_fp32.onnx below).
    values = {
        name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(array).view(np.uint16), TensorProto.BFLOAT16
        )
        if array.dtype == ml_dtypes.bfloat16
        else ort.OrtValue.ortvalue_from_numpy(array)
        for name, array in inputs.items()
    }
    results = session.run_with_ort_values(names, values)
    cast = ort.InferenceSession(_cast_to_fp32().SerializeToString())
    out: dict[str, np.ndarray] = {}
    for name, value in zip(names, results, strict=True):
        if value.data_type() != "tensor(bfloat16)":
            out[name] = value.numpy()
            continue
        (wide,) = cast.run_with_ort_values(["y"], {"x": value})
        out[name] = wide.numpy().astype(ml_dtypes.bfloat16)  # exact: the values are bf16
    return out


def _cast_to_fp32() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        "cast_to_fp32",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = _model(graph)
    model.ir_version = _IR_VERSION
    return model


def _for_ort(array: np.ndarray) -> np.ndarray:
    # ONNX Runtime string tensors take str elements; V2 BYTES tensors hold bytes.
    if array.dtype != np.object_:
        return array
    text = np.empty(array.shape, dtype=object)
    text.flat[:] = [item.decode() if isinstance(item, bytes) else item for item in array.flat]
    return text


def _masked_mean_nodes(output: str) -> list[onnx.NodeProto]:
    """``output`` = mean of the rows of initializer ``table`` that ``input_ids`` picks,
    over ``attention_mask`` (initializers ``last`` = [-1] and ``tokens_axis`` = [1])."""
    return [
        helper.make_node("Gather", ["table", "input_ids"], ["rows"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
        helper.make_node("Mul", ["rows", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "tokens_axis"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["maskf", "tokens_axis"], ["count"], keepdims=1),
        helper.make_node("Div", ["summed", "count"], [output]),
    ]


def build_mean_embedding(repo: Path, name: str, table: np.ndarray) -> Path:
    """Sentence embedding = mean of token rows of ``table`` over the attention mask.

    Inputs ``input_ids`` and ``attention_mask`` INT64 [-1, -1]; output ``embedding``
    FP32 [-1, dim]. The numpy reference is :func:`mean_embedding`.
    """
    dim = table.shape[1]
    nodes = _masked_mean_nodes("embedding")
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [-1, -1]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [-1, -1]),
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [-1, dim])],
        initializer=[
            numpy_helper.from_array(table.astype(np.float32), "table"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "last"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "tokens_axis"),
        ],
    )
    return _save(_model(graph), repo, name, 1)


def build_positions(repo: Path, name: str, positions: int) -> Path:
    """Token scores = (id + its position's bias) x mask, from a table of ``positions``
    biases, as an encoder adds its position embeddings.

    Inputs ``input_ids`` and ``attention_mask`` INT64 ``[batch, tokens]``, named
    dimensions both inputs share; output ``scores`` FP32 ``[batch, tokens]``. A
    sequence of another length than ``positions`` (or 1) is one ONNX Runtime refuses
    when it runs (its Add cannot broadcast), as an encoder refuses one past its table.
    """
    dims = ["batch", "tokens"]
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["ids", "bias"], ["biased"]),
        helper.make_node("Mul", ["biased", "mask"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims),
        ],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, dims)],
        initializer=[
            numpy_helper.from_array(
                np.arange(positions, dtype=np.float32).reshape(1, positions) / 10, "bias"
            )
        ],
    )
    return _save(_model(graph), repo, name, 1)


def mean_embedding(table: np.ndarray, ids: list[int]) -> np.ndarray:
    return np.asarray(table[ids].mean(axis=0), dtype=np.float32)


def build_tiny_encoder(repo: Path, name: str = "encoder", vocab: int = 64, dim: int = 32) -> Path:
    """A MiniLM-shaped toy: embedding lookup, masked mean, a projection and a tanh.

    Inputs ``input_ids`` and ``attention_mask`` INT64 [-1, -1]; output ``embedding``
    FP32 [-1, dim // 2]. A Gather and a MatMul with fixed random weights: what the
    int8 passes quantize in a real encoder, small enough to quantize in milliseconds.
    """
    rng = np.random.default_rng(7)
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    weight = (rng.standard_normal((dim, dim // 2)) / np.sqrt(dim)).astype(np.float32)
    nodes = [
        *_masked_mean_nodes("mean"),
        helper.make_node("MatMul", ["mean", "weight"], ["projected"]),
        helper.make_node("Tanh", ["projected"], ["embedding"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "tokens"]),
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", dim // 2])],
        initializer=[
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "last"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "tokens_axis"),
        ],
    )
    return _save(_model(graph), repo, name, 1)


def tiny_encoder_rows(count: int, vocab: int = 64, tokens: int = 6) -> dict[str, np.ndarray]:
    """``count`` rows for :func:`build_tiny_encoder`, the last tokens of some padded."""
    rng = np.random.default_rng(3)
    ids = rng.integers(1, vocab, size=(count, tokens), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[::3, tokens - 2 :] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


# Width of the toy classifier's input (one score per class).
CLASSIFIER_CLASSES = 4


def build_classifier(repo: Path, name: str, label_offset: int = 0) -> Path:
    """A toy classifier: ``x`` FP32 [-1, 4] scores in, ``probabilities`` (softmax of
    the scores) FP32 [-1, 4] and ``label`` (argmax + ``label_offset``) INT64 [-1] out.

    A row like [9, 0, 0, 0] is a confident answer (top probability ~1); [0, 0, 0, 0] an
    unsure one (0.25). ``label_offset`` tells two such models' answers apart.
    """
    width = CLASSIFIER_CLASSES
    offset = numpy_helper.from_array(np.array(label_offset, np.int64), "offset")
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["probabilities"], axis=1),
            helper.make_node("ArgMax", ["x"], ["argmax"], axis=1, keepdims=0),
            helper.make_node("Add", ["argmax", "offset"], ["label"]),
        ],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", width]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
        ],
        initializer=[offset],
    )
    return _save(_model(graph), repo, name, 1)


@contextmanager
def add_sub_region(name: str, rows: int = 2) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """A client's system shared-memory region ``name`` holding add_sub's two inputs (3s,
    then 4s; [rows, ADD_SUB_WIDTH] each), destroyed on exit: (its key, INPUT0, INPUT1)."""
    import tritonclient.utils.shared_memory as shm

    a, b = (np.full((rows, ADD_SUB_WIDTH), v, np.float32) for v in (3.0, 4.0))
    key = f"/slipstream_{name}_{os.getpid()}"
    region = shm.create_shared_memory_region(name, key, a.nbytes + b.nbytes)
    try:
        shm.set_shared_memory_region(region, [a, b])
        yield key, a, b
    finally:
        shm.destroy_shared_memory_region(region)


def add_sub_region_inputs(name: str, a: np.ndarray, b: np.ndarray) -> list[Any]:
    """gRPC inputs of add_sub that read region ``name`` (:func:`add_sub_region`)."""
    import tritonclient.grpc as grpcclient

    inputs = [grpcclient.InferInput(n, list(a.shape), "FP32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory(name, a.nbytes)
    inputs[1].set_shared_memory(name, b.nbytes, offset=a.nbytes)
    return inputs


def assert_add_sub_answers(http_address: str, model_file: Path) -> None:
    """The server at ``http_address`` answers add_sub (tritonclient, HTTP) as ONNX
    Runtime runs ``model_file``, bit for bit."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_address)
    try:
        rng = np.random.default_rng(3)
        a, b = (rng.standard_normal((2, ADD_SUB_WIDTH)).astype(np.float32) for _ in range(2))
        inputs = [httpclient.InferInput("INPUT0", [2, ADD_SUB_WIDTH], "FP32"),
                  httpclient.InferInput("INPUT1", [2, ADD_SUB_WIDTH], "FP32")]  # fmt: skip
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = client.infer("add_sub", inputs)
        expected = run_onnx(model_file, {"INPUT0": a, "INPUT1": b})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected["OUTPUT0"])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), expected["OUTPUT1"])
    finally:
        client.close()


# Triton's "repeat" example, reduced: a decoupled Python model answering N with the
# answers I = 0..N-1 from a thread, then the final flag alone; N < 0 is answered with an
# error response.
REPEAT_MODEL = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            threading.Thread(target=self._answer, args=(sender, count)).start()
        return None

    def _answer(self, sender, count):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if count < 0:
            error = pb_utils.TritonError("N must be >= 0", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), flags=final)
            return
        for index in range(count):
            out = pb_utils.Tensor("I", np.array([index], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=final)
"""
REPEAT_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def build_repeat(repo: Path, name: str = "repeat") -> Path:
    """The decoupled :data:`REPEAT_MODEL` as ``name`` in ``repo`` (serve it with
    ``--trust-pickle``); the model's directory."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(REPEAT_MODEL)
    (repo / name / "config.pbtxt").write_text(REPEAT_CONFIG)
    return repo / name
