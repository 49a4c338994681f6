"""examples/build_models.py builds the models the README and the benchmarks serve."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import onnxruntime as ort
import pytest

from slipstream.runtime import get_backend

BUILD_MODELS = Path(__file__).resolve().parents[2] / "examples" / "build_models.py"


@pytest.fixture(scope="module")
def build_models() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_models", BUILD_MODELS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _io(session: ort.InferenceSession) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    return (
        [(i.name, i.type) for i in session.get_inputs()],
        [(o.name, o.type) for o in session.get_outputs()],
    )


def test_digits_onnx_and_sklearn_agree_and_are_accurate(
    build_models: ModuleType, example_models: Path
) -> None:
    # The session's build (tests/conftest.py): build_digits finds it built.
    onnx_path = build_models.build_digits(example_models)
    assert onnx_path == example_models / "digits" / "1" / "model.onnx"
    session = _session(onnx_path)
    assert _io(session) == (
        [("input", "tensor(float)")],
        [("label", "tensor(int64)"), ("probabilities", "tensor(float)")],
    )
    # A dynamic batch axis: the server may batch any number of rows.
    assert session.get_inputs()[0].shape[0] != 1

    _, x_test, _, y_test = build_models.digits_split()
    labels, probabilities = session.run(None, {"input": x_test})
    assert np.mean(labels == y_test) > 0.9
    assert probabilities.shape == (len(x_test), 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)

    sklearn_dir = example_models / "digits_sklearn"
    config = (sklearn_dir / "config.yaml").read_text()
    # A pickle: the server loads it only because the example's config opts in.
    assert "backend: sklearn" in config and "trust_pickle: true" in config
    backend = get_backend("sklearn").load(sklearn_dir / "1" / "model.joblib", {}, 1)
    served = backend.run({"input": x_test}, ["predict", "predict_proba"])
    np.testing.assert_array_equal(served["predict"], labels)
    np.testing.assert_allclose(served["predict_proba"], probabilities, atol=1e-4)


def test_build_is_skipped_when_built_and_redone_with_force(
    build_models: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = build_models.build_mlp(tmp_path)
    path.write_bytes(b"stale")
    assert build_models.main([str(tmp_path), "--only", "mlp"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert path.read_bytes() == b"stale"
    assert build_models.main([str(tmp_path), "--only", "mlp", "--force"]) == 0
    assert _session(path).get_outputs()[0].name == "output"


def test_mlp_shape_and_determinism(build_models: ModuleType, tmp_path: Path) -> None:
    first = build_models.build_mlp(tmp_path / "a")
    second = build_models.build_mlp(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()
    session = _session(first)
    assert _io(session) == ([("input", "tensor(float)")], [("output", "tensor(float)")])
    assert session.get_inputs()[0].shape[1:] == [256]

    x = np.random.default_rng(0).standard_normal((33, 256)).astype(np.float32)
    (out,) = session.run(None, {"input": x})
    assert out.shape == (33, 10)
    assert np.all(np.isfinite(out)) and out.std() > 0


@pytest.mark.slow
def test_minilm_embeds_like_sentence_transformers(example_models: Path) -> None:
    # The session's build (tests/conftest.py); build_minilm itself checked cosine > 0.999
    # against sentence-transformers before it wrote the model.
    onnx_path = example_models / "minilm" / "1" / "model.onnx"
    session = _session(onnx_path)
    assert _io(session) == (
        [("input_ids", "tensor(int64)"), ("attention_mask", "tensor(int64)")],
        [("sentence_embedding", "tensor(float)")],
    )
    assert "max_batch_size: 64" in (example_models / "minilm" / "config.yaml").read_text()

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(example_models / "minilm" / "tokenizer" / "tokenizer.json"))
    sentences = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell today."]
    encodings = tokenizer.encode_batch(sentences)
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }
    (embeddings,) = session.run(None, feeds)
    assert embeddings.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    similarity = embeddings @ embeddings.T
    assert similarity[0, 1] > similarity[0, 2] + 0.3

    # Padding must not change a sentence's embedding.
    alone = tokenizer.encode(sentences[0])
    (single,) = session.run(
        None,
        {
            "input_ids": np.array([alone.ids], dtype=np.int64),
            "attention_mask": np.array([alone.attention_mask], dtype=np.int64),
        },
    )
    np.testing.assert_allclose(single[0], embeddings[0], atol=1e-5)
