"""The fil backend (Triton FIL's XGBoost and LightGBM models): answers equal to the
library's own predict, FIL's output semantics, its parameters, its file names, the
config completed from the file, and clear errors for bad parameters and files.

Equality is bit for bit: XGBoost's values are its own FP32 predictions copied out, and
LightGBM's are its own double predictions rounded once to FP32, which the tests do the
same way; class ids and thresholds are exact by construction.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slipstream.config import ConfigError, ModelConfig, TensorConfig, parse_model_config
from slipstream.errors import InvalidRequest
from slipstream.repository.autocomplete import complete_config
from slipstream.repository.layout import model_file
from slipstream.repository.triton_config import parse_triton_config
from slipstream.runtime import backend_for_file, get_backend
from tests.tree_models import (
    CLASSES,
    FEATURES,
    fil_config,
    rows,
    save,
    train_lightgbm,
    train_xgboost,
)

xgboost = pytest.importorskip("xgboost")
lightgbm = pytest.importorskip("lightgbm")

from slipstream.runtime.fil import FilBackend, parse_options  # noqa: E402

X = rows(300, seed=7)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved model per (library, task), in Triton FIL's file names."""
    root = tmp_path_factory.mktemp("trees")
    made = {}
    for task in ("binary", "multiclass", "softmax", "regression"):
        made[f"xgboost_{task}"] = save(train_xgboost(task), root / f"x_{task}", "xgboost.json")
    for task in ("binary", "multiclass", "regression"):
        made[f"lightgbm_{task}"] = save(train_lightgbm(task), root / f"l_{task}", "model.txt")
    made["xgboost_ubj"] = save(train_xgboost("binary"), root / "x_ubj", "xgboost.ubj")
    made["xgboost_model"] = save(train_xgboost("binary"), root / "x_model", "xgboost.model")
    return made


def library_predict(path: Path, x: np.ndarray) -> np.ndarray:
    """The library's own predict of the file at ``path`` (FP32, as FIL serves it)."""
    if path.suffix == ".txt":
        return np.asarray(lightgbm.Booster(model_file=str(path)).predict(x), dtype=np.float32)
    booster = xgboost.Booster(model_file=bytearray(path.read_bytes()))
    return np.asarray(booster.inplace_predict(x), dtype=np.float32)


def serve(path: Path, parameters: dict[str, str], output_dims: list[int] | None = None) -> Any:
    model = FilBackend.load(path, parameters, 1)
    if output_dims is not None:
        model.configure({"output": [{"name": "output__0", "dims": output_dims}]})
    return model


def answer(model: Any, x: np.ndarray) -> np.ndarray:
    out: np.ndarray = model.run({"input__0": x}, ["output__0"])["output__0"]
    assert out.dtype == np.float32 and out.shape[0] == len(x)
    return out


# -- answers -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["xgboost_regression", "lightgbm_regression"])
def test_a_regressor_answers_the_librarys_predictions(files: dict[str, Path], name: str) -> None:
    want = library_predict(files[name], X)
    out = answer(serve(files[name], {"output_class": "false"}), X)
    assert out.shape == (len(X), 1)
    np.testing.assert_array_equal(out[:, 0], want)
    # The XGBoost reference is the same bits through the DMatrix path too.
    if name.startswith("xgboost"):
        booster = xgboost.Booster(model_file=bytearray(files[name].read_bytes()))
        np.testing.assert_array_equal(out[:, 0], booster.predict(xgboost.DMatrix(X)))


@pytest.mark.parametrize("name", ["xgboost_binary", "lightgbm_binary", "xgboost_ubj",
                                  "xgboost_model"])  # fmt: skip
