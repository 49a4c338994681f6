"""Config validation, auto-complete from the model file, version policy, model manager."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from slipstream.config import ConfigError, ServerSettings, VersionPolicy, parse_model_config
from slipstream.errors import InvalidRequest, ModelNotFound, Unavailable
from slipstream.repository.autocomplete import DEFAULT_MAX_BATCH_SIZE, complete_config
from slipstream.runtime.base import ModelSignature, TensorSpec
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest, RequestedOutput


def write_scale_model(path: Path, batch: str | int = "batch", factor: float = 2.0) -> None:
    """y = x * factor, x: FP32 [batch, 3]."""
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])
    k = oh.make_tensor("k", TensorProto.FLOAT, [], [factor])
    graph = oh.make_graph([oh.make_node("Mul", ["x", "k"], ["y"])], "scale", [x], [y], [k])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


# -- config validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"max_batch_size": -3}, "max_batch_size"),
        ({"dynamic_batching": {"max_queue_size": 0}}, "dynamic_batching.max_queue_size"),
        ({"dynamic_batching": {"max_queue_delay_us": 5}}, "dynamic_batching.max_queue_delay_us"),
        ({"input": [{"name": "x", "data_type": "TYPE_FLOAT", "dims": [3]}]}, "input.0.data_type"),
        ({"input": [{"name": "x", "data_type": "FP32", "dims": [0]}]}, "input.0.dims"),
        ({"instance_group": {"count": 0}}, "instance_group.0.count"),
        ({"version_policy": {"latest": {"num_versions": 1}, "all": {}}}, "version_policy"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_bad_config_names_the_key(data: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_model_config(data, "m/config.yaml")
    assert f"m/config.yaml: {names}" in str(error.value)


def test_triton_spellings_are_accepted() -> None:
    config = parse_model_config(
        {
            "instance_group": {"count": 2},
            "input": [{"name": "t", "data_type": "TYPE_STRING", "dims": [-1]}],
            "parameters": {"intra_op_thread_count": {"string_value": "1"}},
            "dynamic_batching": {"priority_levels": 3},
        },
        "m",
    )
    assert config.input[0].data_type == "BYTES"
    assert config.instance_count == 2
    assert config.parameters == {"intra_op_thread_count": "1"}
    assert config.dynamic_batching.default_priority_level == 2


def test_version_policies_select_versions() -> None:
    assert VersionPolicy().select([3, 1, 2]) == [3]
    assert VersionPolicy(latest={"num_versions": 2}).select([3, 1, 2]) == [2, 3]
    assert VersionPolicy(all={}).select([3, 1, 2]) == [1, 2, 3]
    assert VersionPolicy(specific={"versions": [1, 5]}).select([3, 1, 2]) == [1]


# -- auto-complete ---------------------------------------------------------------------

SIGNATURE = ModelSignature(
    inputs=(TensorSpec("x", "FP32", (-1, 3)),), outputs=(TensorSpec("y", "FP32", (-1, 3)),)
)


def test_config_is_completed_from_the_file() -> None:
    config = complete_config(parse_model_config({}, "m"), SIGNATURE, "onnxruntime")
    assert config.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [("x", "FP32", [3])]
    assert config.platform == "onnxruntime_onnx"


def test_fixed_first_dim_means_no_batching() -> None:
    fixed = ModelSignature(
        inputs=(TensorSpec("x", "FP32", (2, 3)),), outputs=(TensorSpec("y", "FP32", (2, 3)),)
    )
    config = complete_config(parse_model_config({}, "m"), fixed, "onnxruntime")
    assert config.max_batch_size == 0
    assert config.input[0].dims == [2, 3]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"input": [{"name": "z", "data_type": "FP32", "dims": [3]}]}, "input 'z': not in"),
        ({"input": [{"name": "x", "data_type": "INT64", "dims": [3]}]}, "data_type INT64"),
        ({"input": [{"name": "x", "data_type": "FP32", "dims": [3, 1]}]}, "dims [3, 1]"),
        ({"input": [{"name": "x", "data_type": "FP32", "dims": [4]}]}, "dims [4]"),
    ],
)
def test_config_that_contradicts_the_file_fails(given: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        complete_config(parse_model_config(given, "m"), SIGNATURE, "onnxruntime")


@pytest.mark.parametrize(
    ("given", "signature", "message"),
    [
        (
            {"max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": [4, 16]}},
            SIGNATURE,
            "dynamic_batching.preferred_batch_size: 16 is above max_batch_size 8",
        ),
        (
            {"max_batch_size": 8, "input": [{"name": "x", "data_type": "FP32", "dims": [3]}]},
            ModelSignature(
                inputs=(TensorSpec("x", "FP32", (1, 3)),),
                outputs=(TensorSpec("y", "FP32", (1, 3)),),
            ),
            "input 'x': max_batch_size > 0 needs a variable first dim (the batch), the model "
            "file declares shape [1, 3]",
        ),
    ],
)
def test_what_triton_refuses_at_load_is_refused_at_load(
    given: dict[str, object], signature: ModelSignature, message: str
) -> None:
    """Not at a request's run: a batch of 16 or 2 rows would only fail there."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        complete_config(parse_model_config(given, "m"), signature, "onnxruntime")


