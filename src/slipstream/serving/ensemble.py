"""Ensembles: a model whose steps run other models (see :mod:`slipstream.config.ensemble`).

A request's inputs are the ensemble's first tensors; each step runs once every tensor it
takes is there, as a request of its own through the serving core (its model's version
choice, cache and batcher: the steps of many requests batch together on each model), and
adds the tensors it makes. Steps that do not wait on each other run side by side. The
answer holds the ensemble outputs the request asked for. A step that fails fails the
request with its error, the step named. Building one is :mod:`.cascade_registry`'s, as
for cascades.
"""

from __future__ import annotations

import asyncio
import copy
import time

import numpy as np

from slipstream.config import EnsembleConfig, EnsembleStep, ModelConfig
from slipstream.errors import ClientError, InvalidRequest, NotFound, SlipstreamError, Unavailable
from slipstream.observability.metrics import ModelMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.serving.cascade import LocalCall
from slipstream.types import InferRequest, InferResponse, ModelMetadata, RequestedOutput


class Ensemble:
    """A loaded ensemble: its steps, signature and counts."""

    kind = "ensemble"

    def __init__(
        self, name: str, config: ModelConfig, metadata: ModelMetadata, metrics: ModelMetrics
    ) -> None:
        assert config.ensemble is not None
        self.name = name
        self.config = config
        self.metadata = metadata
        self.metrics = metrics
        self.stats = ModelStatsRecorder(name, "1")
        self._plan: EnsembleConfig = config.ensemble
        self._output_names = [tensor.name for tensor in config.output]
        self._batching = bool(config.max_batch_size)
        # Output name -> its class labels (label_filename), for classification requests.
        self.labels: dict[str, list[str]] = {}

    def models(self) -> list[str]:
        """The repository's models its steps run."""
        return sorted({step.model for step in self._plan.steps})

    def describe(self) -> str:
        return ", ".join(step.name for step in self._plan.steps)

    async def close(self) -> None:
        """Nothing to free: the steps' models are the repository's."""

    async def infer(self, request: InferRequest, local: LocalCall) -> InferResponse:
        """Answer ``request`` (inputs already in memory, outputs not in shared memory)."""
        started_ns = time.perf_counter_ns()
        try:
            if request.model_version not in ("", "1"):
                raise InvalidRequest(
                    f"model {self.name!r} is an ensemble and has one version, 1; got "
                    f"{request.model_version!r}"
                )
            wanted = self._wanted(request)
            tensors = await self._run(request, local)
        except SlipstreamError as exc:
            self.stats.record_request(ok=False, total_ns=time.perf_counter_ns() - started_ns)
            self.metrics.count_failure(
                "bad_request" if isinstance(exc, ClientError) else "internal"
            )
            raise
        elapsed_ns = time.perf_counter_ns() - started_ns
        self.stats.record_request(ok=True, total_ns=elapsed_ns)
        # As Triton counts an ensemble: one execution of the request's rows, computing
        # for as long as its steps took.
        first = next(iter(request.inputs.values()), None)
        rows = first.shape[0] if self._batching and first is not None and first.ndim else 1
        self.stats.record_batch(
            batch_size=max(1, rows), num_requests=1, input_ns=0, infer_ns=elapsed_ns,
            output_ns=0, end_ms=time.time_ns() // 1_000_000,
        )  # fmt: skip
        self.metrics.request_success += 1
        self.metrics.request_duration.observe(elapsed_ns / 1e9)
        return InferResponse(self.name, "1", {n: tensors[n] for n in wanted}, id=request.id)

    def _wanted(self, request: InferRequest) -> list[str]:
        if not request.outputs:
            return self._output_names
        names = [output.name for output in request.outputs]
        for name in names:
            if name not in self._output_names:
                raise InvalidRequest(
                    f"output {name!r}: ensemble {self.name!r} has no such output (outputs: "
                    f"{', '.join(self._output_names)})"
                )
        return names

    async def _run(self, request: InferRequest, local: LocalCall) -> dict[str, np.ndarray]:
        """Every tensor of the ensemble for ``request``: steps start as their tensors are
        made; the first step to fail cancels the others."""
        self._check_inputs(request)
        tensors: dict[str, np.ndarray] = dict(request.inputs)
        waiting = list(self._plan.steps)
        running: dict[asyncio.Task[dict[str, np.ndarray]], EnsembleStep] = {}
        try:
            while waiting or running:
                for step in [s for s in waiting if set(s.input_map.values()) <= tensors.keys()]:
                    waiting.remove(step)
                    task = asyncio.ensure_future(self._step(step, tensors, request, local))
                    running[task] = step
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.pop(task)
                    tensors.update(task.result())
        finally:
            for task in running:
                task.cancel()
        return tensors

    def _check_inputs(self, request: InferRequest) -> None:
        declared = {tensor.name for tensor in self.config.input}
        for name in request.inputs:
            if name not in declared:
                raise InvalidRequest(
                    f"input {name!r}: ensemble {self.name!r} has no such input (inputs: "
                    f"{', '.join(declared)})"
                )
        for tensor in self.config.input:
            if tensor.name not in request.inputs and not tensor.optional:
                raise InvalidRequest(
                    f"input {tensor.name!r}: missing; ensemble {self.name!r} requires it"
                )

    async def _step(
        self,
        step: EnsembleStep,
        tensors: dict[str, np.ndarray],
        request: InferRequest,
        local: LocalCall,
    ) -> dict[str, np.ndarray]:
        inputs = {name: tensors[tensor] for name, tensor in step.input_map.items()}
        call = InferRequest(
            model_name=step.model,
            model_version=step.version,
            inputs=inputs,
            id=request.id,
            outputs=[RequestedOutput(name) for name in step.output_map],
            priority=request.priority,
            timeout_us=request.timeout_us,
            # As Triton does: each step's model reads the ensemble request's parameters.
            parameters=dict(request.parameters),
        )
        try:
            answer = await local(call)
        except NotFound as exc:
            # The step's model went away: the ensemble cannot serve now (not a bad name).
            raise Unavailable(
                f"ensemble {self.name!r} step {step.name}: {exc.message}", retry_after_s=1
            ) from None
        except SlipstreamError as exc:
            # A copy: the step's error may be raised to others too (its batch's requests).
            named = copy.copy(exc)
            named.message = f"ensemble {self.name!r} step {step.name}: {exc.message}"
            named.args = (named.message,)
            raise named from None
        return {tensor: answer.outputs[name] for name, tensor in step.output_map.items()}
