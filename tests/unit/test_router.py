"""The HTTP router: prefix routing and the middleware chain every route passes."""

from __future__ import annotations

from slipstream.server.httpd import HttpRequest, HttpResponse
from slipstream.server.router import Handler, Reply, Router


def request(path: str) -> HttpRequest:
    return HttpRequest(method="GET", path=path, query=b"", headers=[], body=b"")


def answering(text: str) -> Handler:
    async def handle(req: HttpRequest) -> Reply:
        return HttpResponse(200, f"{text} {req.path}".encode())

    return handle


async def test_first_matching_prefix_wins_else_the_fallback() -> None:
    router = Router(
        fallback=answering("v2"), routes=[("/v1/", answering("openai")), ("/v1", answering("x"))]
    )
    for path, body in [
        ("/v1/models", b"openai /v1/models"),
        ("/v2/health/live", b"v2 /v2/health/live"),
    ]:
        reply = await router.handle(request(path))
        assert isinstance(reply, HttpResponse) and reply.body == body


async def test_middleware_runs_in_order_around_every_route_and_may_answer_itself() -> None:
    seen: list[str] = []

    async def tag(req: HttpRequest, call_next: Handler) -> Reply:
        seen.append(f"tag {req.path}")
        reply = await call_next(req)
        seen.append("tag done")
        return reply

    async def keys(req: HttpRequest, call_next: Handler) -> Reply:
        seen.append("keys")
        if req.path.endswith("/secret"):
            return HttpResponse(401, b"no key")
        return await call_next(req)

    router = Router(answering("v2"), [("/v1/", answering("openai"))], middleware=[tag, keys])
    ok = await router.handle(request("/v1/models"))
    assert isinstance(ok, HttpResponse) and ok.status == 200 and ok.body == b"openai /v1/models"
    assert seen == ["tag /v1/models", "keys", "tag done"]
    seen.clear()
    refused = await router.handle(request("/v2/secret"))
    assert isinstance(refused, HttpResponse) and refused.status == 401
    assert seen == ["tag /v2/secret", "keys", "tag done"]
