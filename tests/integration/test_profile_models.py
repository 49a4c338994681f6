"""``slipstream profile`` loads a model as the server does: a Triton Python model's
``initialize`` runs with its completed config before the runs and ``finalize`` after
them, and a stateful model (``sequence_batching``) runs whole sequences with the
controls and state the server would give it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from slipstream.profile.cli import profile

FAST = ["--seconds", "0.1", "--warmup-runs", "1", "--no-op-profile"]

# State set in initialize (from the config) that execute needs; finalize leaves a mark.
SCALED = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.scale = float(config["parameters"]["scale"]["string_value"])
        output = pb_utils.get_output_config_by_name(config, "Y")
        self.dtype = pb_utils.triton_string_to_numpy(output["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = (x * self.scale).astype(self.dtype)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses

    def finalize(self):
        with open(%(marker)r, "w") as marker:
            marker.write("finalized")
"""

SCALED_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]
parameters { key: "scale" value: { string_value: "2.5" } }
"""


def test_a_python_model_is_initialized_and_finalized(tmp_path: Path) -> None:
    model_dir = tmp_path / "repo" / "scaled"
    (model_dir / "1").mkdir(parents=True)
    marker = tmp_path / "finalized"
    (model_dir / "1" / "model.py").write_text(SCALED % {"marker": str(marker)})
    (model_dir / "config.pbtxt").write_text(SCALED_CONFIG)
    out = tmp_path / "p.json"
    for given in (model_dir, model_dir / "1" / "model.py"):
        marker.unlink(missing_ok=True)
        args = [str(given), "--batch-sizes", "1,4", "--json", str(out), *FAST]
        result = CliRunner().invoke(profile, args)
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert [b["status"] for b in data["batches"]] == ["ok", "ok"], data["batches"]
        assert [(i["name"], i["shape"]) for i in data["inputs"]] == [("X", [-1, 3])]
        assert marker.read_text() == "finalized"


def test_a_bare_model_py_without_its_config_is_refused_naming_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(SCALED % {"marker": str(tmp_path / "m")})
    result = CliRunner().invoke(profile, [str(path), "--shape", "X:3", *FAST])
    assert result.exit_code == 1
    assert "profile the model's directory in its repository" in result.output


# A stateful Python model that checks what the server guarantees: a sequence starts with
# START and zero state, each request gets the state its predecessor left, END ends it.
STATEFUL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.steps = {}
        self.ended = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            corrid = int(get("CORRID").flat[0])
            start, end = int(get("START").flat[0]), int(get("END").flat[0])
            assert corrid == request.correlation_id(), (corrid, request.correlation_id())
            flags = request.flags()
            assert bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START) == bool(start)
            step = self.steps.get(corrid)
            if start:
                assert step is None and not get("STATE_IN").any(), (corrid, step)
                step = 0
            assert step is not None, "a request outside a running sequence"
            assert float(get("STATE_IN").flat[0]) == step, (corrid, step)
            self.steps[corrid] = step + 1
            if end:
                del self.steps[corrid]
                self.ended += 1
            state = np.full((1, 1), step + 1, np.float32)
            x = get("X")
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", x), pb_utils.Tensor("STATE_OUT", state)]))
        return responses

    def finalize(self):
        assert self.ended > 0
        with open(%(marker)r, "w") as marker:
            marker.write("%%d ended, %%d open" %% (self.ended, len(self.steps)))
"""

STATEFUL_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32
            dims: [ 1 ] } ]
}
"""


def test_a_stateful_python_model_runs_whole_sequences(tmp_path: Path) -> None:
    model_dir = tmp_path / "repo" / "counter"
    (model_dir / "1").mkdir(parents=True)
    marker = tmp_path / "finalized"
    (model_dir / "1" / "model.py").write_text(STATEFUL % {"marker": str(marker)})
    (model_dir / "config.pbtxt").write_text(STATEFUL_CONFIG)
    out = tmp_path / "p.json"
    args = [str(model_dir), "--batch-sizes", "1,3", "--sequence-length", "4", "--json", str(out)]
    result = CliRunner().invoke(profile, [*args, *FAST])
    assert result.exit_code == 0, result.output
    assert "each row of a batch is a sequence of 4 runs" in result.stdout
    data = json.loads(out.read_text())
    assert [b["status"] for b in data["batches"]] == ["ok", "ok"], data["batches"]
    assert data["sequence_length"] == 4
    assert [i["name"] for i in data["inputs"]] == ["X"]
    # Sequences cut by the time budget were ended too: none open at finalize.
    ended, still_open = marker.read_text().split(" ended, ")
    assert int(ended) >= 2 and still_open == "0 open"


def build_accumulator(model_dir: Path) -> None:
    """OUTPUT = INPUT + STATE_IN * (1 - START); STATE_OUT = OUTPUT (an ONNX stateful
    model: the file declares the controls and the state as inputs)."""
    row: list[str | int] = ["batch", 1]
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["keep"]),
            helper.make_node("Mul", ["STATE_IN", "keep"], ["kept"]),
            helper.make_node("Add", ["kept", "INPUT"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        ],
        "accumulate",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, row),
            helper.make_tensor_value_info("START", TensorProto.FLOAT, row),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, row),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, row),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, row),
        ],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (model_dir / "1").mkdir(parents=True)
    onnx.save(model, str(model_dir / "1" / "model.onnx"))
    (model_dir / "config.yaml").write_text(
        "max_batch_size: 8\n"
        "sequence_batching:\n"
        "  control_input:\n"
        "    - name: START\n"
        "      control: [{kind: CONTROL_SEQUENCE_START, fp32_false_true: [0, 1]}]\n"
        "  state:\n"
        "    - {input_name: STATE_IN, output_name: STATE_OUT, data_type: TYPE_FP32, dims: [1]}\n"
    )


def test_a_stateful_onnx_model_gets_its_controls_not_random_data(tmp_path: Path) -> None:
    model_dir = tmp_path / "repo" / "accumulate"
    build_accumulator(model_dir)
    out = tmp_path / "p.json"
    args = [str(model_dir), "--batch-sizes", "2", "--seconds", "0.1", "--json", str(out)]
    result = CliRunner().invoke(profile, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    # Only the client's input is planned; START and STATE_IN are the sequences'.
    assert [i["name"] for i in data["inputs"]] == ["INPUT"]
    assert data["batches"][0]["status"] == "ok"
    assert data["sequence_length"] == 20
    assert data["op_profile"] is not None  # fed a sequence's first run
