"""Inference requests sent to the engine in groups, alike ones stacked into one tensor.

Under load a front end reads many requests in one poll of its event loop. One engine
call each would cost the engine's event loop (the one a GPU waits on between batches) a
message, a task and the serving core's whole per-request path apiece. Instead the
requests a front end makes in one turn of its loop (:class:`Group`) leave at the turn's
end in one ``infer_group`` call, and among them those that could share a batch anyway
(same model, version, priority, timeout and requested outputs; each input of the same
datatype and shape but for the batch dim) travel *stacked*: one tensor per input, the
rows of each request one after another. The engine checks and queues a stack as one
request (:meth:`~slipstream.serving.core.ModelServer.infer_stack`) and answers it with
stacked outputs, which the front end cuts back into one response per request.

The message and its answer, beside the other engine calls (:mod:`slipstream.engine.host`):

    ("call", id, "infer_group", (entries,))
        entries: (ONE, request fields) | (STACK, stacked request fields,
                                          [each part's (id, route_key, owner, parameters)],
                                          [rows])
    ("ok", id, answers)    one per entry, in order:
        ONE:   (True, response fields) | (False, error state)
        STACK: (True, stacked response fields) | (None, [an answer as for ONE, per part])

Every request still gets the answer or error it would get alone: the engine unstacks a
stack wherever one check or run could not stand for each part's (a request the model
refuses, a routed or cached model). A lone request goes as a plain ``infer`` call. When
every requester of a group has given up (its client went away), the engine is told to
drop the work.

Calls that reach the engine in one turn of its loop are gathered there
(:class:`~slipstream.engine.host.EngineHost`'s ``gathered``): lone ``infer`` calls (from
several front ends, or from gRPC front ends, which see one call a turn) and several front
ends' ``infer_group`` calls are served the same way, alike requests and stacks of any of
them stacked together by the engine (:func:`answer_gathered`, :func:`answer_groups`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast, overload

import numpy as np

from slipstream.engine.client import EngineClient
from slipstream.engine.wire import (
    INPUTS_FIELD,
    error_state,
    rebuild_error,
    request_fields,
    request_from,
    response_fields,
    response_from,
)
from slipstream.errors import SlipstreamError
from slipstream.serving.service import InferenceService, cut
from slipstream.types import InferRequest, InferResponse

logger = logging.getLogger(__name__)

ONE = 0
STACK = 1
# Above this many bytes of inputs a piece (on average) the engine does not copy alike
# pieces into one stack: at ~5 GB/s, 32 KB is a few microseconds, less than the engine
# saves a request by stacking; a large image is not.
MERGE_MAX_BYTES = 32 * 1024


def stack_key(request: InferRequest) -> tuple[Any, ...] | None:
    """What requests must share to travel stacked; None for one that travels alone
    (shared memory, a scalar or empty input, inputs of unequal batch dims, objects)."""
    if request.shared_memory_inputs or not request.inputs:
        return None
    outputs = None
    if request.outputs is not None:
        if any(output.shared_memory for output in request.outputs):
            return None
        outputs = tuple([output.name for output in request.outputs])
    rows = -1
    signature = []
    for name, array in request.inputs.items():
        shape = array.shape
        if not shape or not shape[0] or array.dtype.hasobject or rows not in (-1, shape[0]):
            return None
        rows = shape[0]
        signature.append((name, array.dtype, shape[1:]))
    key = (request.model_name, request.model_version, request.priority, request.timeout_us)
    return (*key, outputs, tuple(signature))


def plan(requests: Sequence[InferRequest]) -> list[list[int]]:
    """Which requests travel together: the indices of each entry, alike requests
    (:func:`stack_key`) in one, entries in the order of their first request."""
    by_key: dict[tuple[Any, ...], list[int]] = {}
    entries: list[list[int]] = []
    for index, request in enumerate(requests):
        key = stack_key(request)
        members = by_key.get(key) if key is not None else None
        if members is None:
            members = [index]
            entries.append(members)
            if key is not None:
                by_key[key] = members
        else:
            members.append(index)
    return entries


def stack_inputs(parts: Sequence[InferRequest]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Alike requests' inputs, one tensor per input (their rows one after another), and
    each request's rows."""
    stacked = {name: np.concatenate([part.inputs[name] for part in parts])
               for name in parts[0].inputs}  # fmt: skip
    return stacked, [next(iter(part.inputs.values())).shape[0] for part in parts]