def test_a_binary_classifier_answers_as_fil(files: dict[str, Path], name: str) -> None:
    p = library_predict(files[name], X)
    assert 0 < np.mean(p > 0.5) < 1  # both classes occur, or the checks below prove little
    classes = answer(serve(files[name], {"output_class": "true"}), X)
    np.testing.assert_array_equal(classes[:, 0], (p > 0.5).astype(np.float32))
    low = answer(serve(files[name], {"output_class": "true", "threshold": "0.3"}), X)
    np.testing.assert_array_equal(low[:, 0], (p > 0.3).astype(np.float32))
    assert low.sum() > classes.sum()
    both = answer(serve(files[name], {"output_class": "true", "predict_proba": "true"}, [2]), X)
    np.testing.assert_array_equal(both, np.stack([1 - p, p], axis=1))
    one = answer(serve(files[name], {"output_class": "true", "predict_proba": "true"}, [1]), X)
    np.testing.assert_array_equal(one, p[:, None])
    # Without batching (max_batch_size: 0) the config's dims list the batch dim first.
    unbatched = serve(files[name], {"output_class": "true", "predict_proba": "true"}, [-1, 1])
    np.testing.assert_array_equal(answer(unbatched, X), p[:, None])


@pytest.mark.parametrize("name", ["xgboost_multiclass", "lightgbm_multiclass"])
def test_a_multiclass_classifier_answers_as_fil(files: dict[str, Path], name: str) -> None:
    probabilities = library_predict(files[name], X)
    assert probabilities.shape == (len(X), CLASSES)
    proba = answer(serve(files[name], {"predict_proba": "true"}), X)
    np.testing.assert_array_equal(proba, probabilities)
    classes = answer(serve(files[name], {"output_class": "true"}), X)
    np.testing.assert_array_equal(classes[:, 0], probabilities.argmax(axis=1))
    assert len(set(classes[:, 0].tolist())) == CLASSES


def test_a_softmax_model_serves_its_class_ids_and_the_softprob_probabilities(
    files: dict[str, Path],
) -> None:
    booster = xgboost.Booster(model_file=bytearray(files["xgboost_softmax"].read_bytes()))
    labels = booster.inplace_predict(X)  # multi:softmax predicts class ids
    classes = answer(serve(files["xgboost_softmax"], {}), X)
    np.testing.assert_array_equal(classes[:, 0], labels)
    booster.set_param({"objective": "multi:softprob"})
    proba = answer(serve(files["xgboost_softmax"], {"predict_proba": "true"}), X)
    np.testing.assert_array_equal(proba, booster.inplace_predict(X))
    np.testing.assert_array_equal(proba.argmax(axis=1), labels)


def test_categorical_splits_answer_as_the_library(tmp_path: Path) -> None:
    # FIL serves categorical features as float codes; so does XGBoost's own predict.
    x = rows(300, seed=3, features=4)
    x[:, 0] = np.random.default_rng(3).integers(0, 6, len(x))
    y = (x[:, 0] % 2 == 0) ^ (np.nan_to_num(x[:, 1]) > 0)
    kinds = ["c", "q", "q", "q"]
    data = xgboost.DMatrix(x, y.astype(np.int32), feature_types=kinds, enable_categorical=True)
    booster = xgboost.train({"objective": "binary:logistic", "max_cat_to_onehot": 1}, data, 6)
    path = save(booster, tmp_path, "xgboost.json")
    want = booster.predict(xgboost.DMatrix(x, feature_types=kinds, enable_categorical=True))
    assert np.mean((want > 0.5) == y) > 0.9  # the splits on category codes do the work
    out = answer(serve(path, {"output_class": "false"}), x)
    np.testing.assert_array_equal(out[:, 0], want)


def test_output_class_defaults_to_what_the_objective_says(files: dict[str, Path]) -> None:
    binary = answer(serve(files["lightgbm_binary"], {}), X)
    assert set(binary[:, 0].tolist()) == {0.0, 1.0}
    regression = answer(serve(files["xgboost_regression"], {}), X)
    np.testing.assert_array_equal(regression[:, 0], library_predict(files["xgboost_regression"], X))
    # is_classifier is FIL's name for it since 25.09: false serves the probability itself.
    scores = answer(serve(files["xgboost_binary"], {"is_classifier": "false"}), X)
    np.testing.assert_array_equal(scores[:, 0], library_predict(files["xgboost_binary"], X))


