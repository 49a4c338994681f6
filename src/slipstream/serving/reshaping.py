"""A model instance whose tensors have a ``reshape`` (see :mod:`slipstream.config.reshape`):
inputs go to the model in its own shape, outputs come back in the shape clients see.

The batcher, the request checks and the metadata know the ``dims`` only; the model file
knows the ``reshape`` only. A reshape is a view: nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from slipstream.config import ModelConfig
from slipstream.config.reshape import convert
from slipstream.runtime.base import Backend, ModelSignature


def reshaping(instances: list[Backend], config: ModelConfig) -> list[Backend]:
    """``instances`` as they are when no tensor of ``config`` has a reshape; else each
    wrapped in a :class:`ReshapingInstance`."""
    if all(t.reshape is None for t in (*config.input, *config.output)):
        return instances
    return [ReshapingInstance(instance, config) for instance in instances]


class ReshapingInstance(Backend):
    """One loaded instance, its tensors reshaped on the way in and out."""

    name = "reshape"

    def __init__(self, inner: Backend, config: ModelConfig) -> None:
        self._inner = inner
        self._lead = 1 if config.max_batch_size else 0
        # name -> (dims clients see, the model's shape)
        self._inputs = {t.name: (t.dims, t.reshape) for t in config.input if t.reshape is not None}
        self._outputs = {
            t.name: (t.dims, t.reshape) for t in config.output if t.reshape is not None
        }

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        raise TypeError("a ReshapingInstance wraps a loaded instance; it loads no file")

    def signature(self) -> ModelSignature:
        return self._inner.signature()

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        lead = self._lead
        given = dict(inputs)
        for name, (dims, shape) in self._inputs.items():
            array = given.get(name)
            if array is not None:
                target = convert(array.shape[lead:], dims, shape)
                given[name] = array.reshape(array.shape[:lead] + target)
        outputs = self._inner.run(given, output_names)
        for name, (dims, shape) in self._outputs.items():
            array = outputs.get(name)
            if array is None:
                continue
            try:
                target = convert(array.shape[lead:], shape, dims)
            except ValueError:
                raise ValueError(
                    f"output {name!r}: the model produced shape {list(array.shape)}, which "
                    f"does not fit its reshape {shape}" + (" (after the batch dim)" if lead else "")
                ) from None
            outputs[name] = array.reshape(array.shape[:lead] + target)
        return outputs

    def close(self) -> None:
        self._inner.close()

    @property
    def cpu_threads(self) -> int | None:
        return self._inner.cpu_threads
