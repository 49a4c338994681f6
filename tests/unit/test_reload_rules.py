"""Reloads that never take down what serves: change detection, swap rules, bad new files.

The fingerprint and settling rules are plain functions; the reload rules run on an
in-process ModelServer over a real repository, calling ``poll_once`` by hand so that
"one poll later" is a step of the test, not a wait.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from slipstream.config import ServerSettings, parse_model_config
from slipstream.errors import InvalidRequest
from slipstream.repository.changes import (
    ModelFingerprint,
    changed_versions,
    fingerprint,
    settled_changes,
)
from slipstream.serving.core import ModelServer
from slipstream.serving.manager import signature_change
from slipstream.types import InferRequest
from tests.unit.test_repository import write_scale_model

X = np.ones((1, 3), np.float32)


def fp(*versions: int, config: int = 0) -> ModelFingerprint:
    """A fingerprint whose version v has one file of size v (config: size ``config``)."""
    return ModelFingerprint(
        config=((("config.yaml", config, 1, 1),) if config else ()),
        versions=tuple((v, ((f"{v}/model.onnx", v, 1, 1),)) for v in versions),
    )


# -- fingerprints --------------------------------------------------------------------


def test_fingerprint_changes_with_any_file_size_or_mtime(tmp_path: Path) -> None:
    model = tmp_path / "m"
    write_scale_model(model / "1" / "model.onnx")
    (model / "notes").mkdir()  # not a version directory: not part of the model
    first = fingerprint(model)
    assert [n for n, _ in first.versions] == [1]
    assert fingerprint(model) == first
    (model / "notes" / "x.txt").write_text("ignored")
    assert fingerprint(model) == first

    path = model / "1" / "model.onnx"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    touched = fingerprint(model)
    assert touched != first and changed_versions(first, touched) == ["1"]

    (model / "config.yaml").write_text("max_batch_size: 4\n")
    configured = fingerprint(model)
    assert changed_versions(touched, configured) == ["config"]

    (model / "1" / "extra.bin").write_bytes(b"x")  # a second file, e.g. external weights
    assert changed_versions(configured, fingerprint(model)) == ["1"]
    assert changed_versions(None, configured) == ["new model"]


def test_fingerprint_stamps_an_unreadable_file_instead_of_failing(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.onnx").symlink_to(tmp_path / "nowhere.onnx")
    stamps = fingerprint(model).version(1)
    assert stamps is not None
    assert ("1/model.onnx", -1, -1, -1) in stamps
    assert fingerprint(model).version(2) is None


# -- settling ------------------------------------------------------------------------


def test_a_new_model_loads_on_the_second_poll_that_sees_it_unchanged() -> None:
    first = settled_changes({}, {"m": fp(1)}, {})
    assert (first.load, first.noticed) == ([], ["m"])
    second = settled_changes({"m": fp(1)}, {"m": fp(1)}, {})
    assert (second.load, second.noticed) == (["m"], [])


def test_files_still_growing_wait_and_are_noticed_once() -> None:
    loaded = {"m": fp(1)}
    copying = [fp(1, 2), fp(1, 3), fp(1, 4)]  # version 2's file growing
    previous = loaded
    noticed = []
    for seen in copying:
        decision = settled_changes(previous, {"m": seen}, loaded)
        assert decision.load == []
        noticed += decision.noticed
        previous = {"m": seen}
    assert noticed == ["m"]
    assert settled_changes(previous, previous, loaded).load == ["m"]


def test_attempted_files_are_not_tried_again_until_they_change() -> None:
    failed = {"m": fp(1, 2)}  # the last attempt saw these files, whatever its outcome
    for _ in range(3):
        decision = settled_changes(failed, failed, failed)
        assert (decision.load, decision.noticed) == ([], [])
    fixed = {"m": fp(1, 2, config=5)}
    assert settled_changes(failed, fixed, failed).noticed == ["m"]
    assert settled_changes(fixed, fixed, failed).load == ["m"]


def test_a_change_first_seen_right_after_start_up_is_noticed() -> None:
    decision = settled_changes({}, {"m": fp(1, 2)}, {"m": fp(1)})
    assert (decision.load, decision.noticed) == ([], ["m"])


# -- signatures ----------------------------------------------------------------------


def test_signature_change_names_each_incompatible_tensor() -> None:
    serving = parse_model_config(
        {
            "input": [{"name": "x", "data_type": "FP32", "dims": [3]}],
            "output": [{"name": "y", "data_type": "FP32", "dims": [3]}],
        },
        "m",
    )
    same_but_wider = parse_model_config(
        {
            "input": [{"name": "x", "data_type": "FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "FP32", "dims": [-1]}],
        },
        "m",
    )
    assert signature_change(serving, same_but_wider) == ""
    changed = parse_model_config(
        {
            "input": [{"name": "x", "data_type": "INT64", "dims": [3]}],
            "output": [{"name": "z", "data_type": "FP32", "dims": [3]}],
        },
        "m",
    )
    assert signature_change(serving, changed) == (
        "input 'x' is INT64, was FP32, output 'y' is gone, output 'z' is new"
    )


# -- reloads on a real repository ------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_scale_model(tmp_path / "scale" / "1" / "model.onnx", factor=2.0)
    return tmp_path


@pytest.fixture
async def explicit(repo: Path) -> AsyncIterator[ModelServer]:
    server = ModelServer(ServerSettings(model_repository=repo, model_control_mode="explicit"))
    await server.start()
    await server.load_model("scale")
    yield server
    await server.stop()


@pytest.fixture
async def polled(repo: Path) -> AsyncIterator[ModelServer]:
    # An hour between the server's own polls: within the test, only its poll_once calls run.
    settings = ServerSettings(
        model_repository=repo, model_control_mode="poll", repository_poll_secs=3600
    )
    server = ModelServer(settings)
    await server.start()
    yield server
    await server.stop()


async def served(server: ModelServer) -> tuple[str, float]:
    """(version that answered, the factor it multiplies by)."""
    out = await server.infer(InferRequest(model_name="scale", model_version="", inputs={"x": X}))
    return out.model_version, float(out.outputs["y"][0, 0])


def index(server: ModelServer) -> dict[tuple[str, str], str]:
    return {(e.version, e.state): e.reason for e in server.index_now() if e.name == "scale"}


def failed_loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]


@pytest.mark.parametrize(
    ("what", "break_it", "reason"),
    [
        ("model file", lambda repo: _write(repo / "scale/2/model.onnx", b"not onnx"), "2"),
        ("no model file", lambda repo: _write(repo / "scale/2/README", b"soon"), "expected one"),
        (
            "unreadable file",
            lambda repo: _link(repo / "scale/2/model.onnx", repo / "missing.onnx"),
            "scale/2/model.onnx",
        ),
        ("bad config", lambda repo: _write(repo / "scale/config.yaml", b"max_batch: 2\n"), "max_"),
        ("bad yaml", lambda repo: _write(repo / "scale/config.yaml", b"a: [\n"), "YAML"),
    ],
)
async def test_a_failed_reload_keeps_the_serving_version(
    explicit: ModelServer, repo: Path, what: str, break_it: object, reason: str
) -> None:
    assert await served(explicit) == ("1", 2.0)
    assert callable(break_it)
    break_it(repo)
    with pytest.raises(InvalidRequest) as error:
        await explicit.load_model("scale")
    assert reason in error.value.message and "keep serving" in error.value.message, what
    assert await served(explicit) == ("1", 2.0)
    entries = index(explicit)
    assert entries[("1", "READY")] == ""
    (failed,) = [(key, why) for key, why in entries.items() if key[1] == "UNAVAILABLE"]
    assert reason in failed[1]
    # The model is as ready as before: strict readiness does not take the server out.
    assert await explicit.model_ready("scale") and await explicit.is_ready()


async def test_a_signature_change_is_refused_until_the_model_is_unloaded(
    explicit: ModelServer, repo: Path
) -> None:
    import onnx.helper as oh
    from onnx import TensorProto

    x = oh.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 3])
    y = oh.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 3])
    graph = oh.make_graph([oh.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "scale" / "2").mkdir()
    (repo / "scale" / "2" / "model.onnx").write_bytes(model.SerializeToString())

    with pytest.raises(InvalidRequest, match=r"input 'x' is FP64, was FP32.*unload the model"):
        await explicit.load_model("scale")
    assert await served(explicit) == ("1", 2.0)
    assert "signature" in index(explicit)[("2", "UNAVAILABLE")]

    await explicit.unload_model("scale")
    assert index(explicit) == {("1", "UNAVAILABLE"): "unloaded"}  # as Triton lists it
    await explicit.load_model("scale")
    assert index(explicit) == {("2", "READY"): "", ("1", "UNAVAILABLE"): "unloaded"}


async def test_a_good_reload_swaps_and_keeps_unchanged_versions(
    explicit: ModelServer, repo: Path
) -> None:
    (repo / "scale" / "config.yaml").write_text("version_policy: {all: {}}\n")
    await explicit.load_model("scale")  # the config changed: version 1 reloads
    first = explicit.models.resolve("scale", "1")
    write_scale_model(repo / "scale" / "2" / "model.onnx", factor=3.0)
    await explicit.load_model("scale")
    assert await served(explicit) == ("2", 3.0)
    # Version 1's files and the config did not change: the same loaded version serves.
    assert explicit.models.resolve("scale", "1") is first
    # A load of unchanged files is a no-op (Triton: "unmodified").
    await explicit.load_model("scale")
    assert explicit.models.resolve("scale", "1") is first

    write_scale_model(repo / "scale" / "1" / "model.onnx", factor=5.0)
    await explicit.load_model("scale")
    assert explicit.models.resolve("scale", "1") is not first
    out = await explicit.infer(InferRequest("scale", "1", {"x": X}))
    assert float(out.outputs["y"][0, 0]) == 5.0


async def test_concurrent_loads_of_one_model_load_it_once(
    explicit: ModelServer, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_scale_model(repo / "scale" / "2" / "model.onnx", factor=3.0)
    with caplog.at_level(logging.INFO, logger="slipstream.serving.manager"):
        await asyncio.gather(*(explicit.load_model("scale") for _ in range(3)))
    ready = [r for r in caplog.records if r.getMessage() == "model scale version 2 is READY"]
    assert len(ready) == 1
    assert await served(explicit) == ("2", 3.0)


async def test_load_and_unload_in_flight_together_end_as_the_last_call_says(
    explicit: ModelServer, repo: Path
) -> None:
    write_scale_model(repo / "scale" / "2" / "model.onnx", factor=3.0)
    await asyncio.gather(explicit.load_model("scale"), explicit.unload_model("scale"))
    assert not await explicit.model_ready("scale")
    # In the repository, its versions unloaded (each served, if only for a moment).
    assert index(explicit) == {("1", "UNAVAILABLE"): "unloaded", ("2", "UNAVAILABLE"): "unloaded"}
    await asyncio.gather(explicit.unload_model("scale"), explicit.load_model("scale"))
    assert await served(explicit) == ("2", 3.0)


async def test_poll_never_loads_a_half_written_file(
    polled: ModelServer, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = repo / "scale" / "2" / "model.onnx"
    write_scale_model(target, factor=3.0)  # no poll runs until the test calls one
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    await polled.models.poll_once()  # sees the half
    with target.open("ab") as file:
        file.write(data[len(data) // 2 :])
    await polled.models.poll_once()  # sees it grow: still waiting
    assert await served(polled) == ("1", 2.0)
    await polled.models.poll_once()  # unchanged for a poll: loads it
    assert await served(polled) == ("2", 3.0)
    assert failed_loads(caplog) == []


async def test_poll_tries_a_broken_version_once_per_change(
    polled: ModelServer, repo: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(repo / "scale" / "2" / "model.onnx", b"not onnx")
    for _ in range(5):
        await polled.models.poll_once()
        assert await served(polled) == ("1", 2.0)
    assert len(failed_loads(caplog)) == 1
    assert ("2", "UNAVAILABLE") in index(polled)

    write_scale_model(repo / "scale" / "2" / "model.onnx", factor=3.0)
    for _ in range(2):
        await polled.models.poll_once()
    assert await served(polled) == ("2", 3.0)
    assert index(polled) == {("2", "READY"): "", ("1", "UNAVAILABLE"): "unloaded"}
    assert len(failed_loads(caplog)) == 1


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
