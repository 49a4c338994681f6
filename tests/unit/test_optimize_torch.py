"""The PyTorch passes of ``slipstream optimize``: ``prune`` really shrinks the dense model
and keeps its accuracy after fine-tuning; ``distill`` trains a smaller student that
passes the top1 gate. Both on scikit-learn's digits, with a small MLP teacher."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from sklearn.datasets import load_digits

torch = pytest.importorskip("torch")
pytest.importorskip("torch_pruning")

from slipstream.optimize import (  # noqa: E402
    OptimizeError,
    OptimizeRequest,
    PassSettings,
    optimize_model,
)


def onnx_parameter_count(path: Path) -> int:
    return sum(numpy_helper.to_array(init).size for init in onnx.load(str(path)).graph.initializer)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """With onnxruntime / scikit-learn's OpenMP loaded first, torch's own threads spin
    against theirs and small-batch training runs ~15x slower; one thread avoids it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``teacher.pt`` (64 -> 128 -> 128 -> 10 MLP, ~97 % on held-out digits) beside
    ``train.npz`` and ``val.npz`` (``pixels`` [N, 64], ``labels``)."""
    folder = tmp_path_factory.mktemp("digits")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    np.savez(folder / "train.npz", pixels=x[:1300], labels=y[:1300])
    np.savez(folder / "val.npz", pixels=x[1300:], labels=y[1300:])
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    optimizer = torch.optim.Adam(teacher.parameters(), lr=3e-3)
    inputs, labels = torch.from_numpy(x[:1300]), torch.from_numpy(y[:1300])
    for _ in range(20):
        for start in range(0, 1300, 64):
            loss = torch.nn.functional.cross_entropy(
                teacher(inputs[start : start + 64]), labels[start : start + 64]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    torch.save(teacher.eval(), folder / "teacher.pt")
    return folder


def _request(folder: Path, passes: list[str], **settings: object) -> OptimizeRequest:
    return OptimizeRequest(
        model=folder / "teacher.pt",
        repository=folder / "repo",
        name="digits",
        passes=passes,
        validation=folder / "val.npz",
        train=folder / "train.npz",
        settings=PassSettings(**settings),  # type: ignore[arg-type]
        measure_speed=False,
    )


def test_prune_removes_half_the_neurons_and_keeps_accuracy(digits_teacher: Path) -> None:
    result = optimize_model(_request(digits_teacher, ["prune"], prune_ratio=0.5, epochs=8))

    assert result.gate.metric == "top1" and result.gate.passed, result.gate.summary
    assert result.version_dir is not None
    written = result.version_dir / "model.onnx"
    # 64-128-128-10 -> 64-64-64-10: 26,122 -> 8,970 parameters, in PyTorch and in ONNX.
    assert result.passes[0].settings["parameters_after"] == 8970
    assert onnx_parameter_count(written) == 8970
    assert result.size_bytes_after < 0.4 * result.size_bytes_before
    record = json.loads((result.version_dir / "optimization.json").read_text())
    assert record["passes"][0]["name"] == "prune" and "torch-pruning" in record["tool_versions"]


def test_prune_keeps_a_dynamic_batch_and_chains_with_onnx_passes(digits_teacher: Path) -> None:
    import onnxruntime as ort

    result = optimize_model(
        _request(digits_teacher, ["int8-dynamic", "prune"], prune_ratio=0.5, epochs=4)
    )

    assert [record.name for record in result.passes] == ["prune", "int8-dynamic"]
    assert result.gate.passed and result.version_dir is not None
    session = ort.InferenceSession(
        str(result.version_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    pixels = np.load(digits_teacher / "val.npz")["pixels"]
    for batch in (1, 37):
        (logits,) = session.run(None, {"pixels": pixels[:batch]})
        assert logits.shape == (batch, 10)


def test_distill_trains_a_smaller_student_that_passes_the_top1_gate(
    digits_teacher: Path,
) -> None:
    result = optimize_model(_request(digits_teacher, ["distill"], student="mlp-small", epochs=40))

    assert result.gate.metric == "top1" and result.gate.passed, result.gate.summary
    assert result.version_dir is not None
    # 64-64-10 student: 4,810 parameters against the teacher's 26,122.
    assert onnx_parameter_count(result.version_dir / "model.onnx") == 4810
    assert result.size_bytes_after < result.size_bytes_before / 4
    assert result.passes[0].settings["temperature"] == 4.0


def test_torch_pass_mistakes_name_the_fix(digits_teacher: Path, tmp_path: Path) -> None:
    no_train = OptimizeRequest(
        model=digits_teacher / "teacher.pt",
        repository=tmp_path,
        name="digits",
        passes=["distill"],
        validation=digits_teacher / "val.npz",
    )
    with pytest.raises(OptimizeError, match="--train"):
        optimize_model(no_train)
    with pytest.raises(OptimizeError, match="--student"):
        optimize_model(_request(digits_teacher, ["distill"], student="no-such-preset"))
    with pytest.raises(OptimizeError, match="is a PyTorch model"):
        optimize_model(_request(digits_teacher, ["graph"]))
    torch.save(torch.nn.Linear(64, 10).state_dict(), tmp_path / "weights.pt")
    state_dict = OptimizeRequest(
        model=tmp_path / "weights.pt",
        repository=tmp_path,
        name="digits",
        passes=["prune"],
        validation=digits_teacher / "val.npz",
    )
    with pytest.raises(OptimizeError, match="not a state dict"):
        optimize_model(state_dict)
    assert not (tmp_path / "digits").exists()
