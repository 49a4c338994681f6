"""Response taps: what watches served requests off the hot path (drift monitoring).

The serving core offers each successful request's inputs and outputs to its version's
tap after the response is ready; a tap must return at once (queue, never compute) and
never raise. Taps are made per version by a factory the process runner passes in, so
the serving core knows only this contract, not the monitor behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from slipstream.config import ModelConfig


class ResponseTap(Protocol):
    def offer(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """Take one served request's tensors; O(1), never blocks, never raises."""

    def close(self) -> None:
        """The version is unloaded: stop and free what the tap holds."""


# (model, version, its completed config, its version directory) -> a tap, or None.
TapFactory = Callable[[str, str, ModelConfig, Path], ResponseTap | None]
