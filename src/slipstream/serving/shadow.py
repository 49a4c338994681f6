"""Shadow traffic: copies of served requests run on another version off the hot path.

The primary's answer goes to the client first; only then is a copy offered here, into a
bounded queue (full: the copy is dropped and counted, never waited for). Workers run the
copies on the shadow version (:func:`run_copies`) and compare its answer with the
primary's: labels (integer, bool) must be equal, float tensors are compared by cosine
similarity and the largest absolute difference, BYTES (text) must match exactly. The
shadow's answer is recorded in ``slipstream_shadow_*``, never returned, and never counted
in the version's ``slipstream_request_*`` series: those count clients' requests, and a
failing shadow must not page about a primary whose clients see no error.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from slipstream.errors import RequestTimeout, SlipstreamError, Unavailable
from slipstream.observability.rollout_metrics import ShadowCounts
from slipstream.serving.manager import ModelManager
from slipstream.serving.model import ModelVersion, PreparedRequest
from slipstream.serving.rollout_analysis import ShadowWindow
from slipstream.types import InferRequest, InferResponse

logger = logging.getLogger(__name__)

# Float outputs agree when their cosine similarity is at least this.
AGREEMENT_COSINE = 0.999
# How long the worker lets copies gather before running them together, and how many.
_GATHER_S = 0.02
_MAX_GATHERED = 64
# Gathered copies then wait for the next primary answer, at most this long (see _work).
_ALIGN_S = 0.02
_GOLDEN = 0.6180339887498949

# Runs copies on the version they name; an error in place of each copy that failed.
RunCopies = Callable[[Sequence[InferRequest]], Awaitable[list[InferResponse | SlipstreamError]]]


@dataclass(frozen=True, slots=True)
class Comparison:
    """How a shadow answer compares with the primary's."""

    agree: bool
    # Over float outputs (0.0 / 1.0 when there are none).
    max_abs_diff: float
    cosine: float


def compare_outputs(
    primary: Mapping[str, np.ndarray], shadow: Mapping[str, np.ndarray]
) -> Comparison:
    """Compare two answers output by output (only outputs both have; shapes must match)."""
    return compare_many([primary], [shadow])[0]


def compare_many(
    primaries: Sequence[Mapping[str, np.ndarray]], shadows: Sequence[Mapping[str, np.ndarray]]
) -> list[Comparison]:
    """Compare pairs of answers, as :func:`compare_outputs` does one. An output's rows
    are compared for all the pairs together (pairs whose output differs only in its
    first dimension, the batch, are concatenated), then summed up pair by pair: a handful
    of numpy calls for the lot. One pair at a time, comparing cost the event loop as much
    as running the shadow copy (~25 us a copy of a small model)."""
    count = len(primaries)
    agree = np.ones(count, dtype=bool)
    max_diff = np.zeros(count)
    cosine = np.ones(count)
    for name in primaries[0] if count else ():
        groups: dict[tuple[tuple[int, ...], str, str], list[int]] = {}
        for index, (primary, shadow) in enumerate(zip(primaries, shadows, strict=True)):
            expected, got = primary.get(name), shadow.get(name)
            if expected is None or got is None or got.shape != expected.shape:
                agree[index], max_diff[index] = False, np.inf
                cosine[index] = min(cosine[index], 0.0)
            elif expected.size:  # an empty output agrees, as its every element does
                tail = expected.shape[1:] if expected.ndim else (-1,)
                groups.setdefault((tail, expected.dtype.str, got.dtype.str), []).append(index)
        for (tail, dtype, got_dtype), indices in groups.items():
            floats = np.dtype(dtype).kind == "f" or np.dtype(got_dtype).kind == "f"
            _compare_rows(
                [primaries[i][name] for i in indices], [shadows[i][name] for i in indices],
                math.prod(tail) if tail != (-1,) else 1, floats, np.array(indices),
                agree, max_diff, cosine,
            )  # fmt: skip
    return [Comparison(bool(agree[i]), float(max_diff[i]), float(cosine[i])) for i in range(count)]


