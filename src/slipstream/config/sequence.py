"""``sequence_batching:`` in a model's config (Triton's): a stateful model.

The requests of one sequence carry its correlation id (request parameter
``sequence_id``) and say where they stand in it (``sequence_start`` on the first,
``sequence_end`` on the last). They run in order, one at a time; requests of different
sequences batch together (Triton's ``oldest`` strategy; ``direct`` is served the same
way, as no model here keeps state per batch slot). The model gets, beside the client's
inputs:

- control inputs (``control_input``): START, END, READY as the two values of
  ``fp32_false_true`` / ``int32_false_true`` / ``bool_false_true``; CORRID as the
  ``data_type`` it names;
- implicit state (``state``): the model's ``output_name`` of one request is its
  ``input_name`` on the next request of the sequence, zeros on the first.

Keys and values are Triton's, so a ``config.pbtxt`` translates one for one::

    sequence_batching:
      max_sequence_idle_microseconds: 5000000
      control_input:
        - name: START
          control: [{kind: CONTROL_SEQUENCE_START, fp32_false_true: [0, 1]}]
      state:
        - {input_name: STATE_IN, output_name: STATE_OUT, data_type: TYPE_FP32, dims: [4]}
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Strict as _Strict
from slipstream.config.reshape import dims_problem
from slipstream.datatypes import V2_TO_NUMPY, from_config_datatype

ControlKind = Literal[
    "CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_END",
    "CONTROL_SEQUENCE_CORRID",
]  # fmt: skip


class Control(_Strict):
    """What one control input holds: a flag's false and true values, or the id."""

    kind: ControlKind
    int32_false_true: list[int] = Field(default_factory=list)
    fp32_false_true: list[float] = Field(default_factory=list)
    bool_false_true: list[bool] = Field(default_factory=list)
    data_type: str = ""

    @field_validator("data_type")
    @classmethod
    def _normalise_datatype(cls, value: str) -> str:
        return from_config_datatype(value) if value else value

    @model_validator(mode="after")
    def _one_form(self) -> Control:
        pairs = [
            p for p in (self.int32_false_true, self.fp32_false_true, self.bool_false_true) if p
        ]
        if self.kind == "CONTROL_SEQUENCE_CORRID":
            if pairs or self.data_type not in ("UINT64", "INT64", "UINT32", "INT32", "BYTES"):
                raise ValueError(
                    "CONTROL_SEQUENCE_CORRID takes data_type TYPE_UINT64, TYPE_INT64, "
                    "TYPE_UINT32, TYPE_INT32 or TYPE_STRING, and no false/true values"
                )
        elif len(pairs) != 1 or len(pairs[0]) != 2 or self.data_type:
            raise ValueError(
                f"{self.kind} takes one of int32_false_true, fp32_false_true or "
                "bool_false_true, with two values: false, then true"
            )
        return self

    def value(self, flag: bool) -> tuple[Any, str]:
        """The value this control holds for ``flag`` and its V2 datatype."""
        if self.int32_false_true:
            return self.int32_false_true[flag], "INT32"
        if self.fp32_false_true:
            return self.fp32_false_true[flag], "FP32"
        return self.bool_false_true[flag], "BOOL"

    def flag_array(self, shape: list[int], start: bool, end: bool) -> np.ndarray:
        """A START / END / READY control's input for a request that starts (``start``) or
        ends (``end``) its sequence (READY is always true), shaped ``shape``."""
        flag = {"CONTROL_SEQUENCE_START": start, "CONTROL_SEQUENCE_END": end}.get(self.kind, True)
        value, datatype = self.value(flag)
        return np.full(shape, value, dtype=V2_TO_NUMPY[datatype])


class ControlInput(_Strict):
    name: str = Field(min_length=1)
    control: list[Control] = Field(min_length=1, max_length=1)


class InitialState(_Strict):
    data_type: str = ""
    dims: list[int] = Field(default_factory=list)
    # The one initial state served (a data_file is refused): zeros.
    zero_data: Literal[True] = True
    name: str = ""

    @field_validator("data_type")
    @classmethod
    def _normalise_datatype(cls, value: str) -> str:
        return from_config_datatype(value) if value else value


class StateConfig(_Strict):
    """One implicit state: ``output_name`` of a request feeds ``input_name`` of the next."""

    input_name: str = Field(min_length=1)
    output_name: str = Field(min_length=1)
    data_type: str
    dims: list[int] = Field(min_length=0)
    initial_state: list[InitialState] = Field(default_factory=list, max_length=1)
    # Triton's memory hints: nothing to do here.
    use_same_buffer_for_input_output: bool = False
    use_growable_memory: bool = False

    @field_validator("data_type")
    @classmethod
    def _normalise_datatype(cls, value: str) -> str:
        return from_config_datatype(value)

    @field_validator("dims")
    @classmethod
    def _check_dims(cls, dims: list[int]) -> list[int]:
        if (problem := dims_problem(dims)) is not None:
            raise ValueError(problem)
        return dims

    def initial_dims(self) -> list[int]:
        """The first request's state shape (batch dim excluded)."""
        if self.initial_state and self.initial_state[0].dims:
            return self.initial_state[0].dims
        if -1 in self.dims:
            raise ValueError(
                f"state {self.input_name!r}: dims {self.dims} are variable; give "
                "initial_state {dims} for the first request of a sequence"
            )
        return self.dims


class SequenceStrategy(_Strict):
    """``direct`` or ``oldest``: both batch the sequences' requests as they come."""

    max_candidate_sequences: int = Field(0, ge=0)
    preferred_batch_size: list[int] = Field(default_factory=list)
    max_queue_delay_microseconds: int = Field(0, ge=0)
    preserve_ordering: bool = False
    minimum_slot_utilization: float = 0.0


class SequenceBatching(_Strict):
    max_sequence_idle_microseconds: int = Field(
        1_000_000,
        ge=1,
        description="a sequence without a request for this long is ended and its state freed",
    )
    control_input: list[ControlInput] = Field(default_factory=list)
    state: list[StateConfig] = Field(default_factory=list)
    direct: SequenceStrategy | None = None
    oldest: SequenceStrategy | None = None

    @model_validator(mode="after")
    def _check(self) -> SequenceBatching:
        if self.direct is not None and self.oldest is not None:
            raise ValueError("set one of direct and oldest")
        for state in self.state:
            state.initial_dims()
        return self

    def model_inputs(self) -> list[str]:
        """The inputs the server gives the model: controls and states."""
        return [c.name for c in self.control_input] + [s.input_name for s in self.state]

    def model_outputs(self) -> list[str]:
        return [s.output_name for s in self.state]


def check_sequence_tensors(
    sequences: SequenceBatching, inputs: list[Any], outputs: list[Any]
) -> None:
    """ValueError when a control or state is also listed as a client's input or output:
    the server gives the model those, never the client."""
    clients = {tensor.name for tensor in inputs}
    for name in sequences.model_inputs():
        if name in clients:
            raise ValueError(
                f"sequence_batching: {name!r} is given by the server (a control or a state); "
                "remove it from input"
            )
    answered = {tensor.name for tensor in outputs}
    for name in sequences.model_outputs():
        if name in answered:
            raise ValueError(
                f"sequence_batching: state output {name!r} is kept by the server; remove it "
                "from output"
            )
