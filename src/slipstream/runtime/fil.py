"""The fil backend: gradient-boosted trees (XGBoost, LightGBM) as Triton's FIL backend
serves them, so a Triton FIL model repository serves unchanged.

The model takes one input, ``input__0``, FP32 ``[-1, num_features]`` (a batch of feature
rows; NaN marks a missing value), and answers one output, ``output__0``, FP32:

==================  =============  =========================================================
output_class        predict_proba  output__0 per row
==================  =============  =========================================================
false (regressor)   -              the model's prediction, ``[1]`` (``[targets]`` for
                                   XGBoost's multi-output regression)
true, binary        false          ``[1]``: 1.0 where the positive class's probability is
                                   above ``threshold`` (default 0.5), else 0.0
true, binary        true           ``[2]``: the probabilities of class 0 and class 1; ``[1]``
                                   where the config's dims say ``[ 1 ]``: class 1's only
true, multiclass    false          ``[1]``: the index of the most probable class
true, multiclass    true           ``[num_classes]``: each class's probability
==================  =============  =========================================================

The values are the library's own predictions (``Booster.inplace_predict``,
``lightgbm.Booster.predict``) in FP32: XGBoost's bit for bit, LightGBM's (computed in
double) rounded once to FP32, as FIL serves them. A model with no config, or a config
without ``input`` / ``output``, gets them from the file (feature count, classes),
``max_batch_size`` 32768 as in FIL's documentation, and ``output_class`` from the
training objective.

Parameters (config ``parameters``, Triton FIL's; a key not listed fails the load,
naming it and the known ones):

* ``model_type``: ``xgboost``, ``xgboost_json``, ``xgboost_ubj`` or ``lightgbm``; which
  file (:mod:`slipstream.runtime.fil_files`). Default: read from the file.
* ``output_class`` (``is_classifier``, FIL's name since 25.09): ``true`` for a
  classifier; default: whether the model's objective classifies.
* ``predict_proba``: ``true`` answers probabilities; default ``false``.
* ``threshold``: binary classifiers' decision threshold; default 0.5.
* ``cpu_nthread``: the most threads an instance's runs use (``-1``: the default, the
  usable cores shared out among the model's instances, fewer while the kernel's CPU
  pressure says the cores are crowded). A run of fewer than 128 rows uses one thread
  either way (one per 64 rows above).
* Accepted, checked and ignored, as they tune FIL's GPU kernels or Treelite's parser:
  ``algo``, ``storage_type``, ``threads_per_tree``, ``blocks_per_sm``,
  ``use_experimental_optimizations``, ``transfer_threshold``, ``layout``, ``chunk_size``,
  ``xgboost_allow_unknown_field``. ``device``: ``cpu`` only.

Example repository entry (Triton FIL's own layout)::

    fraud/config.pbtxt         backend: "fil", parameters model_type / output_class ...
    fraud/1/xgboost.json       booster.save_model("xgboost.json")
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from slipstream.errors import InvalidRequest
from slipstream.runtime import fil_files
from slipstream.runtime.base import (
    Backend,
    ModelSignature,
    TensorSpec,
    check_cpu_device,
    usable_cpu_count,
)
from slipstream.runtime.cpu_share import (
    AppliedThreads,
    GovernedThreads,
    ThreadGovernor,
    pressure_source,
)
from slipstream.runtime.fil_forests import Forest, ForestInfo, load_forest

logger = logging.getLogger(__name__)

INPUT_NAME = "input__0"
OUTPUT_NAME = "output__0"
# max_batch_size auto-completed for a tree model: FIL's documented example. A forest runs
# a batch of any size in one call, and batch scoring sends thousands of rows at once.
MAX_BATCH_SIZE = 32768

# Rows each thread of a run gets at least: XGBoost's CPU predictor hands each thread
# blocks of 64 rows, so fewer rows leave a second thread nothing to do but wake up and
# wait at the barrier, which beside busy neighbours costs far more than the rows (one
# row on 2 threads took 4.8 ms here, against 0.3 ms on one; LightGBM alike).
ROWS_PER_THREAD = 64

_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def _boolean(raw: str) -> bool | None:
    return _BOOLEANS.get(raw.strip().lower())


def _whole(least: int) -> Callable[[str], bool]:
    def check(raw: str) -> bool:
        try:
            return int(raw) >= least
        except ValueError:
            return False

    return check


def _one_of(*names: str) -> Callable[[str], bool]:
    return lambda raw: raw.strip().upper() in {name.upper() for name in names}


# Triton FIL's keys that tune its GPU kernels or Treelite's parser: key -> (check, what
# it takes). Checked (a typo fails the load, as in Triton), then ignored.
IGNORED_PARAMETERS: dict[str, tuple[Callable[[str], bool], str]] = {
    "algo": (
        _one_of("ALGO_AUTO", "NAIVE", "TREE_REORG", "BATCH_TREE_REORG"),
        "ALGO_AUTO, NAIVE, TREE_REORG or BATCH_TREE_REORG",
    ),
    "storage_type": (
        _one_of("AUTO", "DENSE", "SPARSE", "SPARSE8"),
        "AUTO, DENSE, SPARSE or SPARSE8",
    ),
    "threads_per_tree": (_whole(1), "a whole number of at least 1"),
    "blocks_per_sm": (_whole(0), "a whole number of at least 0"),
    "use_experimental_optimizations": (lambda raw: _boolean(raw) is not None, '"true" or "false"'),
    "transfer_threshold": (_whole(0), "a whole number of at least 0"),
    "layout": (
        _one_of("depth_first", "breadth_first", "layered"),
        "depth_first, breadth_first or layered",
    ),
    "chunk_size": (_whole(1), "a whole number of at least 1"),
    "xgboost_allow_unknown_field": (lambda raw: _boolean(raw) is not None, '"true" or "false"'),
}
KNOWN_PARAMETERS = (
    "model_type",
    "output_class",
    "is_classifier",
    "predict_proba",
    "threshold",
    "cpu_nthread",
    "device",
)


@dataclass(frozen=True, slots=True)
class FilOptions:
    """The config parameters that change what the fil backend answers."""

    # Serve classes (or their probabilities); None: as the model's objective says.
    output_class: bool | None = None
    # Serve each class's probability instead of a class.
    predict_proba: bool = False
    # A binary classifier's class is 1 where class 1's probability is above this.
    threshold: float = 0.5
    # Threads per instance; None: the usable cores shared out among the instances.
    threads: int | None = None


def parse_options(parameters: Mapping[str, str]) -> FilOptions:
    """The options in config ``parameters`` (model_type is read with the file);
    ValueError names the parameter, its value and what it takes."""
    unknown = sorted(set(parameters) - set(KNOWN_PARAMETERS) - set(IGNORED_PARAMETERS))
    if unknown:
        raise ValueError(
            f"parameters: unknown fil backend parameter(s) {', '.join(unknown)}; expected "
            f"{', '.join(KNOWN_PARAMETERS)}, or one of Triton FIL's GPU keys "
            f"({', '.join(IGNORED_PARAMETERS)})"
        )
    check_cpu_device("fil", parameters)
    ignored = [key for key in IGNORED_PARAMETERS if key in parameters]
    for key in ignored:
        check, takes = IGNORED_PARAMETERS[key]
        if not check(parameters[key]):
            raise ValueError(f"parameters.{key}: {parameters[key]!r}; expected {takes}")
    if ignored:
        logger.info(
            "parameters %s ignored: they tune Triton FIL's GPU kernels, and the trees run "
            "on the CPU here",
            ", ".join(ignored),
        )
    if "output_class" in parameters and "is_classifier" in parameters:
        raise ValueError(
            "parameters: output_class and is_classifier are one setting (is_classifier is "
            "its name since Triton 25.09); give one"
        )
    key = "output_class" if "output_class" in parameters else "is_classifier"
    output_class = _flag(parameters, key) if key in parameters else None
    return FilOptions(
        output_class=output_class,
        predict_proba=bool(_flag(parameters, "predict_proba")),
        threshold=_threshold(parameters.get("threshold", "0.5")),
        threads=_threads(parameters.get("cpu_nthread", "-1")),
    )


def _flag(parameters: Mapping[str, str], key: str) -> bool | None:
    raw = parameters.get(key)
    if raw is None:
        return None
    value = _boolean(raw)
    if value is None:
        raise ValueError(f'parameters.{key}: {raw!r}; expected "true" or "false"')
    return value


def _threshold(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"parameters.threshold: {raw!r}; expected a number such as 0.5")
    return value


def _threads(raw: str) -> int | None:
    if not _whole(-1)(raw):
        raise ValueError(
            f"parameters.cpu_nthread: {raw!r}; expected a whole number of threads (-1: the "
            "usable cores shared out among the instances)"
        )
    return int(raw) if int(raw) > 0 else None


class FilBackend(Backend):
    """One loaded tree model; see the module docstring."""

    name: ClassVar[str] = "fil"
    file_extensions: ClassVar[tuple[str, ...]] = fil_files.EXTENSIONS
    # Both libraries predict in C with the GIL released (ctypes calls); the rest of a
    # run is a copy and, for classes, one vectorised step.
    releases_gil: ClassVar[bool] = True

    def __init__(
        self, forest: Forest, options: FilOptions, classify: bool, threads: AppliedThreads
    ) -> None:
        self._forest: Forest | None = forest
        self._options = options
        self._classify = classify
        self._threads = threads
        self._n_features = forest.info.n_features
        # A binary classifier's probabilities: both classes, or class 1's only where the
        # config's output dims say [1] (set by configure).
        self._both_classes = True
        self._signature = _signature(forest, options, classify)

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> FilBackend:
        options = parse_options(parameters)
        data = path.read_bytes()
        if not data:
            raise ValueError(f"{path.name}: the file is empty; save the model again")
        model_type = fil_files.model_type(parameters, data)
        threads = _thread_count(options, instance_count)
        try:
            forest = load_forest(model_type, data, threads.threads, options.predict_proba)
        except ValueError as exc:
            raise ValueError(f"{path.name} (model_type {model_type}): {exc}") from None
        info = forest.info
        classify = info.classifier if options.output_class is None else options.output_class
        if classify and info.n_targets > 1:
            forest.close()
            raise ValueError(
                f"parameters.output_class: true, but {path.name} is a regressor of "
                f"{info.n_targets} targets; set output_class to false"
            )
        if options.predict_proba and not classify:
            logger.warning(
                "%s: predict_proba is true but output_class is false (objective %s): the "
                "model's predictions are served; set output_class true for probabilities",
                path.name,
                info.objective,
            )
        return cls(forest, options, classify, threads)

    def signature(self) -> ModelSignature:
        return self._signature

    @property
    def cpu_threads(self) -> int | None:
        return self._threads.threads

    def configure(self, config: dict[str, Any]) -> None:
        for tensor in config.get("output", []):
            if tensor.get("name") == OUTPUT_NAME:
                # The class dim is the last (a config without batching lists the batch).
                self._both_classes = [int(d) for d in tensor.get("dims", [])][-1:] != [1]

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        forest = self._forest
        if forest is None:
            raise RuntimeError("fil backend: run() called after close()")
        for name in output_names:
            if name != OUTPUT_NAME:
                raise InvalidRequest(f"outputs: unknown output {name!r}; expected {OUTPUT_NAME}")
        rows = inputs.get(INPUT_NAME)
        if rows is None:
            raise InvalidRequest(f"inputs: missing input {INPUT_NAME!r}")
        if rows.ndim != 2 or rows.shape[1] != self._n_features:
            raise InvalidRequest(
                f"input {INPUT_NAME!r}: shape {list(rows.shape)}; the model takes "
                f"[batch, {self._n_features}] ({self._n_features} features a row)"
            )
        self._threads.before()
        try:
            forest.use_threads(max(1, min(self._threads.threads, len(rows) // ROWS_PER_THREAD)))
            scores = forest.predict(np.ascontiguousarray(rows, dtype=np.float32))
        finally:
            self._threads.after()
        return {OUTPUT_NAME: self._finish(forest.info, scores)}

    def _finish(self, info: ForestInfo, scores: np.ndarray) -> np.ndarray:
        """``output__0`` from the library's predictions, as FIL computes it."""
        batch = scores.shape[0]
        if not self._classify or info.labels:
            return scores.reshape(batch, -1)  # values, or multi:softmax's class ids
        if info.n_classes > 1:
            probabilities = scores.reshape(batch, -1)  # [B, classes]
            if self._options.predict_proba:
                return probabilities
            # The first most probable class, as np.argmax and FIL both pick.
            best: np.ndarray = np.argmax(probabilities, axis=1)
            return best.astype(np.float32).reshape(batch, 1)
        positive = scores.reshape(batch, 1)  # [B, 1]: class 1's probability
        if not self._options.predict_proba:
            return (positive > np.float32(self._options.threshold)).astype(np.float32)
        if not self._both_classes:
            return positive
        both = np.empty((batch, 2), dtype=np.float32)
        both[:, 0:1] = np.float32(1.0) - positive
        both[:, 1:2] = positive
        return both

    def close(self) -> None:
        if self._forest is not None:
            self._forest.close()
        self._forest = None


