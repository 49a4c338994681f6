"""``ensemble:`` in a model's config.yaml (Triton's ``ensemble_scheduling``): a model
whose steps run other models of the repository, tensors passed between them by name.

The ensemble declares its own ``input`` and ``output`` (and ``max_batch_size``) as any
model does. Each step maps the names of its model's inputs to the ensemble's tensors it
takes (the ensemble's inputs, or outputs of other steps) and its model's outputs to the
tensors it makes; a step runs as soon as every tensor it takes is there, so independent
steps run side by side. Example (``REPO/pipeline/config.yaml``)::

    max_batch_size: 8
    input: [{name: IMAGE, data_type: FP32, dims: [16]}]
    output: [{name: SCORES, data_type: FP32, dims: [16]}]
    ensemble:
      steps:
        - model: preprocess
          input_map: {INPUT0: IMAGE}        # preprocess's input <- ensemble tensor
          output_map: {OUTPUT0: scaled}     # preprocess's output -> ensemble tensor
        - model: classifier
          input_map: {INPUT0: scaled}
          output_map: {OUTPUT0: SCORES}

A Triton ``config.pbtxt`` with ``platform: "ensemble"`` and ``ensemble_scheduling`` is
read as this.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, field_validator

from slipstream.config.base import Strict as _Strict
from slipstream.names import MODEL_NAME_RULE, model_name_problem


class EnsembleStep(_Strict):
    """One step: a model of the repository and how its tensors map to the ensemble's."""

    model: str = Field(min_length=1, description="the model's name in the repository")
    version: str = Field(
        "", pattern=r"^([1-9][0-9]*)?$", description="a version number; empty: the default"
    )
    input_map: dict[str, str] = Field(
        min_length=1, description="the model's input name -> the ensemble tensor it takes"
    )
    output_map: dict[str, str] = Field(
        min_length=1, description="the model's output name -> the ensemble tensor it makes"
    )

    @field_validator("model")
    @classmethod
    def _check_model(cls, name: str) -> str:
        problem = model_name_problem(name)
        if problem is not None:
            raise ValueError(f"{name[:64]!r} {problem}; {MODEL_NAME_RULE}")
        return name

    @property
    def name(self) -> str:
        return f"{self.model}:{self.version}" if self.version else self.model


class EnsembleConfig(_Strict):
    """``ensemble:``: the steps, in any order (they run as their tensors are made)."""

    steps: list[EnsembleStep] = Field(min_length=1)

    def check_graph(self, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        """ValueError naming the step or tensor unless every step's tensors are made
        exactly once (by the request or one step), every step can run, and every output
        of the ensemble is made."""
        made: dict[str, str] = {name: "the ensemble's inputs" for name in inputs}
        for index, step in enumerate(self.steps):
            for tensor in step.output_map.values():
                if tensor in made:
                    raise ValueError(
                        f"steps[{index}] ({step.name}): tensor {tensor!r} is made by "
                        f"{made[tensor]} already; each tensor is made once"
                    )
                made[tensor] = f"steps[{index}] ({step.name})"
        for index, step in enumerate(self.steps):
            for tensor in step.input_map.values():
                if tensor not in made:
                    raise ValueError(
                        f"steps[{index}] ({step.name}): takes tensor {tensor!r}, which is "
                        "neither an input of the ensemble nor made by a step"
                    )
        for name in outputs:
            if name not in made or name in inputs:
                raise ValueError(f"output {name!r}: no step makes it (in an output_map)")
        # Run the graph on names: whatever never becomes ready is waiting on a cycle.
        ready = set(inputs)
        waiting = list(enumerate(self.steps))
        while waiting:
            runnable = [(i, s) for i, s in waiting if set(s.input_map.values()) <= ready]
            if not runnable:
                names = ", ".join(f"steps[{i}] ({s.name})" for i, s in waiting)
                raise ValueError(f"{names} wait on each other (a cycle); none can run")
            for _, step in runnable:
                ready.update(step.output_map.values())
            done = {i for i, _ in runnable}
            waiting = [(i, s) for i, s in waiting if i not in done]