def test_version_directories_are_read_as_triton_reads_them(tmp_path: Path) -> None:
    from slipstream.repository.layout import read_model_directory

    for name in ("1", "3", "007", "0", "v2", "²", "12"):
        (tmp_path / "m" / name).mkdir(parents=True)
    (tmp_path / "m" / "5").write_text("a file, not a version")
    assert read_model_directory(tmp_path / "m").versions == (1, 3, 12)


def test_signatureless_backend_needs_tensors_in_config() -> None:
    with pytest.raises(ConfigError, match="list input and output"):
        complete_config(parse_model_config({}, "m"), ModelSignature((), ()), "torch")


# -- the serving core over a real repository -------------------------------------------


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    write_scale_model(tmp_path / "scale" / "1" / "model.onnx", factor=2.0)
    write_scale_model(tmp_path / "scale" / "2" / "model.onnx", factor=3.0)
    write_scale_model(tmp_path / "broken" / "1" / "model.onnx")
    (tmp_path / "broken" / "config.yaml").write_text("max_batch_size: -3\n")
    (tmp_path / "empty").mkdir()
    return tmp_path


def request(model: str, x: np.ndarray, version: str = "") -> InferRequest:
    return InferRequest(model_name=model, model_version=version, inputs={"x": x})


async def test_bad_models_fail_alone(repository: Path) -> None:
    server = ModelServer(ServerSettings(model_repository=repository))
    await server.start()
    try:
        x = np.ones((2, 3), dtype=np.float32)
        out = await server.infer(request("scale", x))
        np.testing.assert_allclose(out.outputs["y"], x * 3)  # latest version only
        assert out.model_version == "2"
        with pytest.raises(ModelNotFound, match="no version 1 loaded"):
            await server.infer(request("scale", x, "1"))
        with pytest.raises(Unavailable, match="max_batch_size"):
            await server.infer(request("broken", x))
        index = {(e.name, e.state): e.reason for e in await server.repository_index()}
        assert "max_batch_size" in index[("broken", "UNAVAILABLE")]
        assert "version directory" in index[("empty", "UNAVAILABLE")]
        assert server.is_live() and not await server.is_ready()  # strict readiness, as Triton
    finally:
        await server.stop()


async def test_requests_are_checked_against_the_config(repository: Path) -> None:
    server = ModelServer(ServerSettings(model_repository=repository))
    await server.start()
    cases = [
        (request("scale", np.ones((1, 4), np.float32)), "input 'x': shape [1, 4]"),
        (request("scale", np.ones((1, 3), np.int64)), "datatype INT64 but the model expects FP32"),
        (request("scale", np.ones((65, 3), np.float32)), "batch size 65 outside 1..64"),
        (
            InferRequest("scale", "", {"x": np.ones((1, 3), np.float32), "w": np.ones(1)}),
            "input 'w': model 'scale' has no such input",
        ),
        (InferRequest("scale", "", {}), "input 'x': missing"),
        (
            InferRequest(
                "scale", "", {"x": np.ones((1, 3), np.float32)}, outputs=[RequestedOutput("q")]
            ),
            "output 'q'",
        ),
    ]
    try:
        for bad, message in cases:
            with pytest.raises(InvalidRequest) as error:
                await server.infer(bad)
            assert message in error.value.message
        with pytest.raises(ModelNotFound):
            await server.infer(request("nope", np.ones((1, 3), np.float32)))
    finally:
        await server.stop()


