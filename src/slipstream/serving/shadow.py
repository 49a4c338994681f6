"""Shadow traffic: copies of served requests run on another version off the hot path.

The primary's answer goes to the client first; only then is a copy offered here, into a
bounded queue (full: the copy is dropped and counted, never waited for). Workers run the
copies on the shadow version and compare its answer with the primary's: labels (integer,
bool) must be equal, float tensors are compared by cosine similarity and the largest
absolute difference, BYTES (text) must match exactly. The shadow's answer is recorded,
never returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from slipstream.errors import SlipstreamError
from slipstream.observability.rollout_metrics import ShadowCounts
from slipstream.serving.rollout_analysis import ShadowWindow
from slipstream.types import InferRequest, InferResponse

logger = logging.getLogger(__name__)

# Float outputs agree when their cosine similarity is at least this.
AGREEMENT_COSINE = 0.999
# How long the worker lets copies gather before running them together, and how many.
_GATHER_S = 0.002
_MAX_GATHERED = 64
_GOLDEN = 0.6180339887498949

RunVersion = Callable[[InferRequest], Awaitable[InferResponse]]


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
    agree, max_diff, cosine = True, 0.0, 1.0
    for name, expected in primary.items():
        got = shadow.get(name)
        if got is None or got.shape != expected.shape:
            return Comparison(False, float("inf"), 0.0)
        if expected.dtype.kind == "f" or got.dtype.kind == "f":
            a = expected.astype(np.float64).ravel()
            b = got.astype(np.float64).ravel()
            if a.size:
                max_diff = max(max_diff, float(np.max(np.abs(a - b))))
                norms = float(np.linalg.norm(a) * np.linalg.norm(b))
                similarity = float(a @ b) / norms if norms > 0 else float(np.array_equal(a, b))
                cosine = min(cosine, similarity)
                agree = agree and similarity >= AGREEMENT_COSINE
        else:
            agree = agree and bool(np.array_equal(expected, got))
    return Comparison(agree, max_diff, cosine)


class ShadowMirror:
    """Mirrors ``share`` of the requests offered to version ``version`` of a model."""

    def __init__(
        self,
        version: str,
        share: float,
        queue_size: int,
        run: RunVersion,
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

    def offer(self, request: InferRequest, response: InferResponse) -> None:
        """Queue a copy of a served request; O(1), never blocks, never raises."""
        if self.share < 1.0:
            self._next = (self._next + _GOLDEN) % 1.0
            if self._next >= self.share:
                return
        if request.shared_memory_inputs or any(o.shared_memory for o in request.outputs or ()):
            return  # a region's contents may change once answered; no copy writes into one
        if not self._workers:
            self._workers = [asyncio.create_task(self._work())]
        copy = replace(request, model_version=self.version, id="", route_key="")
        try:
            self._queue.put_nowait((copy, response))
        except asyncio.QueueFull:
            self._count("dropped")

    async def _work(self) -> None:
        """Take the copies queued, a few milliseconds' worth at a time, and run them side
        by side: the shadow version's batcher runs them as one batch, which costs the
        primary's CPU less than one run per copy."""
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(_GATHER_S)
            while len(batch) < _MAX_GATHERED and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await asyncio.gather(*(self._compare(request, primary) for request, primary in batch))

    async def _compare(self, request: InferRequest, primary: InferResponse) -> None:
        try:
            answer = await self._run(request)
        except SlipstreamError as exc:
            logger.debug("shadow request to version %s failed: %s", self.version, exc)
            self._count("failed")
            return
        except Exception:
            logger.exception("shadow request to version %s failed", self.version)
            self._count("failed")
            return
        result = compare_outputs(primary.outputs, answer.outputs)
        counts = self._counts
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
