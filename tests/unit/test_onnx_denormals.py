"""Loading an ONNX model leaves the caller's thread computing with denormal floats.

ONNX Runtime switches flush-to-zero on for the thread that creates a session with
``denormal_as_zero`` (Slipstream's default, for fast masked softmaxes). That thread is
the server's loader thread, or the user's own in ``slipstream profile`` and tests; tiny
floats in its later numpy work must not turn into zeros.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slipstream.runtime.onnx import OnnxBackend
from tests.models import build_identity

TINY = np.float32(1e-40)  # a denormal float32


def test_loading_a_model_keeps_the_callers_denormals(tmp_path: Path) -> None:
    assert TINY * np.float32(1.0) != 0  # the thread computes with denormals to begin with
    path = build_identity(tmp_path, "FP32")
    backend = OnnxBackend.load(path, {"denormal_as_zero": "1"}, 1)
    x = np.full((1, 3), TINY, np.float32)
    # The model itself flushes (its threads are meant to); the caller's thread does not.
    backend.run({"INPUT0": x}, ["OUTPUT0"])
    assert TINY * np.float32(1.0) != 0
    assert float(np.array([1e-40]).astype(np.float32)[0]) != 0.0