def test_answers_do_not_depend_on_the_batch(files: dict[str, Path]) -> None:
    for name in ("xgboost_multiclass", "lightgbm_binary"):
        model = serve(files[name], {"predict_proba": "true"})
        whole = answer(model, X)
        one_by_one = np.concatenate([answer(model, X[i : i + 1]) for i in range(0, 40)])
        np.testing.assert_array_equal(one_by_one, whole[:40])


def test_input_rows_need_not_be_contiguous_or_fp32_copies(files: dict[str, Path]) -> None:
    model = serve(files["xgboost_regression"], {})
    wide = np.repeat(X, 2, axis=1)[:, ::2]  # a strided view of the same values
    np.testing.assert_array_equal(answer(model, wide), answer(model, X))


# -- the model's tensors, completed from the file --------------------------------------------


@pytest.mark.parametrize(
    ("name", "parameters", "dims"),
    [
        ("xgboost_regression", {}, [1]),
        ("xgboost_binary", {}, [1]),
        ("xgboost_binary", {"predict_proba": "true"}, [-1]),  # [2], or [1] where said
        ("lightgbm_multiclass", {"predict_proba": "true"}, [CLASSES]),
        ("lightgbm_multiclass", {}, [1]),
        ("xgboost_multiclass", {"output_class": "false"}, [CLASSES]),
    ],
)
def test_a_config_without_tensors_is_completed_from_the_file(
    files: dict[str, Path], name: str, parameters: dict[str, str], dims: list[int]
) -> None:
    model = serve(files[name], parameters)
    done = complete_config(ModelConfig(name="m", parameters=parameters), model.signature(), "fil")
    assert done.max_batch_size == 32768
    assert [(t.name, t.data_type, t.dims) for t in done.input] == [("input__0", "FP32", [FEATURES])]
    assert [(t.name, t.data_type, t.dims) for t in done.output] == [("output__0", "FP32", dims)]


def test_a_config_that_disagrees_with_the_file_fails_naming_the_tensor(
    files: dict[str, Path],
) -> None:
    model = serve(files["lightgbm_multiclass"], {"predict_proba": "true"})
    config = ModelConfig(
        name="m",
        max_batch_size=8,
        input=[TensorConfig(name="input__0", data_type="FP32", dims=[FEATURES + 1])],
        output=[TensorConfig(name="output__0", data_type="FP32", dims=[CLASSES])],
    )
    with pytest.raises(ConfigError, match=r"input 'input__0'.*dims"):
        complete_config(config, model.signature(), "fil")


# -- requests ------------------------------------------------------------------------------


def test_a_wrong_feature_count_is_the_requests_to_fix(files: dict[str, Path]) -> None:
    model = serve(files["xgboost_binary"], {})
    with pytest.raises(InvalidRequest, match=rf"\[batch, {FEATURES}\] \({FEATURES} features"):
        model.run({"input__0": rows(2, features=FEATURES - 1)}, ["output__0"])
    with pytest.raises(InvalidRequest, match="missing input 'input__0'"):
        model.run({"x": X[:1]}, ["output__0"])
    with pytest.raises(InvalidRequest, match="unknown output 'treeshap_output'"):
        model.run({"input__0": X[:1]}, ["treeshap_output"])


