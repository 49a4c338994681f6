"""Inference requests sent to the engine in groups, alike ones stacked into one tensor.

Under load a front end reads many requests in one poll of its event loop. One engine
call each would cost the engine's event loop (the one a GPU waits on between batches) a
message, a task and the serving core's whole per-request path apiece. Instead the
requests a front end makes in one turn of its loop (:class:`Group`) leave at the turn's
end in one ``infer_group`` call per model (so that a slow model's answers never hold
back a fast one's), and among them those that could share a batch anyway
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
refuses, a routed or cached model). A model's lone request goes as a plain ``infer``
call. When every requester of a call has given up (its client went away), the engine is
told to drop the work.

Calls that reach the engine in one turn of its loop are gathered there
(:class:`~slipstream.engine.host.EngineHost`'s ``gathered``): lone ``infer`` calls (from
several front ends, or from gRPC front ends, which see one call a turn) and several front
ends' ``infer_group`` calls are served the same way, alike requests and stacks of any of
them stacked together by the engine (:func:`answer_gathered`, :func:`answer_groups`),
and each call answered as soon as its own requests are done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast, overload

import numpy as np

from slipstream.engine.client import EngineClient
from slipstream.engine.host import Gatherer, Reply
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
# Above this many bytes of inputs a request (on average; for the engine, a piece: a
# request or a front end's stack) alike ones are not copied into one stack: at ~5 GB/s,
# 32 KB is a few microseconds, less than stacking saves a request; a large image is not.
MERGE_MAX_BYTES = 32 * 1024


def stack_key(request: InferRequest) -> tuple[Any, ...] | None:
    """What requests must share to travel stacked; None for one that travels alone
    (shared memory, a scalar or empty input, inputs of unequal batch dims, objects)."""
    if request.shared_memory_inputs or not request.inputs or "sequence_id" in request.parameters:
        return None  # a stateful model's requests run one at a time per sequence
    outputs = None
    if request.outputs is not None:
        if any(output.shared_memory or output.classification for output in request.outputs):
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
    (:func:`stack_key`) in one, entries in the order of their first request. Alike
    requests whose inputs average more than :data:`MERGE_MAX_BYTES` travel alone: copying
    them into one stack on an event loop would cost more than it saves (the batcher joins
    their rows on the instance's thread, off the loop)."""
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
    planned: list[list[int]] = []
    for members in entries:
        size = sum(a.nbytes for i in members for a in requests[i].inputs.values())
        if len(members) > 1 and size > MERGE_MAX_BYTES * len(members):
            planned += [[index] for index in members]
        else:
            planned.append(members)
    return planned


