"""Cascades' parts without a server: the config's checks, the confidence rules, the V2
client codec a remote stage speaks, the threshold search (and the modules' examples)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from slipstream import calibrate
from slipstream.calibrate import CalibrationError, pick_threshold
from slipstream.config import ConfidenceRule, ConfigError, parse_model_config
from slipstream.protocol import v2, v2_client
from slipstream.serving import cascade
from slipstream.serving.cascade import confidence
from slipstream.types import InferRequest, InferResponse

FIRST = {"model": "small", "confidence": {"output": "p", "threshold": 0.9}}


def config(**cascade_section: object) -> dict[str, object]:
    return {"cascade": {"stages": [FIRST, {"model": "large"}], **cascade_section}}


def test_the_modules_examples_hold() -> None:
    for module in (cascade, calibrate, v2_client):
        assert doctest.testmod(module).failed == 0


def test_a_cascade_config_reads_well_and_names_remote_stages() -> None:
    remote = {"model": "large", "url": "https://big.example.com:8443/", "api_key_env": "K"}
    parsed = parse_model_config({"cascade": {"stages": [FIRST, remote]}}, "c")
    assert parsed.cascade is not None
    first, second = parsed.cascade.stages
    assert (first.name, first.remote) == ("small", False)
    assert (second.name, second.url) == (
        "large@big.example.com:8443",
        "https://big.example.com:8443",
    )
    assert parsed.cascade.on_stage_failure == "answer"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stages": [FIRST]}, "stages: List should have at least 2 items"),
        ({"stages": [{"model": "small"}, {"model": "large"}]}, "(small): needs confidence"),
        ({"stages": [FIRST, FIRST]}, "the last stage answers every row"),
        ({"stages": [FIRST, {"model": "small"}]}, "stage names must differ"),
        ({"stages": [FIRST, {"model": "large", "url": "ftp://x"}]}, "expected http[s]://host"),
        ({"stages": [FIRST, {"model": "large", "api_key_env": "K"}]}, "remote stage (with url)"),
        ({"stages": [FIRST, {"model": "../x"}]}, "model: '../x'"),
        ({"stages": [FIRST, {"model": "large"}], "on_stage_failure": "x"}, "'answer' or 'fail'"),
    ],
)  # fmt: skip
def test_a_bad_cascade_config_names_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_model_config({"cascade": section}, "c/config.yaml")
    assert message in str(caught.value) and "c/config.yaml: cascade" in str(caught.value)


def test_a_cascade_has_no_model_file_keys() -> None:
    with pytest.raises(ConfigError, match="remove input, max_batch_size"):
        parse_model_config({**config(), "max_batch_size": 8, "input": []}, "c")


def test_confidence_rules_read_each_row() -> None:
    scores = np.array([[0.6, 0.3, 0.1], [0.4, 0.4, 0.2]], np.float32)
    rule = ConfidenceRule(output="p", threshold=0.5)
    np.testing.assert_allclose(confidence(rule, scores), [0.6, 0.4])
    margin = rule.model_copy(update={"rule": "margin"})
    np.testing.assert_allclose(confidence(margin, scores), [0.3, 0.0], atol=1e-7)
    logits = ConfidenceRule(output="p", threshold=0.5, softmax=True)
    np.testing.assert_allclose(confidence(logits, np.log(scores)), [0.6, 0.4], rtol=1e-6)
    value = ConfidenceRule(output="p", rule="value", threshold=0.5)
    np.testing.assert_allclose(confidence(value, np.array([[0.2], [0.9]])), [0.2, 0.9])
    with pytest.raises(Exception, match="one number per row"):
        confidence(value, scores)


def test_the_client_codec_round_trips_through_the_server_codec() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    names = np.array([b"a", b"bc"], dtype=object)
    body, json_length = v2_client.encode_request({"x": x, "names": names}, ["y"])
    request = v2.decode_infer_request(body, json_length, "m", "")
    np.testing.assert_array_equal(request.inputs["x"], x)
    assert request.inputs["names"].tolist() == [b"a", b"bc"]
    assert request.outputs is not None and request.outputs[0].binary_data is True
    response = InferResponse("m", "1", {"y": x * 2, "z": np.array([1, 2], np.int64)})
    payload, length = v2.encode_infer_response(
        response, InferRequest("m", "", {}, binary_data_output=True)
    )
    outputs = v2_client.decode_response(payload, length)
    np.testing.assert_array_equal(outputs["y"], x * 2)
    assert outputs["z"].tolist() == [1, 2]
    with pytest.raises(Exception, match="outputs: required field is missing"):
        v2_client.decode_response(b'{"model_name": "m"}', None)


def test_the_threshold_is_the_lowest_that_reaches_the_target() -> None:
    scores = np.array([0.99, 0.95, 0.95, 0.7, 0.6])
    first = np.array([1, 1, 0, 1, 0])
    rest = np.array([1, 1, 1, 1, 1])
    # Ties move together: 0.95 answers both of its rows or neither.
    found = pick_threshold(scores, first, rest, target=1.0)
    assert (float(found.threshold), found.first_stage_share) == (0.99, 0.2)
    found = pick_threshold(scores, first, rest, target=0.8)
    assert (float(found.threshold), found.first_stage_share, found.accuracy) == (0.7, 0.8, 0.8)
    everything_escalated = pick_threshold(scores, np.zeros(5), rest, target=1.0)
    assert everything_escalated.first_stage_share == 0.0
    assert everything_escalated.threshold > 0.99
    with pytest.raises(CalibrationError, match=r"the rest of the cascade alone reaches 0\.0000"):
        pick_threshold(scores, first, np.zeros(5), target=0.9)
