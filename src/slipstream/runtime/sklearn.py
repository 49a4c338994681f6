"""The scikit-learn backend: fitted estimators saved with joblib (``.joblib``, ``.pkl``).

The model takes one input, ``input``, of shape ``[-1, n_features_in_]`` (a batch of
feature rows), and offers up to two outputs:

* ``predict``: ``estimator.predict(input)``, shape ``[-1]`` (or ``[-1, n_outputs]`` for
  multi-output estimators); its datatype comes from a probe prediction at load time
  (INT64 class labels, FP64 regression values, BYTES for string labels).
* ``predict_proba``: when the estimator has ``predict_proba``, shape
  ``[-1, n_classes]`` in the input's float type.

Parameters (config.yaml ``parameters``):

* ``input_dtype``: ``FP32`` (default) or ``FP64``, the datatype clients send.

Loading a pickle runs code from the file, so the server loads one only when the model's
config.yaml says ``trust_pickle: true`` (or with ``slipstream serve --trust-pickle``).

Example repository entry::

    digits_sklearn/config.yaml      backend: sklearn, trust_pickle: true
    digits_sklearn/1/model.joblib   joblib.dump(Pipeline([...]).fit(X, y), path)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import joblib
import numpy as np

from slipstream.datatypes import v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.runtime.base import Backend, ModelSignature, TensorSpec
from slipstream.runtime.data_errors import refused

logger = logging.getLogger(__name__)

INPUT_NAME = "input"
PREDICT = "predict"
PREDICT_PROBA = "predict_proba"

_INPUT_DTYPES: dict[str, np.dtype[np.floating[Any]]] = {
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_KNOWN_PARAMETERS = ("input_dtype",)


class SklearnBackend(Backend):
    """One loaded scikit-learn estimator; see the module docstring."""

    name: ClassVar[str] = "sklearn"
    file_extensions: ClassVar[tuple[str, ...]] = (".joblib", ".pkl")
    # numpy and scikit-learn hold the GIL for much of predict(); the scheduler still
    # runs it off the event loop.
    releases_gil: ClassVar[bool] = False
    pickle_free_format: ClassVar[str] = (
        "convert the estimator to ONNX with skl2onnx and serve model.onnx"
    )

    def __init__(
        self, estimator: Any, input_dtype: np.dtype[np.floating[Any]], signature: ModelSignature
    ) -> None:
        self._estimator: Any = estimator
        self._input_dtype = input_dtype
        self._signature = signature
        self._serves_proba = any(spec.name == PREDICT_PROBA for spec in signature.outputs)

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> SklearnBackend:
        input_dtype = _parse_parameters(parameters)
        estimator = joblib.load(path)
        if not callable(getattr(estimator, "predict", None)):
            raise ValueError(
                f"{path.name}: a {type(estimator).__name__} has no predict(); save a fitted "
                "scikit-learn estimator or Pipeline with joblib.dump"
            )
        n_features = getattr(estimator, "n_features_in_", None)
        if not isinstance(n_features, int):
            raise ValueError(
                f"{path.name}: the {type(estimator).__name__} has no n_features_in_; "
                "save it after fit() with scikit-learn >= 1.0"
            )
        signature = _probe_signature(estimator, n_features, input_dtype)
        return cls(estimator, input_dtype, signature)

    @classmethod
    def loads_pickle(cls, path: Path) -> bool:
        return True  # joblib.load unpickles whatever the file's extension

    def signature(self) -> ModelSignature:
        return self._signature

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        if self._estimator is None:
            raise RuntimeError("sklearn backend: run() called after close()")
        try:
            features = inputs[INPUT_NAME]
        except KeyError:
            raise InvalidRequest(f"inputs: missing input {INPUT_NAME!r}") from None
        if features.ndim != 2:
            raise InvalidRequest(
                f"inputs.{INPUT_NAME}: expected shape [batch, n_features], "
                f"got {list(features.shape)}"
            )
        features = features.astype(self._input_dtype, copy=False)
        results: dict[str, np.ndarray] = {}
        for name in output_names:
            if name not in (PREDICT, PREDICT_PROBA) or (
                name == PREDICT_PROBA and not self._serves_proba
            ):
                known = ", ".join(spec.name for spec in self._signature.outputs)
                raise InvalidRequest(f"outputs: unknown output {name!r}; expected {known}")
            try:
                if name == PREDICT:
                    results[name] = _as_v2_array(self._estimator.predict(features))
                else:
                    proba = np.asarray(self._estimator.predict_proba(features))
                    results[name] = proba.astype(self._input_dtype, copy=False)
            except ValueError as exc:
                # scikit-learn validates its input with ValueError: features of another
                # count than the estimator was fitted on, NaN or infinity, an unseen
                # category. Those are the request's to fix.
                raise refused(str(exc)) from exc
        return results

    def close(self) -> None:
        self._estimator = None


def _parse_parameters(parameters: Mapping[str, str]) -> np.dtype[np.floating[Any]]:
    unknown = sorted(set(parameters) - set(_KNOWN_PARAMETERS))
    if unknown:
        raise ValueError(
            f"parameters: unknown sklearn backend parameter(s) {', '.join(unknown)}; "
            f"expected {', '.join(_KNOWN_PARAMETERS)}"
        )
    raw = parameters.get("input_dtype", "FP32")
    name = raw.upper().removeprefix("TYPE_")
    try:
        return _INPUT_DTYPES[name]
    except KeyError:
        raise ValueError(f"parameters.input_dtype: expected FP32 or FP64, got {raw!r}") from None


def _probe_signature(
    estimator: Any, n_features: int, input_dtype: np.dtype[np.floating[Any]]
) -> ModelSignature:
    """Run one all-zeros row through the estimator to learn its output types and widths."""
    probe = np.zeros((1, n_features), dtype=input_dtype)
    input_datatype = v2_datatype(input_dtype)
    try:
        predicted = _as_v2_array(estimator.predict(probe))
    except Exception as exc:
        raise ValueError(
            f"the {type(estimator).__name__} failed to predict one all-zeros row of "
            f"{n_features} features ({exc}); the sklearn backend probes its output types "
            "this way, so wrap the estimator to accept such a row"
        ) from exc
    outputs = [
        TensorSpec(PREDICT, v2_datatype(predicted.dtype), (-1, *predicted.shape[1:])),
    ]
    if callable(getattr(estimator, "predict_proba", None)):
        proba = estimator.predict_proba(probe)
        # Multi-output classifiers return a list of arrays, which one tensor cannot hold.
        if isinstance(proba, np.ndarray) and proba.ndim == 2:
            outputs.append(TensorSpec(PREDICT_PROBA, input_datatype, (-1, proba.shape[1])))
        else:
            logger.info(
                "%s.predict_proba returns no 2-D array; not served", type(estimator).__name__
            )
    return ModelSignature(
        inputs=(TensorSpec(INPUT_NAME, input_datatype, (-1, n_features)),),
        outputs=tuple(outputs),
    )


def _as_v2_array(values: Any) -> np.ndarray:
    """predict() output as an array V2 can carry: strings become object arrays of bytes."""
    array = np.asarray(values)
    if array.dtype.kind == "U" or array.dtype.kind == "O":
        encoded = [str(item).encode() for item in array.ravel()]
        return np.array(encoded, dtype=object).reshape(array.shape)
    if array.dtype.kind == "S":
        return array.astype(object)
    return array