def stack_inputs(parts: Sequence[InferRequest]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Alike requests' inputs, one tensor per input (their rows one after another), and
    each request's rows."""
    stacked = {name: np.concatenate([part.inputs[name] for part in parts])
               for name in parts[0].inputs}  # fmt: skip
    return stacked, [_rows(part) for part in parts]


class Group:
    """One front end's infer requests of one turn of its event loop; see the module
    docstring. ``add`` each, ``send`` once at the turn's end. Each model's requests go
    in a call of their own, so a slow model's answer never holds back another's."""

    __slots__ = ("_call_of", "_calls", "_client", "_loop", "_requests", "_waiters")

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._requests: list[InferRequest] = []
        self._waiters: list[asyncio.Future[Any]] = []
        # Once sent: each call's [id, requests, requesters gone], and each request's call.
        self._calls: list[list[int]] = []
        self._call_of: list[int] = []

    def add(self, request: InferRequest) -> asyncio.Future[Any]:
        """The future ``request``'s answer settles: pass its result to :meth:`response`."""
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._requests.append(request)
        self._waiters.append(waiter)
        return waiter

    @property
    def size(self) -> int:
        """Requests added so far."""
        return len(self._requests)

    @staticmethod
    def response(answer: Any) -> InferResponse:
        """A settled answer as the response (a lone request's comes as its fields)."""
        return answer if isinstance(answer, InferResponse) else response_from(answer)

    def left(self, waiter: asyncio.Future[Any]) -> None:
        """The requester of ``waiter`` gave up; the last one to leave a sent call cancels
        it (before the group is sent, :meth:`send` leaves it out)."""
        if not self._calls:
            return
        call = self._calls[self._call_of[self._waiters.index(waiter)]]
        call[2] += 1
        if call[2] == call[1]:
            self._client.give_up(call[0])

    def send(self) -> None:
        if any(waiter.done() for waiter in self._waiters):  # given up before it left
            kept = [(r, w) for r, w in zip(self._requests, self._waiters, strict=True)
                    if not w.done()]  # fmt: skip
            self._requests = [r for r, _ in kept]
            self._waiters = [w for _, w in kept]
            if not kept:
                return
        by_model: dict[tuple[str, str], list[int]] = {}
        for index, request in enumerate(self._requests):
            by_model.setdefault((request.model_name, request.model_version), []).append(index)
        self._call_of = [0] * len(self._requests)
        for indices in by_model.values():
            for index in indices:
                self._call_of[index] = len(self._calls)
            self._calls.append([self._start(indices), len(indices), 0])
        self._client.flush()  # this already runs at a turn's end: no turn more

    def _start(self, indices: list[int]) -> int:
        """Starts the call for one model's requests (``indices``); its id."""
        if len(indices) == 1:
            # The requester's own future takes the engine's answer: its response's
            # fields, made a response by the requester (Group.response).
            call_id, _ = self._client.start_call(
                "infer", request_fields(self._requests[indices[0]]), into=self._waiters[indices[0]]
            )
            return call_id
        requests = [self._requests[index] for index in indices]
        entries_of = [[indices[member] for member in members] for members in plan(requests)]
        entries = [self._entry(members) for members in entries_of]
        # Each entry's rows per part (a stack's, as sent; None for a lone request).
        rows_of = [entry[3] if entry[0] == STACK else None for entry in entries]
        call_id, answer = self._client.start_call("infer_group", entries)
        answer.add_done_callback(lambda done: self._answered(done, indices, entries_of, rows_of))
        return call_id

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
        indices: list[int],
        entries_of: list[list[int]],
        rows_of: list[list[int] | None],
    ) -> None:
        if answer.cancelled():
            return
        error = answer.exception()
        if error is not None:
            for index in indices:
                if not self._waiters[index].done():
                    self._waiters[index].set_exception(error)
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
        answers: list[list[tuple[Any, Any]]] = []
        await _answer_entries(service, [entries], lambda _, answer: answers.append(answer))
        return answers[0]

    return infer_group


def answer_groups(service: InferenceService) -> Gatherer:
    """Several ``infer_group`` calls that reached the engine in one turn of its loop (from
    several front ends; :class:`~slipstream.engine.host.EngineHost` gathers them), served
    together: alike entries of different calls are merged into one stack. Each call is
    answered, as ``infer_group`` would answer it alone, when its last entry is done."""

    async def infer_groups(calls: list[tuple[Any, ...]], reply: Reply) -> None:
        groups = [args[0] for args in calls]
        await _answer_entries(service, groups, lambda index, answer: reply(index, True, answer))

    return infer_groups


def answer_gathered(service: InferenceService) -> Gatherer:
    """Lone ``infer`` calls that reached the engine in one turn of its loop, from one
    front end or several (:class:`~slipstream.engine.host.EngineHost` gathers them), served
    as a group by ``service``: alike ones stacked here, as a front end stacks its own.
    Each is answered as ``infer`` would answer it alone ((True, response fields) or
    (False, error state)), as soon as it is done."""

    async def infer_gathered(calls: list[tuple[Any, ...]], reply: Reply) -> None:
        pieces = [_Piece(request_from(args[0])) for args in calls]
        await _serve(service, pieces, lambda index, outcome: reply(index, *_sent(outcome)))

    return infer_gathered


