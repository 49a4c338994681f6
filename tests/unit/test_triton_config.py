"""A Triton config.pbtxt read as Slipstream's config (repository/triton_config.py):
what Triton's examples write is served as they mean it, and what Slipstream does not do
is refused naming the field and its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.config import ConfigError
from slipstream.repository.layout import read_config, read_model_directory
from tests.models import build_add_sub, write_config

# As Triton's documentation writes them: lists in both spellings, enums, a map of
# parameters, a queue policy, a version policy and a warm-up sample.
ADD_SUB = """
name: "add_sub"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { specific: { versions: [1] } }
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    format: FORMAT_NONE
    dims: [ 16 ]
  },
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
    reshape: { shape: [ 16 ] }
  }
]
output {
  name: "OUTPUT0"
  data_type: TYPE_FP32
  dims: [ 16 ]
  label_filename: "labels.txt"
}
output {
  name: "OUTPUT1"
  data_type: TYPE_FP32
  dims: [ 16 ]
}
instance_group [ { count: 2, kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  default_queue_policy {
    timeout_action: REJECT default_timeout_microseconds: 5000 max_queue_size: 16
  }
}
parameters: { key: "intra_op_thread_count" value: { string_value: "1" } }
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } }
    inputs { key: "INPUT1" value: { data_type: TYPE_FP32 dims: [ 16 ] random_data: true } }
  }
]
response_cache { enable: true }
model_transaction_policy { decoupled: false }
"""


def _model(tmp_path: Path, pbtxt: str, name: str = "add_sub") -> Path:
    build_add_sub(tmp_path, name)
    (tmp_path / name / "config.pbtxt").write_text(pbtxt)
    return tmp_path / name


def test_a_triton_config_is_read_as_it_means(tmp_path: Path) -> None:
    config = read_config(read_model_directory(_model(tmp_path, ADD_SUB)))
    assert config.backend == "onnxruntime"
    assert config.max_batch_size == 8
    assert config.version_policy.select([1, 2, 3]) == [1]
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [
        ("INPUT0", "FP32", [16]),
        ("INPUT1", "FP32", [16]),
    ]
    assert config.input[1].reshape is None  # a reshape to the dims themselves
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert [t.label_filename for t in config.output] == ["labels.txt", ""]
    assert config.instance_count == 2
    batching = config.dynamic_batching
    assert batching.preferred_batch_size == [4, 8]
    assert batching.max_queue_delay_microseconds == 100
    assert batching.default_timeout_microseconds == 5000
    assert batching.max_queue_size == 16
    assert config.parameters == {"intra_op_thread_count": "1"}
    (sample,) = config.model_warmup
    assert (sample.name, sample.batch_size) == ("zeros", 2)
    assert sample.inputs["INPUT0"].zero_data and sample.inputs["INPUT1"].random_data
    assert config.response_cache.enable


def test_max_batch_size_0_is_kept_and_its_absence_leaves_it_to_the_model_file(
    tmp_path: Path,
) -> None:
    explicit = read_config(read_model_directory(_model(tmp_path, "max_batch_size: 0", "a")))
    assert explicit.max_batch_size == 0  # no batching, as Triton reads it
    absent = read_config(
        read_model_directory(_model(tmp_path, 'platform: "onnxruntime_onnx"', "b"))
    )
    assert absent.max_batch_size is None  # completed from the file, as a config.yaml's


def test_a_config_yaml_beside_it_wins(tmp_path: Path) -> None:
    directory = _model(tmp_path, ADD_SUB)
    write_config(tmp_path, "add_sub", {"max_batch_size": 2})
    assert read_config(read_model_directory(directory)).max_batch_size == 2


@pytest.mark.parametrize(
    ("pbtxt", "expected"),
    [
        (
            'name: "add_sub"\nsequence_batching { iterative_sequence: true }',
            r"config\.pbtxt: sequence_batching\.iterative_sequence is not supported",
        ),
        ("ensemble_scheduling { }", r"ensemble\.steps: List should have at least 1 item"),
        (
            "optimization { graph { level: 1 } }",
            r"line 1: optimization: Triton's optimization settings are not read",
        ),
        ("instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]", r"line 1: gpus: choose"),
        ('backend: "dali"', r"backend: 'dali' is not a backend Slipstream runs"),
        ('platform: "tensorrt_plan"', r"platform: 'tensorrt_plan' is not a backend"),
        (
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ]\n'
            "          reshape { shape: [ 4, 5 ] } } ]",
            r"reshape: shape \[4, 5\] holds 20 elements but dims \[16\] hold 16",
        ),
        (
            "dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
            r"timeout_action: DELAY is not supported",
        ),
        ("max_batch_size: eight", r"not a valid Triton model configuration: 1:17"),
        ("max_batch_size: -1", r"max_batch_size"),  # our validation, naming the key
        ('name: "other"', r"add_sub/config\.pbtxt: name: 'other' must match the directory"),
    ],
)
def test_what_slipstream_does_not_do_is_refused_naming_the_field(
    tmp_path: Path, pbtxt: str, expected: str
) -> None:
    directory = _model(tmp_path, pbtxt)
    with pytest.raises(ConfigError, match=expected):
        read_config(read_model_directory(directory))


def test_tune_and_export_start_from_the_config_pbtxt(tmp_path: Path) -> None:
    """`tune` (and `export`) write a config.yaml, which wins over the config.pbtxt: they
    start from its settings, translated, so the model's own config is not lost."""
    from slipstream.tune.session import raw_config

    config = raw_config(_model(tmp_path, ADD_SUB))
    assert config["max_batch_size"] == 8 and config["backend"] == "onnxruntime"
    assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]


