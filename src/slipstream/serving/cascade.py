"""Cascades: a model that answers with a small model first and a larger one when unsure.

A cascade is a model of the repository with ``cascade:`` in its config.yaml and no
file (see :mod:`slipstream.config.cascade`). Each request runs on the first stage; the
rows whose confidence is below the stage's threshold run again on the next stage, and
so on; the rows' answers are put back together in request order. A local stage is
called through the serving core like any request (its version choice, cache and
batcher: escalated rows from many requests batch together on the larger model); a
remote stage through a pooled HTTP client (:mod:`slipstream.serving.cascade_remote`).

The response says which stage answered: the parameter ``cascade_stage`` (the last stage
any row reached; HTTP also sends it as ``X-Slipstream-Cascade-Stage``) and
``cascade_escalated_rows``. When a later stage fails and the policy is ``answer``, the
previous stage's answer is returned with ``cascade_fallback: true`` and
``cascade_failed_stage``. The loading of cascades is :mod:`.cascade_registry`'s.

Example (a client's view)::

    result = client.infer("digits_cascade", inputs)    # tritonclient
    result.get_response()["parameters"]["cascade_stage"]  # "digits_small" or "digits"
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from slipstream.config import CascadeConfig, CascadeStage, ConfidenceRule, ModelConfig
from slipstream.errors import ClientError, InvalidRequest, SlipstreamError, Unavailable
from slipstream.observability.cascade_metrics import CascadeCounts
from slipstream.observability.metrics import ModelMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.types import InferRequest, InferResponse, ModelMetadata, RequestedOutput

if TYPE_CHECKING:
    # httpx is imported only by servers with a remote stage.
    from slipstream.serving.cascade_remote import RemoteStage

logger = logging.getLogger(__name__)

# How the serving core runs a request on a local model (version choice, cache, batcher).
LocalCall = Callable[[InferRequest], Awaitable[InferResponse]]

# Response parameters (and the HTTP header) that say how a cascade answered.
STAGE_PARAMETER = "cascade_stage"
ESCALATED_PARAMETER = "cascade_escalated_rows"
FALLBACK_PARAMETER = "cascade_fallback"
FAILED_STAGE_PARAMETER = "cascade_failed_stage"


def confidence(rule: ConfidenceRule, output: np.ndarray) -> np.ndarray:
    """Each row's confidence under ``rule``: [B] from an output [B, ...].

    >>> rule = ConfidenceRule(output="p", rule="margin", threshold=0.5)
    >>> confidence(rule, np.array([[0.75, 0.25, 0.0], [0.5, 0.25, 0.25]], np.float32))
    array([0.5 , 0.25], dtype=float32)
    """
    rows = output.reshape(output.shape[0], -1) if output.ndim else output.reshape(1, 1)
    if rows.dtype.kind not in "fiub":
        raise InvalidRequest(f"confidence output {rule.output!r} is {output.dtype}, not numeric")
    if rule.softmax:
        shifted = np.exp(rows - rows.max(axis=1, keepdims=True))
        rows = shifted / shifted.sum(axis=1, keepdims=True)
    if rule.rule == "value":
        if rows.shape[1] != 1:
            raise InvalidRequest(
                f"confidence output {rule.output!r}: rule value needs one number per row, "
                f"got {rows.shape[1]}"
            )
        value: np.ndarray = rows[:, 0]
        return value
    if rule.rule == "max_probability" or rows.shape[1] == 1:
        best: np.ndarray = rows.max(axis=1)
        return best
    top_two = np.partition(rows, -2, axis=1)[:, -2:]
    return top_two[:, 1] - top_two[:, 0]


@dataclass(slots=True)
class Stage:
    """One stage, ready to run: a local model (``remote`` None) or a remote one."""

    spec: CascadeStage
    remote: RemoteStage | None

    async def run(
        self,
        local: LocalCall,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        request: InferRequest,
    ) -> dict[str, np.ndarray]:
        """``outputs`` of this stage for ``inputs``."""
        if self.remote is not None:
            return await self.remote.infer(inputs, outputs, request.timeout_us)
        stage_request = InferRequest(
            model_name=self.spec.model,
            model_version=self.spec.version,
            inputs=inputs,
            id=request.id,
            outputs=[RequestedOutput(name) for name in outputs],
            priority=request.priority,
            timeout_us=request.timeout_us,
            route_key=request.route_key,
        )
        return (await local(stage_request)).outputs


@dataclass(slots=True)
class _Answer:
    """The rows answered so far, assembled in request order."""

    # Output name -> [B, ...], the rows of every stage that answered put in place.
    outputs: dict[str, np.ndarray]
    # The last stage that answered any row, and rows sent past the first stage.
    stage: str
    escalated_rows: int = 0
    # The stage whose failure left the rows still open with the previous answer.
    failed_stage: str = ""
    # ``outputs`` are copies of the first stage's (which may be views of its batch, or
    # arrays its response cache keeps): only then are later rows written into them.
    owned: bool = False


class Cascade:
    """A loaded cascade: its stages, signature, policy and counts."""

    kind = "cascade"

    def __init__(
        self,
        name: str,
        config: ModelConfig,
        metadata: ModelMetadata,
        stages: list[Stage],
        counts: CascadeCounts,
        metrics: ModelMetrics,
    ) -> None:
        assert config.cascade is not None
        self.name = name
        self.config = config
        self.metadata = metadata
        self.stages = stages
        self.counts = counts
        self.metrics = metrics
        self.stats = ModelStatsRecorder(name, "1")
        self._policy: CascadeConfig = config.cascade
        self._output_names = [tensor.name for tensor in metadata.outputs]
        # A cascade's outputs are its stages': no label files of its own.
        self.labels: dict[str, list[str]] = {}
        # Stages failing since their last answer (their failures are logged once).
        self._failing: set[str] = set()

    async def infer(self, request: InferRequest, local: LocalCall) -> InferResponse:
        """Answer ``request`` (inputs already in memory, outputs not in shared memory)."""
        started_ns = time.perf_counter_ns()
        try:
            if request.model_version not in ("", "1"):
                raise InvalidRequest(
                    f"model {self.name!r} is a cascade and has one version, 1; got "
                    f"{request.model_version!r}"
                )
            answer = await self._run(request, self._wanted(request), local)
        except SlipstreamError as exc:
            self.stats.record_request(ok=False, total_ns=time.perf_counter_ns() - started_ns)
            self.metrics.count_failure(
                "bad_request" if isinstance(exc, ClientError) else "internal"
            )
            raise
        elapsed_ns = time.perf_counter_ns() - started_ns
        self.stats.record_request(ok=True, total_ns=elapsed_ns)
        self.metrics.request_success += 1
        self.metrics.request_duration.observe(elapsed_ns / 1e9)
        self.counts.requests[answer.stage] += 1
        parameters: dict[str, object] = {
            STAGE_PARAMETER: answer.stage,
            ESCALATED_PARAMETER: answer.escalated_rows,
        }
        if answer.failed_stage:
            parameters[FALLBACK_PARAMETER] = True
            parameters[FAILED_STAGE_PARAMETER] = answer.failed_stage
        return InferResponse(self.name, "1", answer.outputs, id=request.id, parameters=parameters)

    async def run_rows(
        self, request: InferRequest, wanted: list[str], local: LocalCall
    ) -> dict[str, np.ndarray]:
        """``wanted`` outputs of every row of ``request`` as the stages answer them (what
        ``slipstream cascade calibrate`` runs)."""
        return (await self._run(request, wanted, local)).outputs

    def _wanted(self, request: InferRequest) -> list[str]:
        if not request.outputs:
            return self._output_names
        names = [output.name for output in request.outputs]
        for name in names:
            if name not in self._output_names:
                raise InvalidRequest(
                    f"output {name!r}: cascade {self.name!r} has no such output (outputs: "
                    f"{', '.join(self._output_names)})"
                )
        return names

    async def _run(self, request: InferRequest, wanted: list[str], local: LocalCall) -> _Answer:
        """Each stage in turn on the rows still open; the answers put in place."""
        inputs = request.inputs
        first = self.stages[0]
        found = await first.run(local, inputs, _asking(wanted, first.spec), request)
        answer = _Answer({name: found[name] for name in wanted}, first.spec.name)
        open_rows = self._unsure(first.spec, found, None)
        for stage in self.stages[1:]:
            if open_rows.size == 0:
                break
            self.counts.escalations[stage.spec.name] += 1
            self.counts.escalated_rows[stage.spec.name] += int(open_rows.size)
            if answer.stage == first.spec.name:
                answer.escalated_rows = int(open_rows.size)
            rows_in = {name: array[open_rows] for name, array in inputs.items()}
            try:
                found = await stage.run(local, rows_in, _asking(wanted, stage.spec), request)
                _put(answer, open_rows, found, wanted)
            except (SlipstreamError, ValueError) as exc:
                self._stage_failed(stage.spec, exc)
                answer.failed_stage = stage.spec.name
                break
            if stage.spec.name in self._failing:
                self._failing.discard(stage.spec.name)
                logger.info("cascade %s: stage %s answers again", self.name, stage.spec.name)
            answer.stage = stage.spec.name
            open_rows = self._unsure(stage.spec, found, open_rows)
        return answer

    def _unsure(
        self, spec: CascadeStage, found: dict[str, np.ndarray], rows: np.ndarray | None
    ) -> np.ndarray:
        """The request rows (indices) this stage's answer does not settle; counts the
        rows it does. ``rows``: which request rows ``found`` holds (None: all)."""
        count = next(iter(found.values())).shape[0] if rows is None else rows.size
        rule = spec.confidence
        if rule is None:
            self.counts.rows[spec.name] += count
            return np.empty(0, dtype=np.intp)
        # A NaN confidence is no confidence: `not >=` sends it on.
        unsure = ~(confidence(rule, found[rule.output]) >= rule.threshold)
        unsure_rows = np.flatnonzero(unsure) if rows is None else rows[unsure]
        self.counts.rows[spec.name] += count - int(unsure_rows.size)
        return unsure_rows

    def _stage_failed(self, spec: CascadeStage, exc: Exception) -> None:
        message = exc.message if isinstance(exc, SlipstreamError) else str(exc)
        if self._policy.on_stage_failure == "fail":
            raise Unavailable(
                f"cascade {self.name!r}: stage {spec.name} failed: {message}", retry_after_s=1
            ) from None
        self.counts.fallbacks[spec.name] += 1
        if spec.name not in self._failing:  # logged once per outage, counted every time
            self._failing.add(spec.name)
            logger.warning(
                "cascade %s: stage %s failed; answering with the stage before it until it "
                "answers again (slipstream_cascade_fallbacks counts them): %s",
                self.name,
                spec.name,
                message,
            )

    def models(self) -> list[str]:
        """The repository's models its local stages run."""
        return sorted({stage.spec.model for stage in self.stages if stage.remote is None})

    def describe(self) -> str:
        return " -> ".join(stage.spec.name for stage in self.stages)

    async def close(self) -> None:
        for stage in self.stages:
            if stage.remote is not None:
                await stage.remote.close()


def _asking(wanted: list[str], spec: CascadeStage) -> list[str]:
    """The outputs to ask a stage for: the client's, and the one its rule reads."""
    rule = spec.confidence
    if rule is None or rule.output in wanted:
        return wanted
    return [*wanted, rule.output]


def _put(
    answer: _Answer, rows: np.ndarray, found: dict[str, np.ndarray], wanted: list[str]
) -> None:
    """Write a later stage's rows over the answer; ValueError when they do not fit."""
    if not answer.owned:
        answer.outputs = {name: np.array(array) for name, array in answer.outputs.items()}
        answer.owned = True
    for name in wanted:
        merged = answer.outputs[name]
        value = found[name]
        if value.shape[1:] != merged.shape[1:] or value.shape[0] != rows.size:
            raise ValueError(
                f"output {name!r}: the stage answered shape {list(value.shape)} for "
                f"{rows.size} rows; the first stage's rows are {list(merged.shape[1:])}"
            )
        merged[rows] = value
