"""Every HTTP request enters here: the middleware chain, then routing by path prefix.

    router = Router(fallback=v2_app.handle, routes=[("/v1/", openai_app.handle)])
    server = HttpServer(router.handle, ...)

Middleware is where concerns that every route must pass belong: request ids, access
logs, API keys, rate limits, size limits (the front door). Each one is an
``async (request, call_next) -> response`` callable; the chain is composed once, at
construction, so a router without middleware costs one prefix check per request. The
gRPC front end has the matching hook: ``build_grpc_server(..., interceptors=...)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Protocol

from slipstream.errors import ClientError, MethodNotAllowed, NotFound
from slipstream.protocol.openapi import allowed_methods, openapi_document
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse

Reply = HttpResponse | StreamingResponse
Handler = Callable[[HttpRequest], Awaitable[Reply]]


class Middleware(Protocol):
    """Runs before the routes: answers itself, or passes the request on with
    ``call_next(request)``. The chain passes ``call_next`` by that name."""

    def __call__(self, request: HttpRequest, /, call_next: Handler) -> Awaitable[Reply]: ...


class Router:
    """Routes by the first matching path prefix, else to ``fallback``; see the module doc."""

    def __init__(
        self,
        fallback: Handler,
        routes: Sequence[tuple[str, Handler]] = (),
        middleware: Sequence[Middleware] = (),
    ) -> None:
        self._routes = tuple(routes)
        self._fallback = fallback
        handler: Handler = self._route
        for layer in reversed(middleware):
            # A partial runs the layer with no Python frame of its own (a function
            # handing the layer's awaitable back was one more call every request).
            handler = partial(layer, call_next=handler)
        self.handle: Handler = handler

    async def _route(self, request: HttpRequest) -> Reply:
        for prefix, handler in self._routes:
            if request.path.startswith(prefix):
                return await handler(request)
        return await self._fallback(request)


def known_routes() -> list[tuple[str, str]]:
    """Every (method, path template) the HTTP front end answers: the table its 405s come
    from and /openapi.json lists. The front door's tests enumerate this, so no route
    escapes an access rule."""
    return [
        (method.upper(), template)
        for template, item in openapi_document("")["paths"].items()
        for method in item
        if method in ("get", "post")
    ]


def no_route(method: str, path: str) -> ClientError:
    """What a request that no route answers gets: 405 (with Allow) when the path names a
    route of other methods, else 404 (also for a route of the API that this server does
    not mount)."""
    allow = allowed_methods(path)
    if allow and method not in allow:
        return MethodNotAllowed(f"{method} is not allowed on {path}; use {', '.join(allow)}", allow)
    if allow:
        return NotFound(f"{method} {path} is not served here")
    return NotFound(f"no route for {method} {path}")
