"""Which file a tree model (``backend: fil``) is, and which format it holds, as Triton's
FIL backend names them.

Triton's FIL backend picks a version directory's file by ``parameters.model_type``:

=================  ==============  ==================================================
model_type         file            written by
=================  ==============  ==================================================
``xgboost``        xgboost.model   ``booster.save_model("xgboost.model")`` (XGBoost's
                                   legacy binary format before 2.1; UBJSON since)
``xgboost_json``   xgboost.json    ``booster.save_model("xgboost.json")``
``xgboost_ubj``    xgboost.ubj     ``booster.save_model("xgboost.ubj")``
``lightgbm``       model.txt       ``booster.save_model("model.txt")``
=================  ==============  ==================================================

``default_model_filename`` names another file, and a ``model.json``, ``model.ubj`` or
``model.txt`` needs no config at all. Without ``model_type`` the format is read from the
file itself (LightGBM's text starts with ``tree``; anything else is XGBoost's, whose
loader tells its three formats apart). Treelite checkpoints and pickles are refused with
the way to export the model instead.

Nothing here imports a tree library: the repository asks for file names before a
backend loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from slipstream.config import ConfigError

# model_type -> Triton FIL's default file name for it.
FILE_NAMES: dict[str, str] = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
}
XGBOOST_TYPES = ("xgboost", "xgboost_json", "xgboost_ubj")
# Model types Triton's FIL backend reads that are not served here, and what to do instead.
REFUSED_TYPES: dict[str, str] = {
    "treelite_checkpoint": (
        "Treelite checkpoints are not served here; save the model from the library that "
        "trained it (XGBoost: booster.save_model('xgboost.json'), LightGBM: "
        "booster.save_model('model.txt')), or convert a scikit-learn forest to ONNX "
        "(skl2onnx) and serve model.onnx"
    ),
}
# A model_type some Triton FIL configs carry for pickled scikit-learn or cuML forests.
for _pickled in ("sklearn", "cuml", "pickle"):
    REFUSED_TYPES[_pickled] = (
        "pickled forests are not read by the fil backend; serve a scikit-learn pickle with "
        "backend: sklearn (trust_pickle: true), or convert it to ONNX (skl2onnx)"
    )
# File extensions that mean a tree model when a model has no config (model.<ext>).
EXTENSIONS = (".json", ".ubj", ".txt")
# LightGBM's text format starts with this line ("tree", then the version line).
_LIGHTGBM_MAGIC = b"tree"


def model_type(parameters: Mapping[str, str], data: bytes) -> str:
    """``parameters.model_type`` checked, or the format of the file's bytes ``data``
    where the config gives none; ValueError names the value and the ones taken."""
    given = parameters.get("model_type")
    if given is None:
        return "lightgbm" if data.startswith(_LIGHTGBM_MAGIC) else "xgboost"
    name = given.strip().lower()
    if name in REFUSED_TYPES:
        raise ValueError(f"parameters.model_type: {given!r}: {REFUSED_TYPES[name]}")
    if name not in FILE_NAMES:
        raise ValueError(
            f"parameters.model_type: {given!r}; expected one of {', '.join(FILE_NAMES)}"
        )
    return name


def own_model_file(version_dir: Path, parameters: Mapping[str, str]) -> Path | None:
    """A fil model's file in ``version_dir`` by Triton FIL's names: the one its
    ``model_type`` names, or with no model_type the one of them present. None where a
    ``model.json``, ``model.ubj`` or ``model.txt`` is there instead (the repository
    takes that); ConfigError naming the expected file where there is neither."""
    given = parameters.get("model_type", "").strip().lower()
    if given in REFUSED_TYPES:
        raise ConfigError(f"parameters.model_type: {given!r}: {REFUSED_TYPES[given]}")
    names = [FILE_NAMES[given]] if given in FILE_NAMES else list(FILE_NAMES.values())
    present = [version_dir / name for name in names if (version_dir / name).is_file()]
    if len(present) > 1:
        listed = ", ".join(path.name for path in present)
        raise ConfigError(
            f"{version_dir}: several tree model files ({listed}); set parameters.model_type "
            "or default_model_filename to pick one"
        )
    if present:
        return present[0]
    if any((version_dir / f"model{ext}").is_file() for ext in EXTENSIONS):
        return None
    wanted = f"{names[0]} (model_type {given})" if given in FILE_NAMES else " or ".join(names)
    raise ConfigError(
        f"{version_dir}: no tree model file; expected {wanted}, as Triton's FIL backend "
        "names them, or set default_model_filename to the file's name"
    )