# What Triton's own GET .../config answers for an ONNX model: every field, defaults too.
TRITON_WRITES = {
    "name": "add_sub", "platform": "onnxruntime_onnx", "backend": "onnxruntime",
    "runtime": "", "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": 8,
    "input": [{"name": n, "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [16],
               "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False,
               "is_non_linear_format_io": False} for n in ("INPUT0", "INPUT1")],
    "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [16], "label_filename": "",
                "is_shape_tensor": False, "is_non_linear_format_io": False}
               for n in ("OUTPUT0", "OUTPUT1")],
    "batch_input": [], "batch_output": [],
    "optimization": {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True},
                     "output_pinned_memory": {"enable": True},
                     "gather_kernel_buffer_threshold": 0, "eager_batching": False},
    "dynamic_batching": {"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": 100,
                         "preserve_ordering": False, "priority_levels": 0,
                         "default_priority_level": 0, "priority_queue_policy": {}},
    "instance_group": [{"name": "add_sub_0", "kind": "KIND_CPU", "count": 2, "gpus": [],
                        "secondary_devices": [], "profile": [], "passive": False,
                        "host_policy": ""}],
    "default_model_filename": "model.onnx", "cc_model_filenames": {}, "metric_tags": {},
    "parameters": {}, "model_warmup": [],
}  # fmt: skip


def test_a_config_as_triton_writes_it_is_read_as_a_load_override() -> None:
    """Model Analyzer and saved Triton configs send every field, defaults included."""
    import json

    from slipstream.config import parse_model_config
    from slipstream.repository.triton_config import parse_triton_json

    config = parse_model_config(parse_triton_json(json.dumps(TRITON_WRITES), "o"), "o")
    assert (config.max_batch_size, config.instance_count) == (8, 2)
    assert config.dynamic_batching.preferred_batch_size == [4, 8]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    unbatched = parse_triton_json(json.dumps({**TRITON_WRITES, "max_batch_size": 0}), "o")
    assert unbatched["max_batch_size"] == 0  # explicit: no batching


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"runtime": "libtorch.so"}, "runtime: not a field"),
        ({"optimization": {"cuda": {"graphs": True}}}, "optimization: Triton's optimization"),
        ({"batch_input": [{"kind": "BATCH_ELEMENT_COUNT"}]}, "batch_input: batch inputs"),
    ],
)
def test_what_a_triton_config_says_beyond_defaults_is_still_refused(
    change: dict[str, object], expected: str
) -> None:
    import json

    from slipstream.repository.triton_config import parse_triton_json

    with pytest.raises(ConfigError, match=expected):
        parse_triton_json(json.dumps({**TRITON_WRITES, **change}), "o")


def test_priority_queue_policy_is_read_and_written_back_as_triton_has_it() -> None:
    import json

    from slipstream.config import parse_model_config
    from slipstream.protocol.grpc_config import encode_model_config
    from slipstream.protocol.v2_meta import model_config_json
    from slipstream.repository.triton_config import parse_triton_config, parse_triton_json

    pbtxt = (
        "dynamic_batching { priority_levels: 2 default_priority_level: 2\n"
        "  priority_queue_policy { key: 1 value { max_queue_size: 4\n"
        "    default_timeout_microseconds: 500 allow_timeout_override: true } } }"
    )
    config = parse_model_config(parse_triton_config(pbtxt, "p"), "p")
    level = config.dynamic_batching.priority_queue_policy[1]
    assert (level.max_queue_size, level.default_timeout_microseconds) == (4, 500)
    assert level.allow_timeout_override
    written = model_config_json(config)
    assert written["dynamic_batching"]["priority_queue_policy"]["1"]["max_queue_size"] == 4
    message = encode_model_config(config).config.dynamic_batching
    assert message.priority_queue_policy[1].default_timeout_microseconds == 500
    # What the server writes reads back the same (a load override, Model Analyzer's way).
    again = parse_model_config(parse_triton_json(json.dumps(written), "o"), "o")
    assert (
        again.dynamic_batching.priority_queue_policy
        == config.dynamic_batching.priority_queue_policy
    )
    delayed = pbtxt.replace("max_queue_size: 4", "timeout_action: DELAY")
    with pytest.raises(ValueError, match=r"priority_queue_policy\[1\]\.timeout_action: DELAY"):
        parse_triton_config(delayed, "p")


@pytest.mark.parametrize("text", ["999999999999999999999999999999", "[]", '"x"', "null"])
def test_a_load_override_that_is_not_a_json_object_is_the_clients_error(text: str) -> None:
    from slipstream.repository.triton_config import parse_triton_json

    # It was a TypeError deep in the parser: a 500 on POST .../load (schemathesis).
    with pytest.raises(ConfigError, match="a model config is a JSON object"):
        parse_triton_json(text, "o")