# -- parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"predict_proba": "yes"}, r"parameters.predict_proba: 'yes'; expected \"true\""),
        ({"output_class": "2"}, "parameters.output_class: '2'"),
        ({"threshold": "high"}, "parameters.threshold: 'high'; expected a number"),
        ({"threshold": "nan"}, "parameters.threshold: 'nan'"),
        ({"cpu_nthread": "two"}, "parameters.cpu_nthread: 'two'"),
        ({"algo": "FAST"}, "parameters.algo: 'FAST'; expected ALGO_AUTO, NAIVE"),
        ({"storage_type": "COMPACT"}, "parameters.storage_type: 'COMPACT'"),
        ({"threads_per_tree": "0"}, "parameters.threads_per_tree: '0'"),
        ({"blocks_per_sm": "-1"}, "parameters.blocks_per_sm: '-1'"),
        ({"use_experimental_optimizations": "on"}, "use_experimental_optimizations: 'on'"),
        ({"output_clas": "true"}, "unknown fil backend parameter.*output_clas;.*output_class"),
        ({"output_class": "true", "is_classifier": "true"}, "give one"),
        ({"device": "cuda"}, "parameters.device: 'cuda'"),
    ],
)
def test_a_bad_parameter_fails_the_load_naming_it(
    files: dict[str, Path], parameters: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        FilBackend.load(files["xgboost_binary"], parameters, 1)


def test_tritons_gpu_parameters_are_accepted_and_change_nothing(
    files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    gpu = {
        "algo": "BATCH_TREE_REORG",
        "storage_type": "SPARSE",
        "threads_per_tree": "4",
        "blocks_per_sm": "2",
        "use_experimental_optimizations": "true",
        "transfer_threshold": "2",
        "layout": "depth_first",
        "chunk_size": "8",
        "xgboost_allow_unknown_field": "true",
    }
    with caplog.at_level(logging.INFO, logger="slipstream.runtime.fil"):
        tuned = answer(serve(files["xgboost_binary"], {**gpu, "predict_proba": "true"}), X)
    assert "algo, storage_type" in caplog.text and "ignored" in caplog.text
    plain = answer(serve(files["xgboost_binary"], {"predict_proba": "true"}), X)
    np.testing.assert_array_equal(tuned, plain)
    assert parse_options({"cpu_nthread": "3"}).threads == 3
    assert parse_options({"cpu_nthread": "-1"}).threads is None


def xgboost_threads(model: Any) -> int:
    """The nthread the XGBoost library was last told (its own config)."""
    learner = json.loads(model._forest._booster.save_config())["learner"]
    return int(learner["generic_param"]["nthread"])


def test_runs_take_a_thread_per_64_rows_up_to_the_count(files: dict[str, Path]) -> None:
    model = FilBackend.load(files["xgboost_binary"], {"cpu_nthread": "3"}, 1)
    assert model.cpu_threads == 3
    for rows_sent, threads in ((1, 1), (127, 1), (128, 2), (256, 3), (1, 1)):
        answer(model, rows(rows_sent))
        assert xgboost_threads(model) == threads, rows_sent
    lgb = FilBackend.load(files["lightgbm_binary"], {"cpu_nthread": "2"}, 1)
    answer(lgb, rows(256))
    assert lgb._forest._threads == 2
    answer(lgb, rows(3))
    assert lgb._forest._threads == 1
    # 64 instances share the cores: one thread each.
    assert FilBackend.load(files["xgboost_binary"], {}, 64).cpu_threads == 1


@pytest.mark.parametrize("model_type", ["treelite_checkpoint", "sklearn"])
def test_formats_not_served_here_are_refused_with_the_way_out(
    files: dict[str, Path], model_type: str
) -> None:
    with pytest.raises(ValueError, match=f"model_type: '{model_type}'.*(save|serve)"):
        FilBackend.load(files["xgboost_binary"], {"model_type": model_type}, 1)
    with pytest.raises(ValueError, match="expected one of xgboost, xgboost_json"):
        FilBackend.load(files["xgboost_binary"], {"model_type": "catboost"}, 1)


# -- files -----------------------------------------------------------------------------------


def test_model_type_is_read_from_the_file_where_the_config_gives_none(
    files: dict[str, Path], tmp_path: Path
) -> None:
    # A LightGBM file under an XGBoost name, and the reverse: the contents decide.
    lgb_file = tmp_path / "model.json"
    lgb_file.write_bytes(files["lightgbm_binary"].read_bytes())
    np.testing.assert_array_equal(
        answer(serve(lgb_file, {"output_class": "false"}), X)[:, 0],
        library_predict(files["lightgbm_binary"], X),
    )
    with pytest.raises(ValueError, match="the file is LightGBM's text format; set model_type"):
        FilBackend.load(lgb_file, {"model_type": "xgboost_json"}, 1)
    with pytest.raises(ValueError, match=r"model_type lightgbm.*not a LightGBM model"):
        FilBackend.load(files["xgboost_ubj"], {"model_type": "lightgbm"}, 1)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (b"", "the file is empty"),
        (b'{"learner": {"broken', "not a valid XGBoost model"),
        (b"binf\x00\x00\x80?\x05\x00\x00\x00\xe1\xff", "legacy binary format loads with xgboost"),
    ],
)
def test_a_corrupt_file_fails_the_load_naming_the_file(
    tmp_path: Path, contents: bytes, message: str
) -> None:
    path = tmp_path / "xgboost.model"
    path.write_bytes(contents)
    with pytest.raises(ValueError, match=f"xgboost.model.*{message}"):
        FilBackend.load(path, {}, 1)


