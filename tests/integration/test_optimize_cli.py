"""``slipstream optimize`` from the command line: it writes version 2 beside version 1,
``slipstream serve`` serves it, and a model that fails the gate is refused loudly."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits

from slipstream.cli import main
from tests.utils import RemoteServer


def build_digits_linear(repo: Path) -> tuple[np.ndarray, np.ndarray]:
    """``REPO/digits/1/model.onnx``: a least-squares linear classifier on digits,
    ``pixels`` FP32 [batch, 64] -> MatMul -> Add -> ``logits`` FP32 [batch, 10].

    Returns held-out (pixels, labels)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    design = np.hstack([x[:1200], np.ones((1200, 1), np.float32)])
    solution = np.linalg.lstsq(design, np.eye(10)[y[:1200]], rcond=None)[0].astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["pixels", "W"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["logits"]),
        ],
        "digits",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(solution[:64], "W"), numpy_helper.from_array(solution[64], "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "digits" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "digits" / "1" / "model.onnx"))
    return x[1200:], y[1200:]


@pytest.fixture
def repo_and_data(tmp_path: Path) -> tuple[Path, Path, np.ndarray]:
    repo = tmp_path / "models"
    x, y = build_digits_linear(repo)
    np.savez(tmp_path / "val.npz", pixels=x, labels=y)
    return repo, tmp_path / "val.npz", x


def test_optimize_writes_version_2_and_serve_loads_it(
    repo_and_data: tuple[Path, Path, np.ndarray], tmp_path: Path
) -> None:
    repo, validation, x = repo_and_data
    args = [
        "optimize", "--model", str(repo / "digits"), "--repository", str(repo),
        "--name", "digits", "--passes", "int8-dynamic,graph", "--validation", str(validation),
        "--batch-size", "1,4", "--profile-seconds", "0.05",
    ]  # fmt: skip
    outcome = CliRunner().invoke(main, args)

    assert outcome.exit_code == 0, outcome.output
    assert "accuracy gate (top1) passed" in outcome.output
    assert "wrote" in outcome.output and "version 2" in outcome.output
    record = json.loads((repo / "digits" / "2" / "optimization.json").read_text())
    assert [p["name"] for p in record["passes"]] == ["graph", "int8-dynamic"]
    assert (repo / "digits" / "config.yaml").is_file()

    body = {"inputs": [{"name": "pixels", "shape": [2, 64], "datatype": "FP32",
                        "data": x[:2].ravel().tolist()}]}  # fmt: skip
    with RemoteServer(repo, log_dir=tmp_path) as server:
        answer = httpx.post(server.url("/v2/models/digits/versions/2/infer"), json=body)
        assert answer.status_code == 200, answer.text
        logits = np.array(answer.json()["outputs"][0]["data"]).reshape(2, 10)
        assert answer.json()["model_version"] == "2"
    assert logits.shape == (2, 10)


def test_a_model_that_fails_the_gate_exits_non_zero_and_writes_nothing(
    repo_and_data: tuple[Path, Path, np.ndarray],
) -> None:
    repo, validation, _ = repo_and_data
    args = [
        "optimize", "--model", str(repo / "digits" / "1" / "model.onnx"),
        "--repository", str(repo), "--name", "digits", "--passes", "fp16",
        "--validation", str(validation), "--metric", "maxae", "--max-drop", "0",
    ]  # fmt: skip
    outcome = CliRunner().invoke(main, args)

    assert outcome.exit_code == 1
    assert "FAILED, missed by" in outcome.output and "nothing written" in outcome.output
    assert sorted(p.name for p in (repo / "digits").iterdir()) == ["1"]


def test_prune_of_an_onnx_model_is_refused_with_a_clear_message(
    repo_and_data: tuple[Path, Path, np.ndarray],
) -> None:
    repo, validation, _ = repo_and_data
    args = [
        "optimize", "--model", str(repo / "digits"), "--repository", str(repo),
        "--name", "digits", "--passes", "prune", "--validation", str(validation),
    ]  # fmt: skip
    outcome = CliRunner().invoke(main, args)

    assert outcome.exit_code == 2
    assert "prune needs a PyTorch model" in outcome.output


def test_distill_from_the_command_line_writes_version_2(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)
    np.savez(tmp_path / "train.npz", pixels=x[:1200], labels=y[:1200])
    np.savez(tmp_path / "val.npz", pixels=x[1200:], labels=y[1200:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/unit/test_optimize_torch.py::one_torch_thread
    try:
        torch.manual_seed(0)
        teacher = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.Adam(teacher.parameters(), lr=3e-3)
        inputs, labels = torch.from_numpy(x[:1200]), torch.from_numpy(y[:1200])
        for _ in range(15):
            for start in range(0, 1200, 64):
                rows = slice(start, start + 64)
                loss = torch.nn.functional.cross_entropy(teacher(inputs[rows]), labels[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        torch.save(teacher.eval(), tmp_path / "teacher.pt")
        repo = tmp_path / "models"
        build_digits_linear(repo)  # version 1 exists: distill writes version 2
        args = [
            "optimize", "--model", str(tmp_path / "teacher.pt"), "--repository", str(repo),
            "--name", "digits", "--passes", "distill", "--student", "mlp-tiny",
            "--train", str(tmp_path / "train.npz"), "--validation", str(tmp_path / "val.npz"),
            "--epochs", "30", "--batch-size", "1,8", "--profile-seconds", "0.05",
            "--max-drop", "3",  # accuracy is tests/unit/test_optimize_torch.py's concern
        ]  # fmt: skip
        outcome = CliRunner().invoke(main, args)
    finally:
        torch.set_num_threads(threads)

    assert outcome.exit_code == 0, outcome.output
    assert "accuracy gate (top1) passed" in outcome.output and "version 2" in outcome.output
    record = json.loads((repo / "digits" / "2" / "optimization.json").read_text())
    assert record["passes"][0]["name"] == "distill"
    assert record["size_bytes_after"] < record["size_bytes_before"] / 2


def test_optimize_rollout_publishes_the_version_and_starts_a_canary(
    repo_and_data: tuple[Path, Path, np.ndarray], tmp_path: Path
) -> None:
    repo, validation, _ = repo_and_data
    args = ["--model-control-mode", "explicit", "--load-model", "digits"]
    with RemoteServer(repo, args, log_dir=tmp_path) as server:
        # Without a config.yaml, --rollout writes one that keeps the baseline serving.
        outcome = CliRunner().invoke(main, [
            "optimize", "--model", str(repo / "digits"), "--repository", str(repo),
            "--name", "digits", "--passes", "graph", "--validation", str(validation),
            "--batch-size", "1", "--profile-seconds", "0.05", "--rollout",
            "--url", server.http_url, "--rollout-steps", "10,50,100",
            "--rollout-interval", "30s",
        ])  # fmt: skip
        assert outcome.exit_code == 0, outcome.output
        status = httpx.get(server.url("/v2/models/digits/rollout")).json()
    assert (status["status"], status["candidate"], status["baseline"]) == ("running", "2", "1")
    assert status["weights"] == {"1": 90.0, "2": 10.0}
    assert status["plan"]["interval_s"] == 30.0
    assert (repo / "digits" / "rollout.json").is_file()
