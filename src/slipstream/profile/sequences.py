"""A stateful model's runs in ``slipstream profile``: sequences, as the server runs them.

The server gives a stateful model (``sequence_batching``) its control inputs and its
implicit state beside the client's inputs (:mod:`slipstream.serving.sequences`); a model
fed random controls and no state would be timed on runs the server never makes. Here a
batch of B rows is B sequences side by side, one a row, each ``length`` runs long:
START on the first run (its state zeros), END on the last, READY on every run, CORRID
each row's own id, and each run's state outputs are the next run's state inputs. After
a sequence's last run B new ones start. A backend that takes requests (a Python model)
gets B one-row requests, each with its sequence's id and flags, as the server hands
them. The timed run includes passing the state on, as the server's does.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from slipstream.config.sequence import SequenceBatching
from slipstream.datatypes import V2_TO_NUMPY
from slipstream.profile.loading import Run, batch_run, raise_failure
from slipstream.runtime.base import Backend, RequestContext

logger = logging.getLogger(__name__)


class Measured(Protocol):
    """What :func:`timed_run` reads of the model being profiled."""

    @property
    def output_names(self) -> list[str]: ...

    @property
    def batching(self) -> bool: ...

    @property
    def sequences(self) -> SequenceBatching | None: ...


def timed_run(
    model: Backend,
    feed: dict[str, np.ndarray],
    measured: Measured,
    sequence: tuple[int, Iterator[int]],
) -> tuple[Run, Callable[[], None]]:
    """One timed run of ``feed`` (for a stateful model, a step of its sequences: their
    length and where their ids come from), and what to call once the batch size is
    timed (a stateful model's sequences cut short are ended)."""
    if measured.sequences is None:
        return batch_run(model, feed, measured.output_names, measured.batching), _nothing
    length, ids = sequence
    inputs = SequenceInputs(measured.sequences, feed, measured.batching, ids)
    runs = SequenceRuns(inputs, model, measured.output_names, length)

    def finish() -> None:
        try:
            runs.finish()
        except Exception:  # the timed runs met it already, and reported it
            logger.debug("ending the sequences failed", exc_info=True)

    return runs.run, finish


def _nothing() -> None:
    pass


class SequenceInputs:
    """A batch's inputs with its sequences' controls and states, one sequence a row."""

    def __init__(
        self,
        config: SequenceBatching,
        inputs: dict[str, np.ndarray],
        batching: bool,
        ids: Iterator[int] | None = None,
    ) -> None:
        self.config = config
        self.batching = batching
        self._inputs = inputs
        self.rows = len(next(iter(inputs.values()))) if batching and inputs else 1
        # Where ids come from (shared by a profile's batch sizes: never one twice), and
        # the current sequences' ids, one a row.
        self._id_source = ids if ids is not None else itertools.count(1)
        self.ids = self.next_ids()

    def first_run(self) -> dict[str, np.ndarray]:
        """Every input of a sequence's first run (controls and zero states included)."""
        return self.given(True, False, None)

    def given(
        self, start: bool, end: bool, state: dict[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """The run's inputs: ``state`` is the last run's state outputs (None: zeros)."""
        return {**self._inputs, **self._controls(start, end), **(state or self._zero_states())}

    def next_ids(self) -> list[int]:
        self.ids = list(itertools.islice(self._id_source, self.rows))
        return self.ids

    def _controls(self, start: bool, end: bool) -> dict[str, np.ndarray]:
        shape = [self.rows, 1] if self.batching else [1]
        made = {}
        for control_input in self.config.control_input:
            (control,) = control_input.control
            if control.kind == "CONTROL_SEQUENCE_CORRID":
                dtype = V2_TO_NUMPY[control.data_type]
                ids: list[Any] = self.ids
                if dtype == np.object_:
                    ids = [str(i).encode() for i in ids]
                made[control_input.name] = np.array(ids, dtype=dtype).reshape(shape)
                continue
            made[control_input.name] = control.flag_array(shape, start, end)
        return made

    def _zero_states(self) -> dict[str, np.ndarray]:
        made = {}
        for state in self.config.state:
            dims = state.initial_dims()
            shape = [self.rows, *dims] if self.batching else dims
            made[state.input_name] = np.zeros(shape, dtype=V2_TO_NUMPY[state.data_type])
        return made


class SequenceRuns:
    """The runs of one batch size of a stateful model; call :meth:`run` once per run."""

    def __init__(
        self, inputs: SequenceInputs, model: Backend, output_names: list[str], length: int
    ) -> None:
        self._inputs = inputs
        self._model = model
        self._output_names = output_names
        self._length = length
        # Runs done in the current sequences.
        self._step = 0
        # Each state input's value for the next run; None: the first run (zeros).
        self._state: dict[str, np.ndarray] | None = None

    def run(self) -> object:
        return self._run(self._step + 1 >= self._length)

    def finish(self) -> None:
        """End the sequences the timed runs cut short: one more run, with END (untimed),
        so a model keeping its own state per sequence sees each one end."""
        if self._step > 0:
            self._run(end=True)

    def _run(self, end: bool) -> object:
        start = self._step == 0
        given = self._inputs.given(start, end, self._state)
        if self._model.takes_requests:
            outputs = self._run_requests(given, start, end)
        else:
            outputs = self._model.run(given, self._output_names)
        states = self._inputs.config.state
        self._state = {s.input_name: outputs[s.output_name] for s in states} or None
        self._step += 1
        if end:
            self._step, self._state = 0, None
            self._inputs.next_ids()
        return outputs

    def _run_requests(
        self, given: dict[str, np.ndarray], start: bool, end: bool
    ) -> dict[str, np.ndarray]:
        """The run as one-row requests, each with its sequence's id and flags; the
        outputs joined again along the batch dim."""
        ids = self._inputs.ids

        def context(row: int) -> RequestContext:
            return RequestContext(correlation_id=ids[row], sequence_start=start, sequence_end=end)

        if not self._inputs.batching:
            requests = [(given, context(0))]
        else:
            requests = [
                ({name: array[row : row + 1] for name, array in given.items()}, context(row))
                for row in range(self._inputs.rows)
            ]
        answered = raise_failure(self._model.run_requests(requests, self._output_names))
        if not self._inputs.batching:
            return answered[0]
        return {name: np.concatenate([a[name] for a in answered]) for name in answered[0]}
