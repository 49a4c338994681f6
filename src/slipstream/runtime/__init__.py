"""Backends that execute a model: ONNX Runtime (default), torch, scikit-learn, OpenVINO,
Python (Triton's model.py), fil (XGBoost and LightGBM trees, as Triton's FIL backend)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path

from slipstream.runtime import fil_files
from slipstream.runtime.base import Backend, BackendUnavailable

# backend name -> (module, class, pip extra that provides its dependency)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "onnxruntime": ("slipstream.runtime.onnx", "OnnxBackend", ""),
    "torch": ("slipstream.runtime.torch", "TorchBackend", "torch"),
    "sklearn": ("slipstream.runtime.sklearn", "SklearnBackend", "sklearn"),
    "openvino": ("slipstream.runtime.openvino", "OpenVinoBackend", "openvino"),
    # Triton's Python backend: a model.py (code the server runs; trust_pickle opts in).
    "python": ("slipstream.runtime.python_model", "PythonBackend", ""),
    # Triton's FIL backend's models: XGBoost and LightGBM files, run by their libraries.
    "fil": ("slipstream.runtime.fil", "FilBackend", "trees"),
}

# model file extension -> default backend name
_BY_EXTENSION: dict[str, str] = {
    ".onnx": "onnxruntime",
    # ONNX Runtime's own format (``slipstream export --target mobile`` writes it).
    ".ort": "onnxruntime",
    ".pt": "torch",
    ".pt2": "torch",
    ".joblib": "sklearn",
    ".pkl": "sklearn",
    # OpenVINO IR: model.xml, its weights in model.bin beside it.
    ".xml": "openvino",
    ".py": "python",
    # XGBoost's JSON and UBJSON, LightGBM's text (model.json, model.ubj, model.txt).
    **{extension: "fil" for extension in fil_files.EXTENSIONS},
}

BACKEND_NAMES = tuple(_BACKENDS)
MODEL_EXTENSIONS = tuple(_BY_EXTENSION)


def backend_for_file(path: Path) -> str:
    """Default backend name for a model file, by extension."""
    try:
        return _BY_EXTENSION[path.suffix.lower()]
    except KeyError:
        known = ", ".join(_BY_EXTENSION)
        raise ValueError(f"{path.name}: unknown model file type; expected one of {known}") from None


def model_files(path: Path) -> list[Path]:
    """The files a model file needs to load: itself, and for OpenVINO IR its weights.

    >>> [p.name for p in model_files(Path("1/model.xml"))]
    ['model.xml', 'model.bin']
    """
    if path.suffix.lower() == ".xml":
        return [path, path.with_suffix(".bin")]
    return [path]


def own_model_file(version_dir: Path, backend: str, parameters: Mapping[str, str]) -> Path | None:
    """The model file a backend finds by names of its own, where it has them: Triton FIL's
    ``xgboost.json``, ``model.txt``, ... by ``parameters.model_type``. None where the
    backend has none (the repository then looks for ``model.<ext>``); ConfigError where
    the backend's file is missing."""
    if backend == "fil":
        return fil_files.own_model_file(version_dir, parameters)
    return None


def register_backend(name: str, module: str, class_name: str) -> None:
    """Make ``backend: <name>`` in config.yaml load ``module.class_name`` (a Backend).

    For backends that live outside Slipstream: call it before the server loads its
    repository, e.g. in a launcher that then runs ``slipstream.cli.main()``. A model picks
    such a backend by name in its config.yaml (with ``default_model_filename`` when its file
    has no known extension); nothing is chosen by file type.
    """
    if name in _BACKENDS:
        raise ValueError(f"backend {name!r} is already registered")
    _BACKENDS[name] = (module, class_name, "")
    _REGISTERED[name] = (module, class_name)


# The backends added by register_backend: what a spawned engine process registers again
# (``slipstream serve --frontends N`` runs the models in a fresh interpreter).
_REGISTERED: dict[str, tuple[str, str]] = {}


def registered_backends() -> dict[str, tuple[str, str]]:
    """name -> (module, class name) of every backend added with register_backend."""
    return dict(_REGISTERED)


def get_backend(name: str) -> type[Backend]:
    """The Backend class for ``name``; BackendUnavailable names the extra to install."""
    try:
        module_name, class_name, extra = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend: unknown backend {name!r}; expected one of {', '.join(_BACKENDS)}"
        ) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(
            f"backend {name!r} needs an optional dependency ({exc.name} is missing): "
            f"pip install 'slipstream[{extra}]'"
        ) from None
    backend: type[Backend] = getattr(module, class_name)
    return backend