class Group:
    """One front end's infer requests of one turn of its event loop; see the module
    docstring. ``add`` each, ``send`` once at the turn's end."""

    __slots__ = ("_call_id", "_client", "_gone", "_loop", "_requests", "_waiters")

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._requests: list[InferRequest] = []
        self._waiters: list[asyncio.Future[Any]] = []
        self._gone = 0
        self._call_id: int | None = None

    def add(self, request: InferRequest) -> asyncio.Future[Any]:
        """The future ``request``'s answer settles: pass its result to :meth:`response`."""
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._requests.append(request)
        self._waiters.append(waiter)
        return waiter

    @staticmethod
    def response(answer: Any) -> InferResponse:
        """A settled answer as the response (a lone request's comes as its fields)."""
        return answer if isinstance(answer, InferResponse) else response_from(answer)

    def left(self) -> None:
        """A requester gave up; the last one to leave a sent group cancels its call."""
        self._gone += 1
        if self._gone == len(self._waiters) and self._call_id is not None:
            self._client.give_up(self._call_id)

    def send(self) -> None:
        if any(waiter.done() for waiter in self._waiters):  # given up before it left
            kept = [(r, w) for r, w in zip(self._requests, self._waiters, strict=True)
                    if not w.done()]  # fmt: skip
            self._requests = [r for r, _ in kept]
            self._waiters = [w for _, w in kept]
            self._gone = 0
            if not kept:
                return
        if len(self._requests) == 1:
            # The requester's own future takes the engine's answer: its response's
            # fields, made a response by the requester (Group.response).
            self._call_id, _ = self._client.start_call(
                "infer", request_fields(self._requests[0]), into=self._waiters[0]
            )
            self._client.flush()  # this already runs at a turn's end: no turn more
            return
        entries_of = plan(self._requests)
        entries = [self._entry(members) for members in entries_of]
        # Each entry's rows per part (a stack's, as sent; None for a lone request).
        rows_of = [entry[3] if entry[0] == STACK else None for entry in entries]
        self._call_id, answer = self._client.start_call("infer_group", entries)
        answer.add_done_callback(lambda done: self._answered(done, entries_of, rows_of))
        self._client.flush()

    def _entry(self, members: list[int]) -> tuple[Any, ...]:
        if len(members) == 1:
            return ONE, request_fields(self._requests[members[0]])
        parts = [self._requests[index] for index in members]
        stacked, rows = stack_inputs(parts)
        # What parts may differ in beside their rows (stack_key holds the rest equal).
        own = [(p.id, p.route_key, p.owner, p.parameters) for p in parts]
        head = request_fields(parts[0])
        head = (*head[:INPUTS_FIELD], stacked, *head[INPUTS_FIELD + 1 :])
        return STACK, head, own, rows

    def _answered(
        self,
        answer: asyncio.Future[Any],
        entries_of: list[list[int]],
        rows_of: list[list[int] | None],
    ) -> None:
        if answer.cancelled():
            return
        error = answer.exception()
        if error is not None:
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            return
        for members, rows, (ok, value) in zip(entries_of, rows_of, answer.result(), strict=True):
            if len(members) == 1:
                self._settle(members[0], ok, value)
            elif ok is None:  # unstacked by the engine: an answer per part
                for index, (part_ok, part_value) in zip(members, value, strict=True):
                    self._settle(index, part_ok, part_value)
            else:
                self._cut(members, cast(list[int], rows), response_from(value))

    def _settle(self, index: int, ok: bool, value: Any) -> None:
        waiter = self._waiters[index]
        if waiter.done():
            return
        if ok:
            waiter.set_result(response_from(value))
        else:
            waiter.set_exception(rebuild_error(value))

    def _cut(self, members: list[int], rows: list[int], stacked: InferResponse) -> None:
        ids = [self._requests[index].id for index in members]
        for index, response in zip(members, cut(stacked, ids, rows), strict=True):
            waiter = self._waiters[index]
            if not waiter.done():
                waiter.set_result(response)


