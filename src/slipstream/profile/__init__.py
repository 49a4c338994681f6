"""``slipstream profile``: time a model file in process, batch size by batch size.

>>> from slipstream.profile import profile_model
>>> result = profile_model("model.onnx", batch_sizes=[1, 8])  # doctest: +SKIP
>>> result.best_batch_size, result.best_throughput_infer_per_s  # doctest: +SKIP
"""

from __future__ import annotations

from slipstream.profile.measure import ProfileError, profile_model
from slipstream.profile.results import ProfileResult

__all__ = ["ProfileError", "ProfileResult", "profile_model"]
