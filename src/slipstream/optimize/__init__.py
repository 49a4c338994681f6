"""Model optimization with an accuracy gate (``slipstream optimize``).

Passes transform an ONNX file (``passes``), the gate compares the result with the
original on validation data (``gate``), and ``core.optimize_model`` writes the result as
a new repository version with an ``optimization.json`` record. ``int8-dynamic`` steers
itself with the same gate on calibration rows (``int8_search``: activation smoothing,
then sensitive nodes kept in FP32).
"""

from slipstream.optimize.core import (
    OptimizationResult,
    OptimizeError,
    OptimizeRequest,
    SpeedResult,
    optimize_model,
)
from slipstream.optimize.data import DataError, Dataset, load_dataset
from slipstream.optimize.gate import GateResult
from slipstream.optimize.passes import PassRecord, PassSettings

__all__ = [
    "DataError",
    "Dataset",
    "GateResult",
    "OptimizationResult",
    "OptimizeError",
    "OptimizeRequest",
    "PassRecord",
    "PassSettings",
    "SpeedResult",
    "load_dataset",
    "optimize_model",
]
