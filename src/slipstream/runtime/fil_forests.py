"""Tree ensembles run by the library that trained them: XGBoost and LightGBM.

Each :class:`Forest` predicts as its library's own ``predict`` does (probabilities for
classifiers, the objective's transformed value for regressors), so a served answer is
the one its owner checks against in a notebook, to the bit. The alternatives, measured
with ``benchmarks/trees.py --candidates`` (200 trees on 32 features, one thread, this
2-core host shared with other work, so +-30%), rows/s at batch 1 / batch 256:

==============================  ===================  ====================
predictor                       XGBoost (depth 6)    LightGBM (63 leaves)
==============================  ===================  ====================
the library (public call)       5,700 / 336,000      27,000 / 30,000-64,000
Treelite GTIL                   23,000 / 47,000      11,000 / 23,000
tl2cgen, compiled with gcc      53,000 / 200,000     14,000 / 30,000
ONNX Runtime TreeEnsemble       124,000 / 150,000    98,000 / 42,000
==============================  ===================  ====================

Under load a dynamic batcher runs large batches, where XGBoost's own predictor is the
fastest by 1.7x and LightGBM's is on a par with a compiled forest (ONNX Runtime's is
1.4x faster there). The others answer differently in the last bits (up to 2e-7: a row at
a threshold can change class), need a compiler at every load (8 s and 46 s for these
two models) or a conversion (onnxmltools, 0.5-1 s, with its own gaps in objectives and
split kinds). The price is one-row latency: ~100 us of fixed cost per XGBoost call.

XGBoost is called through its C API (``XGBoosterPredictFromDense``, what
``Booster.inplace_predict`` calls) with the request built once: ``inplace_predict``
spends ~95 us of Python per call around a ~90 us prediction of one row (200 trees), so
this halves XGBoost's one-row time (10,500 rows/s against 5,700). The answers are the
same bits. LightGBM's own ``predict`` costs 15-40 us of Python a call and is kept.
"""

from __future__ import annotations

import ctypes
import json
import logging
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import lightgbm
import numpy as np
import xgboost
from xgboost import core as xgboost_core

logger = logging.getLogger(__name__)

# XGBoost objectives that classify: one probability (binary:logistic), a raw margin
# (binary:logitraw), a 0/1 label (binary:hinge), or one value per class (multi:*).
_XGBOOST_CLASSIFIERS = ("binary:", "multi:")
# LightGBM objectives that classify, under each of the names LightGBM accepts.
_LIGHTGBM_CLASSIFIERS = ("binary", "multiclass", "softmax", "multiclassova", "multiclass_ova",
                         "ova", "ovr")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ForestInfo:
    """What a loaded model file says about itself."""

    # Features (columns) one row has.
    n_features: int
    # Scores a row gets per target: 1 for a regressor or a binary classifier (the
    # positive class's probability), the class count for a multiclass classifier.
    n_classes: int
    # Targets a row gets (XGBoost's multi-output regression); 1 for most models.
    n_targets: int
    # The training objective, as the library names it ("binary:logistic", "multiclass").
    objective: str
    # Whether the objective classifies (output_class's default).
    classifier: bool
    # Whether predict gives each row's class id rather than scores (multi:softmax).
    labels: bool = False

    @property
    def width(self) -> int:
        """Values the library's predict gives a row: classes or targets."""
        return max(self.n_classes, 1) * max(self.n_targets, 1)


class Forest(ABC):
    """One loaded tree ensemble; ``predict`` is called from one thread at a time."""

    info: ForestInfo

    @abstractmethod
    def predict(self, rows: np.ndarray) -> np.ndarray:
        """The library's predictions for ``rows`` (FP32 [B, n_features], C order):
        FP32 [B] where ``info.width`` is 1, else [B, width]."""

    @abstractmethod
    def use_threads(self, threads: int) -> None:
        """Run the next predictions on at most ``threads`` threads."""

    def close(self) -> None:  # noqa: B027 - the libraries free on collection
        """Free what the forest holds."""