def _thread_count(options: FilOptions, instance_count: int) -> AppliedThreads:
    """The most threads an instance's runs use: ``cpu_nthread`` where given; else the
    usable cores shared out among the instances, fewer while the kernel's CPU pressure
    (PSI) says the cores are crowded, as the torch backend does (see
    :mod:`slipstream.runtime.cpu_share`)."""

    def keep(threads: int) -> None:  # each run passes its count to the library
        pass

    if options.threads is not None:
        return AppliedThreads(options.threads, keep)
    most = max(1, usable_cpu_count() // max(1, instance_count))
    stalled_us = pressure_source() if most > 1 else None
    if stalled_us is None:
        return AppliedThreads(most, keep)
    return GovernedThreads(ThreadGovernor(most, stalled_us), keep)


def _signature(forest: Forest, options: FilOptions, classify: bool) -> ModelSignature:
    info = forest.info
    if not classify or info.labels:
        width = info.width
    elif not options.predict_proba:
        width = 1
    elif info.n_classes > 1:
        width = info.n_classes
    else:
        # A binary classifier's probabilities: [2] by default, [1] (class 1's) where the
        # config says so, as Triton FIL takes either.
        width = -1
    return ModelSignature(
        inputs=(TensorSpec(INPUT_NAME, "FP32", (-1, info.n_features)),),
        outputs=(TensorSpec(OUTPUT_NAME, "FP32", (-1, width)),),
        max_batch_size=MAX_BATCH_SIZE,
    )
