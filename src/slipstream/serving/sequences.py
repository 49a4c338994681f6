"""The live sequences of a stateful model (see :mod:`slipstream.config.sequence`).

Each request names its sequence (``sequence_id``: a non-zero integer or a non-empty
string) and flags its first and last (``sequence_start``, ``sequence_end``), as
tritonclient's ``infer(..., sequence_id=, sequence_start=, sequence_end=)`` sends them.
The requests of one sequence run one at a time, in the order they arrived; each gets the
control inputs that say where it stands and the state its predecessor left, and leaves
its own. A sequence ends with its END request, a new START for its id, or after
``max_sequence_idle_microseconds`` without a request (its state is freed; a later request
without START is refused, as Triton refuses it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slipstream.config.sequence import SequenceBatching
from slipstream.datatypes import V2_TO_NUMPY
from slipstream.errors import InvalidRequest
from slipstream.types import InferRequest

# What runs a sequence's request: its inputs (the client's, the controls, the states) and
# its batch key -> every output, the states' included.
Submit = Callable[[dict[str, np.ndarray], tuple[Any, ...]], Awaitable[dict[str, np.ndarray]]]


@dataclass(slots=True)
class _Sequence:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Each state input's value for the next request (None: the first, zeros).
    state: dict[str, np.ndarray] | None = None
    last_used: float = field(default_factory=time.monotonic)


class Sequences:
    """A stateful model version's live sequences and what its requests are given."""

    def __init__(self, model: str, config: SequenceBatching, batching: bool) -> None:
        self._model = model
        self._config = config
        self._batching = batching
        self._idle_s = config.max_sequence_idle_microseconds / 1e6
        self._live: dict[int | str, _Sequence] = {}

    def __len__(self) -> int:
        return len(self._live)

    async def run(
        self, request: InferRequest, inputs: dict[str, np.ndarray], rows: int, submit: Submit
    ) -> dict[str, np.ndarray]:
        key, start, end = self._flags(request)
        now = time.monotonic()
        self._forget_idle(now)
        sequence = self._live.get(key)
        if start or sequence is None:
            if not start:
                raise InvalidRequest(
                    f"inference request for sequence {key!r} to model {self._model!r} must "
                    "set sequence_start on the first request of the sequence (it has none "
                    "running: never started, ended, or idle past max_sequence_idle_microseconds)"
                )
            sequence = self._live[key] = _Sequence()  # a START restarts an id in use
        sequence.last_used = now
        async with sequence.lock:
            given = dict(inputs)
            given.update(self._controls(key, rows, start, end))
            given.update(self._states(sequence, rows))
            shapes = tuple((name, given[name].shape[1:]) for name in self._config.model_inputs())
            try:
                outputs = await submit(given, shapes)
            finally:
                sequence.last_used = time.monotonic()
            sequence.state = {
                s.input_name: np.array(outputs[s.output_name]) for s in self._config.state
            }
        if end and self._live.get(key) is sequence:
            del self._live[key]
        return outputs

    def warmup_inputs(self, rows: int) -> dict[str, np.ndarray]:
        """The controls and states of a sequence's first and only request."""
        return {
            **self._controls(1, rows, start=True, end=True),
            **self._states(_Sequence(), rows),
        }

    def _flags(self, request: InferRequest) -> tuple[int | str, bool, bool]:
        parameters = request.parameters
        key = parameters.get("sequence_id", 0)
        if isinstance(key, bool) or not isinstance(key, int | str) or key in (0, ""):
            raise InvalidRequest(
                f"parameters.sequence_id: model {self._model!r} is stateful; each request "
                "names its sequence with a non-zero integer or a non-empty string, got "
                f"{key!r}"
            )
        flags = []
        for name in ("sequence_start", "sequence_end"):
            value = parameters.get(name, False)
            if not isinstance(value, bool):
                raise InvalidRequest(f"parameters.{name}: expected true or false, got {value!r}")
            flags.append(value)
        return key, flags[0], flags[1]

    def _forget_idle(self, now: float) -> None:
        idle = [
            key
            for key, sequence in self._live.items()
            if now - sequence.last_used > self._idle_s and not sequence.lock.locked()
        ]
        for key in idle:
            del self._live[key]

    def _controls(self, key: int | str, rows: int, start: bool, end: bool) -> dict[str, np.ndarray]:
        shape = [rows, 1] if self._batching else [1]
        made = {}
        for control_input in self._config.control_input:
            (control,) = control_input.control
            if control.kind == "CONTROL_SEQUENCE_CORRID":
                dtype = V2_TO_NUMPY[control.data_type]
                if dtype == np.object_:
                    value: Any = str(key).encode()
                elif isinstance(key, str):
                    raise InvalidRequest(
                        f"parameters.sequence_id: model {self._model!r} takes integer "
                        f"sequence ids (its CORRID control is {control.data_type}), got {key!r}"
                    )
                else:
                    value = key
                made[control_input.name] = np.full(shape, value, dtype=dtype)
                continue
            made[control_input.name] = control.flag_array(shape, start, end)
        return made

    def _states(self, sequence: _Sequence, rows: int) -> dict[str, np.ndarray]:
        made = {}
        for state in self._config.state:
            if sequence.state is None:
                dims = state.initial_dims()
                shape = [rows, *dims] if self._batching else dims
                made[state.input_name] = np.zeros(shape, dtype=V2_TO_NUMPY[state.data_type])
                continue
            value = sequence.state[state.input_name]
            if self._batching and value.shape[0] != rows:
                raise InvalidRequest(
                    f"sequence request of {rows} rows, but its sequence's state has "
                    f"{value.shape[0]}: every request of a sequence has as many rows"
                )
            made[state.input_name] = value
        return made