class XGBoostForest(Forest):
    """An XGBoost booster from a JSON, UBJSON or legacy binary file."""

    def __init__(self, booster: xgboost.Booster, info: ForestInfo, threads: int) -> None:
        self._booster: xgboost.Booster | None = booster
        self.info = info
        self._threads = threads
        # Built once: what inplace_predict serialises to JSON on every call. type 0:
        # the objective's values; all trees; NaN marks a missing feature, as in FIL.
        self._config = json.dumps(
            {
                "type": 0,
                "training": False,
                "iteration_begin": 0,
                "iteration_end": 0,
                "strict_shape": False,
                "cache_id": 0,
                "missing": float("nan"),
            }
        ).encode()
        self._shape = ctypes.POINTER(ctypes.c_uint64)()
        self._dims = ctypes.c_uint64()
        self._result = ctypes.POINTER(ctypes.c_float)()

    @classmethod
    def load(cls, data: bytes, threads: int, want_proba: bool) -> XGBoostForest:
        """A booster from a file's bytes (XGBoost tells its formats apart by content);
        ValueError says what is wrong with the file."""
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                booster = xgboost.Booster(model_file=bytearray(data))
        except (xgboost.core.XGBoostError, UnicodeDecodeError) as exc:
            raise ValueError(_xgboost_load_error(data, exc)) from None
        for warning in said:
            logger.warning("xgboost: %s", warning.message)
        booster.set_param({"nthread": threads})
        learner = json.loads(booster.save_config())["learner"]
        objective = str(learner["objective"]["name"])
        parameters = learner["learner_model_param"]
        n_classes = max(1, int(parameters.get("num_class", "0")))
        n_targets = max(1, int(parameters.get("num_target", "1")))
        if objective == "multi:softmax" and want_proba:
            # multi:softmax predicts class ids; the same trees under multi:softprob give
            # the probabilities predict_proba serves, computed by XGBoost itself.
            booster.set_param({"objective": "multi:softprob"})
        labels = objective == "multi:softmax" and not want_proba
        info = ForestInfo(
            n_features=booster.num_features(),
            n_classes=1 if labels else n_classes,  # a class id a row
            n_targets=n_targets,
            objective=objective,
            classifier=objective.startswith(_XGBOOST_CLASSIFIERS),
            labels=labels,
        )
        return cls(booster, info, threads)

    def use_threads(self, threads: int) -> None:
        if threads != self._threads and self._booster is not None:
            # XGBoost configures itself again at its next prediction (~70 us here): only
            # on a change.
            self._booster.set_param({"nthread": threads})
            self._threads = threads

    def predict(self, rows: np.ndarray) -> np.ndarray:
        booster = self._booster
        if booster is None:
            raise RuntimeError("fil backend: predict() after close()")
        batch, features = rows.shape
        # The array interface XGBoost reads the rows through (no copy).
        interface = (
            f'{{"data":[{rows.ctypes.data},true],"shape":[{batch},{features}],'
            f'"typestr":"<f4","version":3}}'
        ).encode()
        status = xgboost_core._LIB.XGBoosterPredictFromDense(
            booster.handle,
            interface,
            self._config,
            None,
            ctypes.byref(self._shape),
            ctypes.byref(self._dims),
            ctypes.byref(self._result),
        )
        if status != 0:
            message = xgboost_core._LIB.XGBGetLastError()
            raise RuntimeError(f"xgboost: {message.decode(errors='replace')}")
        shape = tuple(int(self._shape[axis]) for axis in range(self._dims.value))
        # The result lives in the booster's buffer until its next call: copied out.
        out = np.empty(shape, dtype=np.float32)
        ctypes.memmove(out.ctypes.data, self._result, out.nbytes)
        return out

    def close(self) -> None:
        self._booster = None


class LightGBMForest(Forest):
    """A LightGBM booster from its text format."""

    def __init__(self, booster: lightgbm.Booster, info: ForestInfo, threads: int) -> None:
        self._booster: lightgbm.Booster | None = booster
        self.info = info
        self._threads = threads

    @classmethod
    def load(cls, data: bytes, threads: int) -> LightGBMForest:
        """A booster from a text file's bytes; ValueError says what is wrong with it."""
        try:
            text = data.decode()
            booster = lightgbm.Booster(model_str=text)
        except (UnicodeDecodeError, lightgbm.basic.LightGBMError) as exc:
            raise ValueError(
                f"not a LightGBM model ({exc}); parameters.model_type lightgbm reads the "
                "text format of booster.save_model('model.txt')"
            ) from None
        header = _lightgbm_header(text)
        objective = header.get("objective", "regression").split(" ", 1)[0]
        n_classes = booster.num_model_per_iteration()
        info = ForestInfo(
            n_features=booster.num_feature(),
            n_classes=n_classes,
            n_targets=1,
            objective=objective,
            classifier=objective in _LIGHTGBM_CLASSIFIERS,
        )
        return cls(booster, info, threads)

    def use_threads(self, threads: int) -> None:
        self._threads = threads  # LightGBM takes its thread count with each call

    def predict(self, rows: np.ndarray) -> np.ndarray:
        booster = self._booster
        if booster is None:
            raise RuntimeError("fil backend: predict() after close()")
        # LightGBM computes in double; FIL serves FP32.
        values: Any = booster.predict(rows, num_threads=self._threads)
        return np.asarray(values, dtype=np.float32)

    def close(self) -> None:
        self._booster = None


def load_forest(model_type: str, data: bytes, threads: int, want_proba: bool) -> Forest:
    """The forest in ``data`` (a model file's bytes) as ``model_type`` says it is."""
    if model_type == "lightgbm":
        return LightGBMForest.load(data, threads)
    if data.startswith(b"tree"):
        raise ValueError(
            f"parameters.model_type {model_type} is XGBoost's, but the file is LightGBM's "
            "text format; set model_type to lightgbm"
        )
    return XGBoostForest.load(data, threads, want_proba)


def _xgboost_load_error(data: bytes, exc: BaseException) -> str:
    if data.lstrip()[:1] != b"{":
        # Neither JSON nor UBJSON: XGBoost's binary format of before 2.1, which XGBoost
        # 3.1 and later no longer read (their error message is not even UTF-8).
        return (
            f"not an XGBoost JSON or UBJSON model (xgboost {xgboost.__version__} read: "
            f"{_first_line(exc)}); a model in XGBoost's legacy binary format loads with "
            "xgboost < 3.1: load it there and save it again as xgboost.json or xgboost.ubj"
        )
    return f"not a valid XGBoost model: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # XGBoost's messages start "[time] file:line: message", then a stack trace.
    first = lines[0] if lines else type(exc).__name__
    return first.split(": ", 1)[-1] if first.startswith("[") else first


def _lightgbm_header(text: str) -> dict[str, str]:
    """The ``key=value`` lines before the first tree of a LightGBM model file."""
    header: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("Tree="):
            break
        key, sep, value = line.partition("=")
        if sep:
            header[key.strip()] = value.strip()
    return header