def test_a_corrupt_lightgbm_file_fails_the_load_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.txt"
    path.write_text("tree\nversion=v4\nnum_class=1\nTree=0\nnum_leaves=oops\n")
    with pytest.raises(ValueError, match=r"model.txt .model_type lightgbm.: not a LightGBM model"):
        FilBackend.load(path, {}, 1)
    with pytest.raises(FileNotFoundError):
        FilBackend.load(tmp_path / "missing.txt", {}, 1)


@pytest.mark.parametrize(
    ("model_type", "filename"),
    [
        ("xgboost", "xgboost.model"),
        ("xgboost_json", "xgboost.json"),
        ("xgboost_ubj", "xgboost.ubj"),
        ("lightgbm", "model.txt"),
    ],
)
def test_the_file_is_found_by_tritons_fil_names(
    tmp_path: Path, model_type: str, filename: str
) -> None:
    version = tmp_path / "1"
    version.mkdir()
    for name in ("xgboost.model", "xgboost.json", "xgboost.ubj", "model.txt"):
        (version / name).write_text("x")
    config = ModelConfig(backend="fil", parameters={"model_type": model_type})
    assert model_file(version, config) == version / filename


def test_a_missing_file_names_the_one_expected(tmp_path: Path) -> None:
    version = tmp_path / "1"
    version.mkdir()
    (version / "notes.md").write_text("x")
    config = ModelConfig(backend="fil", parameters={"model_type": "xgboost_ubj"})
    with pytest.raises(ConfigError, match=r"expected xgboost.ubj .model_type xgboost_ubj."):
        model_file(version, config)
    with pytest.raises(ConfigError, match=r"xgboost.model or xgboost.json or xgboost.ubj"):
        model_file(version, ModelConfig(backend="fil"))
    (version / "xgboost.json").write_text("x")
    (version / "model.txt").write_text("x")
    with pytest.raises(ConfigError, match="several tree model files"):
        model_file(version, ModelConfig(backend="fil"))
    # default_model_filename still names any file.
    config = ModelConfig(backend="fil", default_model_filename="notes.md")
    assert model_file(version, config) == version / "notes.md"


def test_a_model_without_config_is_a_tree_model_by_its_extension(tmp_path: Path) -> None:
    for name in ("model.json", "model.ubj", "model.txt"):
        assert backend_for_file(Path(name)) == "fil"
    assert get_backend("fil") is FilBackend
    version = tmp_path / "1"
    version.mkdir()
    (version / "model.ubj").write_text("x")
    assert model_file(version, ModelConfig()) == version / "model.ubj"


def test_the_fil_docs_example_config_reads_as_a_fil_model() -> None:
    parsed = parse_triton_config(
        fil_config("xgboost_ubj", 32, 1, {"output_class": "true"}), "m/config.pbtxt"
    )
    config = parse_model_config(parsed, "m/config.pbtxt")
    assert config.backend == "fil"
    assert config.max_batch_size == 32768
    assert config.parameters == {"model_type": "xgboost_ubj", "output_class": "true"}
    assert [(t.name, t.dims) for t in config.input] == [("input__0", [32])]
    assert config.instance_group[0].kind == "KIND_CPU"  # KIND_AUTO: the CPU, here
