"""The HTTP side of the front door: one router middleware for API keys, per-key rate
limits, request ids and the access log (the checks live in :mod:`slipstream.security`).

Installed only when one of them is configured, so a server without them pays nothing.
Refusals are answered in the route's error shape: OpenAI's on ``/v1/`` (but for KServe V1's
``:predict``), V2's elsewhere.

Example::

    door = HttpFrontDoor(gate, limiter, access_log=True)
    router = Router(v2_app.handle, [("/v1/", openai_app.handle)], middleware=[door])
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable

import orjson

from slipstream.errors import SlipstreamError, TooManyRequests, Unauthenticated
from slipstream.protocol import openai_replies as replies
from slipstream.protocol import v2
from slipstream.protocol.kserve_v1 import is_predict_path
from slipstream.security.access import HttpAccess, RouteAccess
from slipstream.security.gate import AccessRecord, Gate, body_model, request_id
from slipstream.security.keys import ApiKey
from slipstream.security.limits import Limiter
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse, error_reply
from slipstream.server.router import Handler, Reply, no_route

_REQUEST_ID = b"x-request-id"
_HEADER_LENGTH = b"inference-header-content-length"
# A request's access before its path is classified (a refusal may come first).
_UNCLASSIFIED = RouteAccess("key")


class HttpFrontDoor:
    """A :class:`Router` middleware; see the module docstring."""

    def __init__(self, gate: Gate | None, limiter: Limiter | None, access_log: bool) -> None:
        self._gate = gate
        self._limiter = limiter
        self._access_log = access_log
        self._access = HttpAccess()
        self._seen = self._access.seen
        # Whether each request takes the whole door (_door): what it owes after the reply
        # is not known before it (an access-log line, a store that awaits Redis).
        self._full = access_log or (limiter is not None and not limiter.local)

    def __call__(self, request: HttpRequest, call_next: Handler) -> Awaitable[Reply]:
        """The checks, then the route. Where nothing is left to do after the reply (no
        access log, a local limiter that counted nothing, no tokens to charge) the route's
        own awaitable is handed back: no coroutine of the door's sits in the request's
        await chain, whose every resume would pass through it (2-3 us of the ~80 us a
        small model's request costs, measured with py-spy). The path's lookup and the
        header's are inlined: six fewer Python calls here, in the router and the limiter
        saved ~2,100 of the ~560,000 instructions of a request of the example mlp at C=64
        (callgrind, benchmarks/front_door.py --only instructions)."""
        if self._full:
            return self._door(request, call_next)
        limiter = self._limiter
        try:
            path = request.path
            access = self._seen.get(path) or self._access.classify(path)
            key = self._authenticate(request, access)
            counted = False
            if key is not None and limiter is not None:
                counted = limiter.admit_now(key, access.generative)
        except SlipstreamError as exc:
            return _ready(_refusal(exc, request.path))
        # access.generative first: _charges_tokens' call only where it can be true.
        if counted or (
            access.generative and key is not None and limiter is not None
            and _charges_tokens(key, access)
        ):  # fmt: skip
            return self._settle(request, call_next, key, access, counted, "", 0.0)
        return call_next(request)

    def _authenticate(self, request: HttpRequest, access: RouteAccess) -> ApiKey | None:
        """The request's key (None on an open route or without keys); 401/403 raised."""
        gate = self._gate
        if gate is None:
            return None
        if not access.template:
            # The routes read a path more loosely than the rules do (extra '/' dropped):
            # a path no rule names exactly must not reach a route past that route's rule.
            raise no_route(request.method, request.path)
        authorization = None
        for name, value in request.headers:  # request.header(), without its call
            if name == b"authorization":
                authorization = value
                break
        key = gate.authenticate(authorization, access.need)
        if key is not None:
            request.owner = key.name
            if key.models is not None:
                model = _body_model(request) if access.model_in_body else access.model
                gate.authorize_model(key, model, named=access.model_in_body)
                request.models = key.models
        return key

    async def _door(self, request: HttpRequest, call_next: Handler) -> Reply:
        """The whole door: request ids and the access log, a limiter that awaits Redis."""
        started = time.perf_counter() if self._access_log else 0.0
        rid = request_id(request.header(_REQUEST_ID)) if self._access_log else ""
        key: ApiKey | None = None
        access = _UNCLASSIFIED
        counted = False
        limiter = self._limiter
        try:
            access = self._access.classify(request.path)
            key = self._authenticate(request, access)
            if key is not None and limiter is not None:
                counted = await limiter.admit(key, access.generative)
        except SlipstreamError as exc:
            return self._answered(_refusal(exc, request.path), request, key, access, rid, started)
        return await self._settle(request, call_next, key, access, counted, rid, started)

    async def _settle(self, request: HttpRequest, call_next: Handler, key: ApiKey | None,
                      access: RouteAccess, counted: bool, rid: str, started: float,
                      ) -> Reply:  # fmt: skip
        """The route's reply, then what it owes: the concurrency slot back, the tokens
        charged, the access-log line (a stream's at its end)."""
        limiter = self._limiter
        if key is None or limiter is None:
            reply = await call_next(request)
        else:
            try:
                reply = await call_next(request)
            except BaseException:
                if counted:
                    limiter.release(key)
                raise
        if isinstance(reply, StreamingResponse):
            reply.chunks = self._finish_stream(
                reply.chunks, reply.status, request, key, access, counted, rid, started
            )
            if rid:
                reply.headers.append((_REQUEST_ID, rid.encode()))
            return reply
        if key is not None and limiter is not None:
            if counted:
                limiter.release(key)
            if _charges_tokens(key, access):
                await limiter.charge_tokens(key, _usage_tokens(reply.body))
        if rid:
            return self._answered(reply, request, key, access, rid, started)
        return reply

    def _answered(self, reply: HttpResponse, request: HttpRequest, key: ApiKey | None,
                  access: RouteAccess, rid: str, started: float) -> HttpResponse:  # fmt: skip
        if rid:
            reply.headers.append((_REQUEST_ID, rid.encode()))
            self._log(request, reply.status, key, access, rid, started, len(reply.body))
        return reply

    async def _finish_stream(
        self,
        chunks: AsyncIterator[bytes],
        status: int,
        request: HttpRequest,
        key: ApiKey | None,
        access: RouteAccess,
        counted: bool,
        rid: str,
        started: float,
    ) -> AsyncIterator[bytes]:
        """The stream's chunks, then the bookkeeping its end allows: the concurrency slot
        back, its tokens charged, its access-log line."""
        sent = events = 0
        usage = 0
        try:
            async for chunk in chunks:
                sent += len(chunk)
                events += 1
                if b'"usage":{' in chunk:
                    data = chunk[chunk.find(b"data: ") + 6 :]
                    usage = _usage_tokens(data.strip()) or usage
                yield chunk
        finally:
            # A client that left closes this generator; the route's own must close at once
            # too (the LLM engine frees the sequence's KV-cache blocks in its finally).
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
            if key is not None and self._limiter is not None:
                if counted:
                    self._limiter.release(key)
                if access.generative and key.limits.tokens_per_minute:
                    # Without a usage chunk, each event carried about one token.
                    await self._limiter.charge_tokens(key, usage or events)
            if rid:
                self._log(request, status, key, access, rid, started, sent)

    def _log(self, request: HttpRequest, status: int, key: ApiKey | None, access: RouteAccess,
             rid: str, started: float, bytes_out: int) -> None:  # fmt: skip
        model = access.model
        if not model and access.model_in_body:
            model = _body_model(request)
        name = key.name if key else request.owner
        if not name and self._gate is not None:  # refused before it was known: 403 (role)
            name = self._gate.key_name(request.header(b"authorization"))
        AccessRecord(
            rid, "http", request.method, request.path, name or "-", model,
            access.version, str(status), (time.perf_counter() - started) * 1e3,
            len(request.body), bytes_out,
        ).emit()  # fmt: skip


def _body_model(request: HttpRequest) -> str:
    """The model a body names, read as the routes read it (binary tensors: from the JSON
    part that Inference-Header-Content-Length measures)."""
    return body_model(request.body, request.header(_HEADER_LENGTH))


def _charges_tokens(key: ApiKey, access: RouteAccess) -> bool:
    """Whether the reply's tokens count against the key's tokens per minute."""
    return access.generative and bool(key.limits.tokens_per_minute)


async def _ready(reply: Reply) -> Reply:
    return reply


def _refusal(exc: SlipstreamError, path: str) -> HttpResponse:
    openai_shape = path.startswith("/v1/") and not is_predict_path(path)  # KServe V1: V2's
    body = replies.error(exc) if openai_shape else v2.encode_error(exc.message)
    reply = error_reply(exc, body)
    if isinstance(exc, Unauthenticated):  # RFC 7235: a 401 names the scheme it wants
        reply.headers.append((b"www-authenticate", b'Bearer realm="slipstream"'))
    if isinstance(exc, TooManyRequests):
        reply.headers += [(name.encode(), value.encode()) for name, value in exc.headers]
    return reply


def _usage_tokens(body: bytes) -> int:
    """prompt + completion tokens of an OpenAI response body (0 when it has no usage)."""
    try:
        usage = orjson.loads(body).get("usage") or {}
        return int(usage.get("total_tokens") or 0)
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 0
