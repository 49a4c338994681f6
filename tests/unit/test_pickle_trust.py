"""Pickle-based model files load only when the model or the server opts in."""

from __future__ import annotations

from pathlib import Path

import joblib
import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from slipstream.config import ServerSettings
from slipstream.errors import InvalidRequest
from slipstream.runtime import get_backend
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest


def write_sklearn_model(repo: Path, name: str, config: str = "") -> None:
    features = np.arange(12, dtype=np.float32).reshape(6, 2)
    estimator = LogisticRegression().fit(features, [0, 0, 0, 1, 1, 1])
    (repo / name / "1").mkdir(parents=True)
    joblib.dump(estimator, repo / name / "1" / "model.joblib")
    if config:
        (repo / name / "config.yaml").write_text(config)


def explicit_server(repo: Path, trust_pickle: bool = False) -> ModelServer:
    settings = ServerSettings(
        model_repository=repo, model_control_mode="explicit", trust_pickle=trust_pickle
    )
    return ModelServer(settings)


async def test_a_pickle_is_refused_unless_its_config_opts_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_sklearn_model(tmp_path, "untrusted")
    write_sklearn_model(tmp_path, "trusted", "trust_pickle: true\n")
    server = explicit_server(tmp_path)
    await server.start()
    try:
        with pytest.raises(InvalidRequest) as error:
            await server.load_model("untrusted")
        message = error.value.message
        assert "model.joblib is a pickle (sklearn backend)" in message
        assert "`trust_pickle: true` to untrusted/config.yaml" in message
        assert "--trust-pickle" in message and "skl2onnx" in message
        assert not await server.model_ready("untrusted")
        assert "loading the pickle" not in caplog.text

        await server.load_model("trusted")
        features = np.array([[0.0, 1.0], [10.0, 11.0]], np.float32)
        response = await server.infer(InferRequest("trusted", "", {"input": features}))
        np.testing.assert_array_equal(response.outputs["predict"], [0, 1])
        assert "model trusted: loading the pickle" in caplog.text
    finally:
        await server.stop()


async def test_the_server_flag_trusts_every_model(tmp_path: Path) -> None:
    write_sklearn_model(tmp_path, "untrusted")
    server = explicit_server(tmp_path, trust_pickle=True)
    await server.start()
    try:
        await server.load_model("untrusted")
        assert await server.model_ready("untrusted")
    finally:
        await server.stop()
    # The flag is the server's setting: a server started without it refuses again.
    server = explicit_server(tmp_path)
    await server.start()
    try:
        with pytest.raises(InvalidRequest, match="is a pickle"):
            await server.load_model("untrusted")
    finally:
        await server.stop()


def test_which_files_are_pickles() -> None:
    sklearn, torch_backend, onnx = (get_backend(n) for n in ("sklearn", "torch", "onnxruntime"))
    assert sklearn.loads_pickle(Path("model.joblib")) and sklearn.loads_pickle(Path("m.bin"))
    assert torch_backend.loads_pickle(Path("model.pt2"))
    assert not torch_backend.loads_pickle(Path("model.pt"))  # TorchScript: restricted reader
    assert not onnx.loads_pickle(Path("model.onnx"))


async def test_an_exported_torch_program_needs_the_opt_in_too(tmp_path: Path) -> None:
    program = torch.export.export(torch.nn.Linear(2, 1), (torch.zeros(1, 2),))
    (tmp_path / "linear" / "1").mkdir(parents=True)
    torch.export.save(program, str(tmp_path / "linear" / "1" / "model.pt2"))
    server = explicit_server(tmp_path)
    await server.start()
    try:
        with pytest.raises(InvalidRequest, match=r"model.pt2 is a pickle \(torch backend\)"):
            await server.load_model("linear")
    finally:
        await server.stop()