def answer_group(service: InferenceService) -> Callable[[list[Any]], Awaitable[list[Any]]]:
    """The engine's ``infer_group`` call, answered by ``service`` (its ModelServer)."""

    async def infer_group(entries: list[tuple[Any, ...]]) -> list[tuple[Any, Any]]:
        return (await _answer_entries(service, [entries]))[0]

    return infer_group


def answer_groups(
    service: InferenceService,
) -> Callable[[list[tuple[Any, ...]]], Awaitable[list[tuple[bool, Any]]]]:
    """Several ``infer_group`` calls that reached the engine in one turn of its loop (from
    several front ends; :class:`~slipstream.engine.host.EngineHost` gathers them), served
    together: alike entries of different calls are merged into one stack. Takes each
    call's arguments, answers each as ``infer_group`` would alone."""

    async def infer_groups(calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
        answers = await _answer_entries(service, [args[0] for args in calls])
        return [(True, answer) for answer in answers]

    return infer_groups


def answer_gathered(
    service: InferenceService,
) -> Callable[[list[tuple[Any, ...]]], Awaitable[list[tuple[bool, Any]]]]:
    """Lone ``infer`` calls that reached the engine in one turn of its loop, from one
    front end or several (:class:`~slipstream.engine.host.EngineHost` gathers them), served
    as a group by ``service``: alike ones stacked here, as a front end stacks its own.
    Takes each call's arguments (the request's fields), answers each as ``infer`` would
    alone: (True, response fields) or (False, error state)."""

    async def infer_gathered(calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
        pieces = [_Piece(request_from(args[0])) for args in calls]
        return [_sent(outcome) for outcome in await _serve(service, pieces)]

    return infer_gathered


async def _answer_entries(
    service: InferenceService, groups: list[list[tuple[Any, ...]]]
) -> list[list[tuple[Any, Any]]]:
    """Each group's answers (see the module docstring), its entries served with every
    other group's."""
    pieces = [
        _Piece(request_from(entry[1]))
        if entry[0] == ONE
        else _Piece(request_from(entry[1]), entry[2], entry[3])
        for entries in groups
        for entry in entries
    ]
    outcomes = iter(await _serve(service, pieces))
    answers: list[list[tuple[Any, Any]]] = []
    for entries in groups:
        answers.append([])
        for entry in entries:
            outcome = next(outcomes)
            if entry[0] == ONE:
                answers[-1].append(_sent(outcome))
            elif isinstance(outcome, InferResponse):
                answers[-1].append((True, response_fields(outcome)))
            else:
                answers[-1].append((None, [_sent(part) for part in outcome]))
    return answers


@dataclasses.dataclass(slots=True)
class _Piece:
    """A request or a front end's stack as it reached the engine: a stack's ``head``
    holds its stacked inputs, ``own`` its parts' (id, route_key, owner, parameters) and
    ``rows`` theirs; a lone request has neither."""

    head: InferRequest
    own: list[tuple[str, str, str, dict[str, Any]]] | None = None
    rows: list[int] | None = None

    def parts(self) -> tuple[list[tuple[str, str, str, dict[str, Any]]], list[int]]:
        if self.own is not None and self.rows is not None:
            return self.own, self.rows
        head = self.head
        return [(head.id, head.route_key, head.owner, head.parameters)], [_rows(head)]


async def _serve(service: InferenceService, pieces: list[_Piece]) -> list[Any]:
    """Each piece's outcome: a lone request's response or error; a stack's stacked
    response, or an outcome per part. Alike pieces (:func:`stack_key` of their heads) run
    as one stack, each still answered as it would be alone."""
    outcomes: list[Any] = [None] * len(pieces)
    ones: list[int] = []
    stacks: list[list[int]] = []
    work: list[Awaitable[Any]] = []
    for members in _merges(pieces):
        if len(members) == 1 and pieces[members[0]].own is None:
            ones.append(members[0])
            continue
        merged = [pieces[index] for index in members]
        head = merged[0].head
        if len(merged) > 1:
            head = dataclasses.replace(head, inputs=stack_inputs([p.head for p in merged])[0])
        own: list[tuple[str, str, str, dict[str, Any]]] = []
        rows: list[int] = []
        for piece in merged:
            piece_own, piece_rows = piece.parts()
            own += piece_own
            rows += piece_rows
        stacks.append(members)
        work.append(service.infer_stack(head, _Parts(head, own), rows))
    if ones:
        work.insert(0, service.infer_group([pieces[index].head for index in ones]))
    # One piece of work (the usual case under load: one stack) is awaited here, not
    # wrapped in a task of its own.
    done = [await work[0]] if len(work) == 1 else await asyncio.gather(*work)
    if ones:
        for index, outcome in zip(ones, done.pop(0), strict=True):
            outcomes[index] = outcome
    for members, outcome in zip(stacks, done, strict=True):
        if len(members) == 1:
            outcomes[members[0]] = outcome
            continue
        row = part = 0
        for index in members:
            piece = pieces[index]
            piece_own, piece_rows = piece.parts()
            count, rows_here = len(piece_own), sum(piece_rows)
            if isinstance(outcome, InferResponse):
                cut_outputs = {n: a[row : row + rows_here] for n, a in outcome.outputs.items()}
                mine: Any = InferResponse(
                    outcome.model_name, outcome.model_version, cut_outputs, id=piece.head.id
                )
            else:
                mine = outcome[part : part + count]
                if piece.own is None:
                    mine = mine[0]
            outcomes[index] = mine
            row += rows_here
            part += count
    return outcomes


def _merges(pieces: list[_Piece]) -> list[list[int]]:
    """Which pieces run as one stack: alike ones (:func:`plan`) whose inputs are small
    enough to copy into one on the engine's loop; larger ones run as they came (the
    batcher joins their rows on the instance's thread, off the loop)."""
    merges: list[list[int]] = []
    for members in plan([piece.head for piece in pieces]):
        size = sum(a.nbytes for i in members for a in pieces[i].head.inputs.values())
        if len(members) > 1 and size > MERGE_MAX_BYTES * len(members):
            merges += [[index] for index in members]
        else:
            merges.append(members)
    return merges


def _rows(request: InferRequest) -> int:
    return int(next(iter(request.inputs.values())).shape[0])


class _Parts(Sequence[InferRequest]):
    """A stack's parts as requests, each made only when asked for (the serving core
    needs them only to unstack)."""

    def __init__(self, head: InferRequest, own: list[tuple[str, str, str, dict[str, Any]]]):
        self._head = head
        self._own = own

    def __len__(self) -> int:
        return len(self._own)

    @overload
    def __getitem__(self, index: int) -> InferRequest: ...

    @overload
    def __getitem__(self, index: slice) -> list[InferRequest]: ...

    def __getitem__(self, index: int | slice) -> InferRequest | list[InferRequest]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        request_id, route_key, owner, parameters = self._own[index]
        return dataclasses.replace(
            self._head, inputs={}, id=request_id, route_key=route_key, owner=owner,
            parameters=parameters,
        )  # fmt: skip


def _sent(outcome: InferResponse | Exception) -> tuple[bool, Any]:
    if isinstance(outcome, InferResponse):
        return True, response_fields(outcome)
    if not isinstance(outcome, SlipstreamError):
        logger.error("engine: infer failed", exc_info=outcome)
    return False, error_state(outcome)