def _compare_rows(
    expected: list[np.ndarray],
    got: list[np.ndarray],
    width: int,
    floats: bool,
    indices: np.ndarray,
    agree: np.ndarray,
    max_diff: np.ndarray,
    cosine: np.ndarray,
) -> None:
    """Fold one output of the pairs ``indices`` into their agreement, difference and
    cosine; each pair's arrays are non-empty and differ from the others' only in their
    first dimension, and ``width`` elements make one row."""
    if expected[0].ndim:
        starts = np.cumsum([0] + [array.shape[0] for array in expected[:-1]])
        a = np.concatenate(expected).reshape(-1, width)
        b = np.concatenate(got).reshape(-1, width)
    else:  # 0-d outputs: one row each
        starts = np.arange(len(expected))
        a, b = np.stack(expected).reshape(-1, 1), np.stack(got).reshape(-1, 1)
    equal = np.logical_and.reduceat((a == b).all(axis=1), starts)
    if not floats:
        agree[indices] &= equal
        return
    a, b = a.astype(np.float64), b.astype(np.float64)
    max_diff[indices] = np.maximum(
        max_diff[indices], np.maximum.reduceat(np.abs(a - b).max(axis=1), starts)
    )
    dots = np.add.reduceat(np.einsum("ij,ij->i", a, b), starts)
    norms = np.sqrt(
        np.add.reduceat(np.einsum("ij,ij->i", a, a), starts)
        * np.add.reduceat(np.einsum("ij,ij->i", b, b), starts)
    )
    similarity = np.divide(dots, norms, out=equal.astype(np.float64), where=norms > 0)
    cosine[indices] = np.minimum(cosine[indices], similarity)
    agree[indices] &= similarity >= AGREEMENT_COSINE


class ShadowMirror:
    """Mirrors ``share`` of the requests offered to version ``version`` of a model."""

    def __init__(
        self,
        version: str,
        share: float,
        queue_size: int,
        run: RunCopies,
        counts: ShadowCounts,
    ) -> None:
        self.version = version
        self.share = share
        self._run = run
        self._counts = counts
        # The rollout's window, when one is judged (agreement is one of its checks).
        self.window: ShadowWindow | None = None
        self._queue: asyncio.Queue[tuple[InferRequest, InferResponse]] = asyncio.Queue(queue_size)
        self._next = 0.0
        self._workers: list[asyncio.Task[None]] = []
        # Set by the next offer (the worker waits on it to start a batch): see _work.
        self._answered: asyncio.Future[None] | None = None

    def offer(self, request: InferRequest, response: InferResponse) -> None:
        """Queue a copy of a served request; O(1), never blocks, never raises."""
        if self.share < 1.0:
            self._next = (self._next + _GOLDEN) % 1.0
            if self._next >= self.share:
                return
        if request.shared_memory_inputs or any(o.shared_memory for o in request.outputs or ()):
            return  # a region's contents may change once answered; no copy writes into one
        if not self._workers:
            # A context of its own: not the request's that started it (a traced request's
            # recording would take the shadow copies' runs as its own).
            self._workers = [asyncio.create_task(self._work(), context=contextvars.Context())]
        copy = replace(request, model_version=self.version, id="", route_key="")
        try:
            self._queue.put_nowait((copy, response))
        except asyncio.QueueFull:
            self._count("dropped")
        answered = self._answered
        if answered is not None and not answered.done():
            # Called before the primary's answer is written: wake the worker on the next
            # turn of the loop, once it is.
            answered.get_loop().call_soon(_settle, answered)

    async def _work(self) -> None:
        """Take the copies queued, a few milliseconds' worth at a time, and run them side
        by side: the shadow version's batcher runs them as one batch, which costs the
        primary's CPU less than one run per copy."""
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(_GATHER_S)
            await self._next_answer()
            while len(batch) < _MAX_GATHERED and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                answers = await self._run([request for request, _ in batch])
            except Exception:
                logger.exception("shadow requests to version %s failed", self.version)
                answers = [SlipstreamError("failed")] * len(batch)
            self._compare(batch, answers)

    async def _next_answer(self) -> None:
        """Wait until the next primary answer has been written (or ``_ALIGN_S``). A client
        that sends requests one at a time then takes a moment to send the next: the copies
        run in that gap rather than at a time that has nothing to do with the traffic,
        where they would land on top of a primary request as often as the server is busy
        (at one request at a time on the mlp, the primary's p50 went up 5-10% that way)."""
        self._answered = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._answered), _ALIGN_S)
        except TimeoutError:
            pass
        finally:
            self._answered = None

    def _compare(
        self,
        batch: list[tuple[InferRequest, InferResponse]],
        answers: list[InferResponse | SlipstreamError],
    ) -> None:
        pairs = []
        for (_, primary), answer in zip(batch, answers, strict=True):
            if isinstance(answer, InferResponse):
                pairs.append((primary.outputs, answer.outputs))
            elif isinstance(answer, Unavailable) and not isinstance(answer, RequestTimeout):
                # The shadow's queue was full (or it was unloading): a copy it had no
                # room for was dropped, as one its own queue had no room for; one that
                # timed out waiting ran too slowly, and counts as failed.
                logger.debug("shadow request to version %s dropped: %s", self.version, answer)
                self._count("dropped")
            else:
                logger.debug("shadow request to version %s failed: %s", self.version, answer)
                self._count("failed")
        if not pairs:
            return
        counts = self._counts
        for result in compare_many([p for p, _ in pairs], [s for _, s in pairs]):
            counts.max_abs_diff.observe(result.max_abs_diff)
            counts.min_cosine = min(counts.min_cosine, result.cosine)
            self._count("agreed" if result.agree else "disagreed")

    def _count(self, outcome: str) -> None:
        self._counts.outcomes[outcome] += 1
        window = self.window
        if window is None:
            return
        if outcome == "dropped":
            window.dropped += 1
        elif outcome == "failed":
            window.failed += 1
        else:
            window.compared += 1
            window.agreed += outcome == "agreed"

    async def close(self) -> None:
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []


