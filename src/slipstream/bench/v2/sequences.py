"""Sequences for a stateful model (``sequence_batching``), as perf_analyzer drives them.

A stateful model answers only requests that name their sequence (request parameter
``sequence_id``) and flag its first (``sequence_start``) and last (``sequence_end``)
request. When the model's config (``/v2/models/{m}/config`` or the ModelConfig RPC) has
``sequence_batching``, every request a worker sends belongs to a sequence of
``--sequence-length`` requests:

- a request takes an open sequence with no request outstanding, or starts a new one
  (a fresh id, ``sequence_start``): in closed loop each virtual user so drives its own
  sequences one after another; in open loop as many run side by side as requests are
  outstanding;
- the sequence's last request carries ``sequence_end``; the next request starts another;
- a failed request leaves its sequence (the server may have dropped it; it frees one it
  kept after ``max_sequence_idle_microseconds``) and the next request starts another;
- when a level stops, each sequence it cut short gets one more request, with
  ``sequence_end`` and not counted, so no sequence is left open on the server until its
  idle timeout.

Ids are unique across workers and runs: integers ``run_tag + worker + k * stride``
(wrapped into what the model's CORRID control holds: INT32 ids stay below 2**31), or
strings ``"<run_tag>-<worker>-<k>"`` where the CORRID control is TYPE_STRING.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from slipstream.bench.v2.messages import EncodedRequest, Protocol, SequenceIdKind, SequencePlan

# The largest id each CORRID datatype holds; without a CORRID control, any int64.
_MAX_IDS = {"TYPE_INT32": 2**31 - 1, "TYPE_UINT32": 2**32 - 1}
_MAX_INT64 = 2**63 - 1


def sequence_plan(
    config: Mapping[str, Any] | None, length: int, ids: str, workers: int
) -> SequencePlan | None:
    """The plan for a model whose ``config`` (Triton's JSON form) has sequence_batching;
    None for a stateless model. ``ids``: "auto" (strings where the CORRID control is
    TYPE_STRING), "int" or "string"; ``workers``: the most worker processes."""
    batching = (config or {}).get("sequence_batching")
    if not isinstance(batching, Mapping):
        return None
    corrid = _corrid_datatype(batching)
    id_kind: SequenceIdKind
    if ids == "auto":
        id_kind = "string" if corrid == "TYPE_STRING" else "int"
    else:
        id_kind = "string" if ids == "string" else "int"
    max_id = _MAX_IDS.get(corrid, _MAX_INT64)
    return SequencePlan(
        length=length,
        id_kind=id_kind,
        max_id=max_id,
        run_tag=secrets.randbelow(max_id),
        stride=max(1, workers),
    )


def _corrid_datatype(batching: Mapping[str, Any]) -> str:
    """The data_type of the CORRID control input ("" without one)."""
    for control_input in batching.get("control_input") or []:
        for control in control_input.get("control") or []:
            if control.get("kind") == "CONTROL_SEQUENCE_CORRID":
                return str(control.get("data_type", ""))
    return ""


# --------------------------------------------------------------------- request bodies


def sequence_parameters(sequence_id: int | str, start: bool, end: bool) -> bytes:
    """The three parameters as the members of a JSON object (no braces)."""
    return b'"sequence_id":%s,"sequence_start":%s,"sequence_end":%s' % (
        orjson.dumps(sequence_id),
        b"true" if start else b"false",
        b"true" if end else b"false",
    )


def in_sequence(
    protocol: Protocol, request: EncodedRequest, sequence_id: int | str, start: bool, end: bool
) -> EncodedRequest:
    """``request`` (as :mod:`.payloads` encodes it) with the sequence's parameters; a
    binary-tensor request (its ``header_length`` set) is one for either HTTP protocol."""
    if protocol == "grpc":
        body = request.body + _grpc_parameters(sequence_id, start, end)
        return EncodedRequest(body, None, request.batch_size)
    members = sequence_parameters(sequence_id, start, end)
    if request.header_length is None:
        # {"inputs":[...]} -> {"inputs":[...],"parameters":{...}}
        body = b'%s,"parameters":{%s}}' % (request.body[:-1], members)
        return EncodedRequest(body, None, request.batch_size)
    # The binary header ends its parameters object and itself: ...,"parameters":{...}}
    header = request.body[: request.header_length]
    header = b"%s,%s}}" % (header[:-2], members)
    body = header + request.body[request.header_length :]
    return EncodedRequest(body, len(header), request.batch_size)


def _grpc_parameters(sequence_id: int | str, start: bool, end: bool) -> bytes:
    """ModelInferRequest.parameters entries, serialised: appended to a serialised request
    they merge into it (a protobuf message's fields may come in any order)."""
    from slipstream.protocol.proto import inference_pb2 as pb

    message = pb.ModelInferRequest()
    if isinstance(sequence_id, str):
        message.parameters["sequence_id"].string_param = sequence_id
    else:
        message.parameters["sequence_id"].int64_param = sequence_id
    message.parameters["sequence_start"].bool_param = start
    message.parameters["sequence_end"].bool_param = end
    return bytes(message.SerializeToString())


# --------------------------------------------------------------------- the worker's side


# Sends request ``index`` in sequence (id, start, end); None on success, else an error key.
SendInSequence = Callable[[int, int | str, bool, bool], Awaitable[str | None]]


@dataclass(slots=True)
class _Open:
    """A sequence of this worker that has not ended."""

    sequence_id: int | str
    # Requests sent in it so far.
    sent: int = 0


class WorkerSequences:
    """One worker's sequences: the ids it has used, and those open in the current level."""

    def __init__(self, plan: SequencePlan, worker_id: int) -> None:
        self._plan = plan
        self._worker_id = worker_id
        # Sequences started by this worker, over every level (the next id's number).
        self.started = 0
        # Sequences ended with a request carrying sequence_end (cut ones included).
        self.ended = 0
        # Open sequences with no request outstanding, the latest last.
        self._idle: list[_Open] = []

    def sender(self, send: SendInSequence) -> Callable[[int], Awaitable[str | None]]:
        """A LoadDriver's ``send``: each request in a sequence, as the module says."""
        length = self._plan.length

        async def send_next(index: int) -> str | None:
            sequence = self._idle.pop() if self._idle else self._start()
            start = sequence.sent == 0
            end = sequence.sent + 1 >= length
            outcome = await send(index, sequence.sequence_id, start, end)
            sequence.sent += 1
            if outcome is None and end:
                self.ended += 1
            elif outcome is None:
                self._idle.append(sequence)
            return outcome

        return send_next

    async def end_open(self, send: SendInSequence) -> None:
        """Send each open sequence its last request (sequence_end; not counted)."""
        idle, self._idle = self._idle, []
        outcomes = await asyncio.gather(*(send(0, s.sequence_id, False, True) for s in idle))
        self.ended += sum(outcome is None for outcome in outcomes)

    def _start(self) -> _Open:
        sequence = _Open(self._plan.sequence_id(self._worker_id, self.started))
        self.started += 1
        return sequence