async def test_every_shape_is_accepted_exactly_when_the_config_allows_it(
    repository: Path,
) -> None:
    # scale: x FP32 [-1, 3], max_batch_size 64. Every shape of rank 0 to 3 over dims
    # around the limits, against the rule stated independently of the server's checks.
    server = ModelServer(ServerSettings(model_repository=repository))
    await server.start()
    dims = (0, 1, 2, 3, 4, 63, 64, 65)
    shapes = [()] + [tuple(s) for rank in (1, 2, 3) for s in itertools.product(dims, repeat=rank)]
    try:
        for shape in shapes:
            allowed = len(shape) == 2 and shape[1] == 3 and 1 <= shape[0] <= 64
            try:
                await server.infer(request("scale", np.ones(shape, np.float32)))
            except InvalidRequest:
                assert not allowed, shape
            else:
                assert allowed, shape
    finally:
        await server.stop()


async def test_explicit_mode_loads_and_unloads_on_request(repository: Path) -> None:
    settings = ServerSettings(model_repository=repository, model_control_mode="explicit")
    server = ModelServer(settings)
    await server.start()
    try:
        assert not await server.model_ready("scale")
        await server.load_model("scale")
        assert await server.model_ready("scale") and await server.model_ready("scale", "2")
        await server.unload_model("scale")
        assert not await server.model_ready("scale")
        with pytest.raises(InvalidRequest, match="max_batch_size"):
            await server.load_model("broken")
        with pytest.raises(ModelNotFound):
            await server.load_model("missing")
    finally:
        await server.stop()


async def test_load_is_refused_outside_explicit_mode(repository: Path) -> None:
    server = ModelServer(ServerSettings(model_repository=repository))
    await server.start()
    try:
        with pytest.raises(InvalidRequest, match="--model-control-mode explicit"):
            await server.load_model("scale")
    finally:
        await server.stop()


async def test_poll_picks_up_new_and_removed_models(repository: Path) -> None:
    settings = ServerSettings(model_repository=repository, model_control_mode="poll")
    server = ModelServer(settings)
    await server.start()
    try:
        write_scale_model(repository / "fresh" / "1" / "model.onnx", factor=5.0)
        # The first poll sees new files, the second sees them unchanged and loads them.
        await server.models.poll_once()
        assert not await server.model_ready("fresh")
        await server.models.poll_once()
        out = await server.infer(request("fresh", np.ones((1, 3), np.float32)))
        np.testing.assert_allclose(out.outputs["y"], 5.0)
        write_scale_model(repository / "fresh" / "2" / "model.onnx", factor=7.0)
        await server.models.poll_once()
        await server.models.poll_once()
        out = await server.infer(request("fresh", np.ones((1, 3), np.float32)))
        np.testing.assert_allclose(out.outputs["y"], 7.0)
        for path in sorted((repository / "fresh").rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (repository / "fresh").rmdir()
        await server.models.poll_once()
        assert not await server.model_ready("fresh")
    finally:
        await server.stop()


def test_a_models_kind_follows_its_config_file(tmp_path: Path) -> None:
    """What listing the repository asks of each config (generative? a cascade?) is parsed
    again once the file changes, however fast it is rewritten."""
    from slipstream.repository.layout import is_cascade, is_generative, read_model_directory

    directory = tmp_path / "m"
    directory.mkdir()
    config = directory / "config.yaml"
    model = read_model_directory(directory)
    assert not is_generative(model) and not is_cascade(model)  # no config at all
    config.write_text("backend: llama_cpp\nmax_batch_size: -1\n")
    assert not is_generative(model)  # a config error: the V2 manager reports it
    config.write_text("backend: llama_cpp\n")
    assert is_generative(model)
    for backend, generative in (("transformers", True), ("onnxruntime", False)):
        config.write_text(f"backend: {backend}\n")  # rewritten at once
        assert is_generative(model) is generative
    config.write_text("cascade: {stages: [{model: a}]}\n")
    assert is_cascade(model) and not is_generative(model)
    config.unlink()
    assert not is_cascade(model)
