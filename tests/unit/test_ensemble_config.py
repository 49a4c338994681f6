"""An ensemble's config (``ensemble:``, or Triton's ``ensemble_scheduling`` in a
config.pbtxt): the graph of its steps checked before anything loads."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream.config import ConfigError, parse_model_config
from slipstream.repository.triton_config import parse_triton_config

SIGNATURE = {
    "max_batch_size": 8,
    "input": [{"name": "A", "data_type": "FP32", "dims": [4]}],
    "output": [{"name": "Z", "data_type": "FP32", "dims": [4]}],
}


CONFIDENT = {"model": "a", "confidence": {"output": "p", "threshold": 0.5}}


def _step(model: str, takes: str, makes: str) -> dict[str, Any]:
    return {"model": model, "input_map": {"INPUT0": takes}, "output_map": {"OUTPUT0": makes}}


def _ensemble(*steps: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**SIGNATURE, "ensemble": {"steps": list(steps)}, **extra}


def test_steps_in_any_order_make_a_graph() -> None:
    config = parse_model_config(_ensemble(_step("b", "mid", "Z"), _step("a", "A", "mid")), "t")
    assert config.ensemble is not None
    assert [step.model for step in config.ensemble.steps] == ["b", "a"]


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([_step("a", "nowhere", "Z")], r"steps\[0\] \(a\): takes tensor 'nowhere', which is"),
        ([_step("a", "A", "mid")], "output 'Z': no step makes it"),
        ([_step("a", "A", "Z"), _step("b", "A", "Z")], r"steps\[1\] \(b\): tensor 'Z' is made"),
        ([_step("a", "A", "A")], "tensor 'A' is made by the ensemble's inputs already"),
        (
            [_step("a", "y", "x"), _step("b", "x", "y"), _step("c", "A", "Z")],
            r"steps\[0\] \(a\), steps\[1\] \(b\) wait on each other \(a cycle\)",
        ),
    ],
)
def test_a_graph_that_cannot_run_is_refused_naming_the_step_or_tensor(
    steps: list[dict[str, Any]], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_model_config(_ensemble(*steps), "t")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"backend": "onnxruntime"}, "an ensemble has no model file of its own; remove backend"),
        ({"dynamic_batching": {"max_queue_size": 4}}, "remove dynamic_batching"),
        ({"cascade": {"stages": [CONFIDENT, {"model": "b"}]}}, "remove cascade"),
        ({"input": []}, "an ensemble lists its input and output"),
    ],
)
def test_what_an_ensemble_cannot_have_is_refused(extra: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_model_config(_ensemble(_step("a", "A", "Z"), **extra), "t")


PBTXT = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Z" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "a" model_version: -1
      input_map { key: "INPUT0" value: "A" } output_map { key: "OUTPUT0" value: "mid" } },
    { model_name: "b" model_version: 2
      input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "Z" } }
  ]
}
"""


def test_a_triton_ensemble_is_read_as_its_steps() -> None:
    config = parse_model_config(parse_triton_config(PBTXT, "e/config.pbtxt"), "e")
    assert config.ensemble is not None
    steps = [(s.model, s.version, s.input_map, s.output_map) for s in config.ensemble.steps]
    assert steps == [
        ("a", "", {"INPUT0": "A"}, {"OUTPUT0": "mid"}),
        ("b", "2", {"INPUT0": "mid"}, {"OUTPUT0": "Z"}),
    ]
    assert config.max_batch_size == 8 and not config.backend


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (('model_name: "b"', 'model_name: "b" model_namespace: "x"'), "model_namespace is not"),
        (('platform: "ensemble"', 'platform: "onnxruntime_onnx"'), 'platform is "ensemble"'),
    ],
)
def test_what_a_triton_ensemble_may_not_say_is_refused(
    change: tuple[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_triton_config(PBTXT.replace(*change), "e/config.pbtxt")