async def run_copies(
    models: ModelManager, requests: Sequence[InferRequest]
) -> list[InferResponse | SlipstreamError]:
    """Run shadow copies (of one model, each naming the shadow version) unrouted. On a
    batching model the copies are stacked into one submission per ``max_batch_size``
    rows: one at a time, thirty copies cost the event loop ~1 ms, as much as the
    primary requests they copy. Each copy is counted in the version's statistics (the
    V2 statistics extension: what ran on it), not in its ``slipstream_request_*``."""
    first = requests[0]
    try:
        model = models.resolve(first.model_name, first.model_version)
    except SlipstreamError as exc:
        return [exc] * len(requests)
    # Every copy's answer or error: each is set below or by its chunk's run.
    results: list[Any] = [None] * len(requests)
    chunks: list[list[tuple[int, PreparedRequest]]] = []
    # The chunk still filling for each shape and output list, and its rows so far.
    filling: dict[tuple[Any, ...], tuple[list[tuple[int, PreparedRequest]], int]] = {}
    limit = model.config.max_batch_size
    for index, request in enumerate(requests):
        try:
            prepared = model.prepare(request)
        except SlipstreamError as exc:
            results[index] = exc
            continue
        key = (prepared.shape_key, tuple(prepared.output_names))
        chunk, rows = filling.get(key, (None, 0))
        if chunk is None or not limit or rows + prepared.rows > limit:
            chunk, rows = [], 0
            chunks.append(chunk)
        chunk.append((index, prepared))
        filling[key] = (chunk, rows + prepared.rows)
    started_ns = time.perf_counter_ns()
    await asyncio.gather(*(_run_stacked(model, chunk, results, started_ns) for chunk in chunks))
    return results


async def _run_stacked(
    model: ModelVersion,
    chunk: list[tuple[int, PreparedRequest]],
    results: list[Any],
    started_ns: int,
) -> None:
    prepared = [p for _, p in chunk]
    if len(chunk) == 1:
        inputs = prepared[0].inputs
    else:
        inputs = {name: np.concatenate([p.inputs[name] for p in prepared])
                  for name in prepared[0].inputs}  # fmt: skip
    rows = sum(p.rows for p in prepared)
    try:
        outputs = await model.batcher.submit(
            inputs, rows, prepared[0].shape_key, requests=len(chunk)
        )
    except SlipstreamError as exc:
        if len(chunk) > 1 and not isinstance(exc, Unavailable):
            # To the batcher the stack is one request, so its rerun of a failed batch one
            # request at a time cannot single out a bad copy: submitted each on its own,
            # only the copies the version fails on (as it would their primaries) fail.
            await asyncio.gather(*(_run_stacked(model, [one], results, started_ns)
                                   for one in chunk))  # fmt: skip
            return
        elapsed_ns = time.perf_counter_ns() - started_ns
        model.stats.record_request(ok=False, total_ns=elapsed_ns, count=len(chunk))
        for index, _ in chunk:
            results[index] = exc
        return
    elapsed_ns = time.perf_counter_ns() - started_ns
    start = 0
    for index, one in chunk:
        stop = start + one.rows
        results[index] = InferResponse(
            model_name=model.name,
            model_version=model.version_str,
            outputs={name: outputs[name][start:stop] for name in one.output_names},
        )
        start = stop
    model.stats.record_request(ok=True, total_ns=elapsed_ns, count=len(chunk))
    if model.tap is not None:
        model.tap.offer(inputs, outputs)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