async def _answer_entries(
    service: InferenceService,
    groups: list[list[tuple[Any, ...]]],
    done: Callable[[int, list[tuple[Any, Any]]], None],
) -> None:
    """Serves the groups' entries together; ``done(group's place, its answers)`` (see the
    module docstring) as soon as a group's last entry is done."""
    pieces: list[_Piece] = []
    owners: list[tuple[int, int]] = []  # each piece's (group, entry)
    for group, entries in enumerate(groups):
        for place, entry in enumerate(entries):
            head = request_from(entry[1])
            pieces.append(_Piece(head) if entry[0] == ONE else _Piece(head, entry[2], entry[3]))
            owners.append((group, place))
    answers: list[list[Any]] = [[None] * len(entries) for entries in groups]
    waiting = [len(entries) for entries in groups]

    def settle(index: int, outcome: Any) -> None:
        group, place = owners[index]
        if groups[group][place][0] == ONE:
            answers[group][place] = _sent(outcome)
        elif isinstance(outcome, InferResponse):
            answers[group][place] = (True, response_fields(outcome))
        else:
            answers[group][place] = (None, [_sent(part) for part in outcome])
        waiting[group] -= 1
        if not waiting[group]:
            done(group, answers[group])

    await _serve(service, pieces, settle)


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


async def _serve(
    service: InferenceService, pieces: list[_Piece], settle: Callable[[int, Any], None]
) -> None:
    """Serves ``pieces``, calling ``settle(index, outcome)`` for each as soon as it is
    done: a lone request's response or error; a stack's stacked response, or an outcome
    per part. Alike pieces (:func:`stack_key` of their heads) run as one stack, each
    still answered as it would be alone; lone requests run one group per model, so a
    slow model's never hold back another's."""
    units: list[Awaitable[None]] = []
    ones: dict[tuple[str, str], list[int]] = {}
    for members in plan([piece.head for piece in pieces]):
        first = pieces[members[0]]
        if len(members) == 1 and first.own is None:
            model = (first.head.model_name, first.head.model_version)
            ones.setdefault(model, []).append(members[0])
            continue
        head = first.head
        if len(members) > 1:
            inputs = stack_inputs([pieces[index].head for index in members])[0]
            head = dataclasses.replace(head, inputs=inputs)
        own: list[tuple[str, str, str, dict[str, Any]]] = []
        rows: list[int] = []
        for index in members:
            piece_own, piece_rows = pieces[index].parts()
            own += piece_own
            rows += piece_rows
        units.append(_run_stack(service, pieces, members, head, own, rows, settle))
    units += [_run_ones(service, pieces, indices, settle) for indices in ones.values()]
    # One unit (the usual case under load: one stack) is awaited here, not wrapped in a
    # task of its own.
    if len(units) == 1:
        await units[0]
    else:
        await asyncio.gather(*units)


async def _run_ones(
    service: InferenceService,
    pieces: list[_Piece],
    indices: list[int],
    settle: Callable[[int, Any], None],
) -> None:
    outcomes = await service.infer_group([pieces[index].head for index in indices])
    for index, outcome in zip(indices, outcomes, strict=True):
        settle(index, outcome)


async def _run_stack(
    service: InferenceService,
    pieces: list[_Piece],
    members: list[int],
    head: InferRequest,
    own: list[tuple[str, str, str, dict[str, Any]]],
    rows: list[int],
    settle: Callable[[int, Any], None],
) -> None:
    """One stack of the ``members`` pieces; each piece's share of its outcome."""
    outcome = await service.infer_stack(head, _Parts(head, own), rows)
    if len(members) == 1:
        settle(members[0], outcome)
        return
    merged = [pieces[index] for index in members]
    if isinstance(outcome, InferResponse):  # each piece's rows, as its own stack's
        shares = cut(outcome, [p.head.id for p in merged], [sum(p.parts()[1]) for p in merged])
        for index, share in zip(members, shares, strict=True):
            settle(index, share)
        return
    part = 0  # an outcome per part: each piece's parts', a lone request's own
    for index, piece in zip(members, merged, strict=True):
        count = len(piece.parts()[0])
        mine = outcome[part : part + count]
        settle(index, mine if piece.own is not None else mine[0])
        part += count


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
